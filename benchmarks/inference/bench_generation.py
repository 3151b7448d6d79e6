"""Generation on a real model: new tokens per second of both engines, each dtype, against a decode step's
roofline measured on this machine in the same run (a benchmark, not a test).

For each engine (the builtin one, "torch", and vLLM's CPU build) and dtype (float32, bfloat16): one server of
--model (scripts/serve.py --model.dtype DTYPE, OMP_NUM_THREADS = --threads), --concurrency requests at once
to /inference/v1/generate, each sampling --max-tokens new tokens at temperature 1 with ignore_eos, from the
same chat prompts (--group N: each prompt N times, as an RL group's rollouts share theirs); tokens/s =
concurrency x max_tokens / wall time, best of --repeats rounds after a short warm-up round. Servers run one
at a time; the dtype each served in is recorded from its own answer where it gives one (its weight
fingerprint), else the one asked for.

The roofline of a decode step that extends `c` sequences of context `t` by a token each:
- bytes: every weight once (the tied output layer is the embedding, counted once) + the KV cache read,
  c x t x layers x 2 x key/value heads x head_dim, in the dtype served;
- FLOPs: c x (2 x the layers' linear weights + 2 x vocabulary x hidden + 4 x layers x heads x head_dim x t);
- its time is at least max(bytes / bandwidth, FLOPs / peak), the bandwidth a read of 1 GiB and the peak the
  best one-thread matmul at the step's shapes (c rows) times --threads, both measured here first.
The bound in tokens/s is c x max_tokens over the sum of the steps' times, t running from the prompt's length,
plus the prefill's: the c prompts through every layer (their attention causal) and the output layer for each
one's last token, every weight read once, at the same peak and bandwidth. A round does that work too: 32
prompts of 42 tokens are ~70% of the FLOPs of 48 decode steps. The decode steps' bound alone is printed
beside it (`decode_roofline_tokens_per_second`).

With --beside-trainer N, each server then generates rounds at the largest concurrency while a one-thread
trainer (the model's forward and backward of a 512-token row under bf16 autocast, N timed iterations, in a
process of its own) runs beside it, as rl.py's trainer runs beside its server on a CPU: the rounds' tokens/s,
the trainer's seconds an iteration beside the server and alone (measured before any server starts), and the
CPU the server's processes used.

Usage (make smollm2 first; the vLLM rows need make setup-vllm):
    python benchmarks/inference/bench_generation.py
    python benchmarks/inference/bench_generation.py --engines torch --dtypes bfloat16 --concurrency 8 64
    python benchmarks/inference/bench_generation.py --dtypes bfloat16 --threads 1 --beside-trainer 6
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import (  # noqa: E402
    DEFAULT_MODEL,
    ROOT,
    bandwidth_gbs,
    check_model,
    matmul_gflops,
    threads,
)
from benchmarks.inference.bench_serve import server_round  # noqa: E402
from lib.inference import launch  # noqa: E402

BYTES = {"float32": 4, "bfloat16": 2}


def decode_shapes(config, rows: int) -> dict[str, tuple[int, int, int]]:
    """(m, k, n) of a decode step's matmuls at `rows` sequences."""
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return {
        "qkv": (rows, hidden, (heads + 2 * kv) * head_dim),
        "o": (rows, heads * head_dim, hidden),
        "gate_up": (rows, hidden, 2 * config.intermediate_size),
        "down": (rows, config.intermediate_size, hidden),
        "output layer": (rows, hidden, config.vocab_size),
    }


def roofline(config, parameters: int, rows: int, prompt: int, new: int, dtype: str, peak: float, gbs: float):
    """(tokens/s bound with the prefill, the decode steps' bound alone, share of the steps bound by memory)
    for `rows` sequences of `prompt` tokens growing by `new`."""
    heads, kv, layers = config.num_attention_heads, config.num_key_value_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    embedding = config.vocab_size * config.hidden_size
    linear = parameters - embedding  # the layers' weights (norms are a rounding error)
    # The prefill: every prompt token through the layers, attending to half its prompt on average.
    flops = rows * (prompt * (2 * linear + 2 * layers * heads * head_dim * prompt) + 2 * embedding)
    prefill = max(parameters * BYTES[dtype] / (gbs * 1e9), flops / (peak * 1e9))
    seconds, memory_bound = 0.0, 0
    for step in range(new):
        context = prompt + step
        nbytes = (parameters + rows * context * layers * 2 * kv * head_dim) * BYTES[dtype]
        flops = rows * (2 * linear + 2 * embedding + 4 * layers * heads * head_dim * context)
        memory, compute = nbytes / (gbs * 1e9), flops / (peak * 1e9)
        seconds += max(memory, compute)
        memory_bound += memory >= compute
    return rows * new / (prefill + seconds), rows * new / seconds, memory_bound / new


async def generate_round(url: str, prompts: list[list[int]], max_tokens: int) -> float:
    """bench_serve.py's round, on a session of its own against the server at `url`."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(url.removesuffix("/v1"), timeout=timeout) as session:
        return await server_round(session, prompts, max_tokens, model="policy")


def train(model: str, iterations: int) -> None:
    """The trainer's work on one thread, each timed iteration's seconds printed on a line of its own."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    network = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = torch.randint(100, network.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    for index in range(iterations + 1):  # the first is a warm-up
        began = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            network(ids, labels=ids).loss.backward()
        network.zero_grad(set_to_none=True)
        if index:
            print(f"{time.perf_counter() - began:.3f}", flush=True)


def trainer(model: str, iterations: int) -> subprocess.Popen:
    command = [sys.executable, __file__, "--model", model, "--train-only", str(iterations)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment)


def seconds(process: subprocess.Popen) -> list[float]:
    output, _ = process.communicate()
    assert process.returncode == 0, f"the trainer failed ({process.returncode})"
    return [float(line) for line in output.split()]


def beside_trainer(url: str, pid: int, prompts, max_tokens: int, model: str, iterations: int) -> dict:
    """Rounds of generation while a one-thread trainer runs: their tokens/s, the trainer's seconds an
    iteration, and the cores the server's processes used meanwhile."""
    import psutil

    server = psutil.Process(pid)
    processes = [server, *server.children(recursive=True)]

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in processes)

    running, rates = trainer(model, iterations), []
    cpu_before, began = cpu(), time.perf_counter()
    while running.poll() is None:
        rates.append(asyncio.run(generate_round(url, prompts, max_tokens)))
    cores = (cpu() - cpu_before) / (time.perf_counter() - began)
    return {"beside_tokens_per_second": rates, "trainer_beside_s": seconds(running), "server_cores": cores}


def served_dtype(url: str, asked: str) -> str:
    """The dtype the server's engine computes in, as its weight fingerprint reports it (both engines answer)."""
    import httpx

    body = {"method": "weight_fingerprint"}
    try:
        answer = httpx.post(url.removesuffix("/v1") + "/collective_rpc", json=body, timeout=300)
        return answer.json()["results"][0]["dtype"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return f"{asked} (asked; not reported)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"], choices=["torch", "vllm"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(BYTES))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--group",
        type=int,
        default=1,
        help="requests a prompt (an RL group's rollouts share it: 8 in the presets)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads", type=int, default=2, help="the server's threads (and the peak's multiple)"
    )
    parser.add_argument("--beside-trainer", type=int, default=0, metavar="N", help="see the docstring")
    parser.add_argument("--train-only", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_generation.json")
    args = parser.parse_args()
    check_model(args.model)
    if args.train_only:
        return train(args.model, args.train_only)

    import torch
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    biggest = max(args.concurrency)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Tell me a short story about the number {i // args.group}."}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i in range(biggest)
    ]
    prompt_length = sum(map(len, prompts)) / len(prompts)

    print(f"limits on {args.threads} thread(s):")
    with threads(args.threads):
        gbs = bandwidth_gbs()["sum_gbs"]
    print(f"  read bandwidth {gbs:.1f} GB/s")
    peaks = {}
    with threads(1):
        for dtype in args.dtypes:
            for rows in args.concurrency:
                best = max(
                    matmul_gflops(*shape, getattr(torch, dtype))[0]
                    for shape in decode_shapes(config, rows).values()
                )
                peaks[dtype, rows] = best * args.threads
                print(
                    f"  matmul peak {dtype} at {rows} rows: {best:.0f} GFLOP/s on one thread x {args.threads}"
                )

    alone = seconds(trainer(args.model, args.beside_trainer)) if args.beside_trainer else []
    if alone:
        print(f"trainer alone, one thread: {', '.join(f'{x:.2f}' for x in alone)} s an iteration")
    results = []
    for engine in args.engines:
        for dtype in args.dtypes:
            extra = ["--model.dtype", dtype, "--max-batch-size", str(biggest), "--max-model-len", "512"]
            extra += ["--served-model-name", "policy"]
            log = ROOT / "outputs" / "logs" / f"bench-generation-{engine}-{dtype}.log"
            began = time.perf_counter()
            with launch.running_server(
                args.model, engine=engine, extra_args=extra, log_path=log, threads=args.threads
            ) as server:
                started = time.perf_counter() - began
                served = served_dtype(server.url, dtype)
                for rows in args.concurrency:
                    asyncio.run(generate_round(server.url, prompts[:rows], 4))  # warm-up
                    rate = max(
                        asyncio.run(generate_round(server.url, prompts[:rows], args.max_tokens))
                        for _ in range(args.repeats)
                    )
                    bound, decode_bound, memory_share = roofline(
                        config,
                        parameters,
                        rows,
                        prompt_length,
                        args.max_tokens,
                        dtype,
                        peaks[dtype, rows],
                        gbs,
                    )
                    row = {
                        "engine": engine, "dtype": dtype, "served_dtype": served, "concurrency": rows,
                        "tokens_per_second": rate, "roofline_tokens_per_second": bound,
                        "decode_roofline_tokens_per_second": decode_bound,
                        "of_roofline": rate / bound, "memory_bound_steps": memory_share,
                        "server_start_seconds": started,
                    }  # fmt: skip
                    results.append(row)
                    print(
                        f"{engine:5s} {dtype:8s} (served {served}) c={rows:3d}: {rate:7.1f} new tokens/s; "
                        f"roofline {bound:7.1f} ({rate / bound:.0%} of it; decode steps alone {decode_bound:.1f}, "
                        f"{rate / decode_bound:.0%}; {memory_share:.0%} of steps memory-bound); "
                        f"start {started:.0f} s",
                        flush=True,
                    )
                if args.beside_trainer and rows == biggest:
                    pid, model = server.process.pid, args.model
                    beside = beside_trainer(
                        server.url, pid, prompts, args.max_tokens, model, args.beside_trainer
                    )
                    results[-1] |= beside | {"trainer_alone_s": alone}
                    print(
                        f"      beside a one-thread trainer: "
                        f"{', '.join(f'{x:.0f}' for x in beside['beside_tokens_per_second'])} new tokens/s; "
                        f"trainer {', '.join(f'{x:.2f}' for x in beside['trainer_beside_s'])} s an iteration; "
                        f"server used {beside['server_cores']:.2f} cores",
                        flush=True,
                    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figures = {"model": args.model, "parameters": parameters, "threads": args.threads, "read_gbs": gbs}
    figures |= {"prompt_tokens": prompt_length, "max_tokens": args.max_tokens, "group": args.group}
    args.out.write_text(json.dumps(figures | {"rows": results}, indent=1))
    print(f"figures: {args.out}")


if __name__ == "__main__":
    main()
