"""Builtin server throughput next to in-process `model.generate` on the same batch (a benchmark, not a test).

For each model (the tiny one, and a ~30M-parameter random Qwen3) and each concurrency c in 1, 8, 64:
- server: c requests at once to /inference/v1/generate on scripts/serve.py (a subprocess, HTTP and
  JSON included), each sampling max_tokens tokens at temperature 1 with ignore_eos;
- generate: `model.generate` in this process on the same c prompts, left-padded, sampling the same
  number of new tokens (min_new_tokens = max_new_tokens, top_k off).
tokens/s = c * max_tokens / wall time, best of --repeats rounds. The two never run at the same time; their
rounds alternate, so both see the same load on a shared machine.

Usage:
    python benchmarks/inference/bench_serve.py
    python benchmarks/inference/bench_serve.py --max-tokens 128 --repeats 5 --concurrency 1 8 64 --threads 1
"""

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/

# TinyConfig's fields of each model (lib/models/tiny.py).
MODELS = {
    "tiny": {},
    "30M": dict(hidden_size=512, num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                intermediate_size=1536),
}  # fmt: skip


async def server_round(session, prompts: list[list[int]], max_tokens: int, model: str | None = None) -> float:
    """New tokens/s of the prompts sent at once to /inference/v1/generate (`model`: the served name, if any)."""
    sampling = {"temperature": 1.0, "max_tokens": max_tokens, "ignore_eos": True, "logprobs": 0}

    async def one(prompt: list[int]) -> int:
        body = {"token_ids": prompt, "sampling_params": sampling, **({"model": model} if model else {})}
        async with session.post("/inference/v1/generate", json=body) as response:
            return len((await response.json())["choices"][0]["token_ids"])

    start = time.perf_counter()
    generated = sum(await asyncio.gather(*(one(p) for p in prompts)))
    elapsed = time.perf_counter() - start
    assert generated == len(prompts) * max_tokens, generated
    return generated / elapsed


def generate_round(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> float:
    import torch

    batch = tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - batch["input_ids"].shape[1] == max_tokens
    return len(prompts) * max_tokens / elapsed


async def compare(url, model, tokenizer, all_prompts, args) -> list[tuple[int, float, float]]:
    """(concurrency, server tokens/s, generate tokens/s), best of args.repeats alternating rounds each."""
    import aiohttp

    # One client for the whole run, its connections kept alive, like a real controller's. aiohttp (installed
    # with verifiers) rather than httpx: on a 2-core machine httpx's own CPU time would be measured too.
    # Idle connections are dropped after 3 s, before uvicorn closes them (5 s), so none is reused half-closed.
    connector = aiohttp.TCPConnector(keepalive_timeout=3)
    async with aiohttp.ClientSession(
        url, connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as client:
        await server_round(client, all_prompts, 2)  # warm-up, opens the connections
        generate_round(model, tokenizer, all_prompts[:8], 2)
        rows = []
        for concurrency in args.concurrency:
            prompts = all_prompts[:concurrency]
            served, local = [], []
            for _ in range(args.repeats):  # alternating, so both see the same machine load
                served.append(await server_round(client, prompts, args.max_tokens))
                local.append(generate_round(model, tokenizer, prompts, args.max_tokens))
            rows.append((concurrency, max(served), max(local)))
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads, both sides (default: torch's)"
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from lib import endpoint
    from lib.inference import launch
    from lib.models.load import load_tokenizer
    from lib.models.tiny import TinyConfig, write_tiny

    torch.set_num_threads(args.threads or torch.get_num_threads())

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, max_tokens {args.max_tokens}")
    print(f"{'model':>6} {'params':>7} {'conc':>5} {'server tok/s':>13} {'generate tok/s':>15} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = write_tiny(Path(tmp) / name, TinyConfig(**MODELS[name]))
            tokenizer = load_tokenizer(str(model_dir))
            tokenizer.padding_side = "left"
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            params = sum(p.numel() for p in model.parameters())
            texts = [f"Reverse the text: {'plainrl ' * (1 + i % 6)}" for i in range(max(args.concurrency))]
            all_prompts = [tokenizer.encode(t) for t in texts]
            with launch.running_server(
                str(model_dir),
                engine="torch",
                log_path=Path(tmp) / f"serve-{name}.log",
                extra_args=["--max-batch-size", "64"],
                threads=args.threads,
            ) as server:
                url = endpoint.root_url(server.url)
                rows = asyncio.run(compare(url, model, tokenizer, all_prompts, args))
            for concurrency, served, local in rows:
                print(
                    f"{name:>6} {params / 1e6:6.1f}M {concurrency:>5} {served:>13.0f} {local:>15.0f} "
                    f"{served / local:>6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
