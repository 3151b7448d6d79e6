"""The CPU's limits and the trainer against them, in one run: matmul peak and memory bandwidth, then MFU.

- peaks: GFLOP/s of float32 and bf16 matmuls at the model's shapes (its projections, the output layer, an
  MLP weight gradient) on one thread and on the trainer's threads, and GB/s of a large copy and sum. The
  peak of a dtype is the best shape on one thread times the trainer's threads (the thread-count row shows
  how far the machine's other load lets that scale).
- trainer: optimizer steps as sft.py and rl.py take them (lib/models/load.py load_trainable, lib/trainer/head.py's
  chunked head; benchmarks/common.py's sft_loss and rl_loss) on one packed row of equal samples, full and LoRA,
  float32 and bf16 autocast (model.autocast off/on): tokens/s and MFU, model FLOPs/s over each peak.
  FLOPs: 6 x (the layers' linear weights) per token, plus 6 x the output layer per scored token, for
  full fine-tuning; 4 x each for LoRA, plus 6 x the adapters; plus causal attention, 12 x layers x heads
  x head_dim per (query, key) pair. No credit for padding, the embedding lookup, norms or no-grad
  forwards. The step's split (forward and backward, clip and AdamW; with --profile, its time by kind of
  op) says what bounds it; AdamW's bytes over the copy bandwidth is its floor.
- sft: scripts/sft.py's main() on reverse_text-like conversations (bench_packing.py's), float32 against
  bf16 autocast (and bf16 weights, --sft-modes), at each of --sft-threads: median tokens/s after the
  first step, loss at the last.

Every time is taken on the wall clock and in CPU seconds of the process: on a shared machine the second
still counts the work alone. Every figure prints as it comes and goes to --out (JSON) at the end; compare
figures of one run only.

Usage:
    python benchmarks/trainer/bench_limits.py                              # outputs/models/smollm2-135m-instruct
    python benchmarks/trainer/bench_limits.py --threads 1 --tokens 1024 --profile --sections peaks trainer
    python benchmarks/trainer/bench_limits.py --model outputs/models/tiny --sections peaks trainer
    python benchmarks/trainer/bench_limits.py --sections sft --sft-modes float32 autocast bf16-weights
"""

import argparse
import atexit
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import (  # noqa: E402
    DEFAULT_MODEL,
    Clock,
    bandwidth_gbs,
    check_model,
    matmul_gflops,
    rl_loss,
    sft_loss,
    threads,
)

LORA_RANK = 16
# sft.py's flags for each way of computing: bf16 weights train bf16 AdamW updates too (model.dtype bfloat16).
SFT_MODES = {
    "float32": ["--model.autocast", "off"],
    "autocast": ["--model.autocast", "on"],
    "bf16-weights": ["--model.dtype", "bfloat16", "--model.autocast", "off"],
}


def shapes(config, tokens: int) -> dict[str, tuple[int, int, int]]:
    """(m, k, n) of the model's matmuls on `tokens` rows: forward projections, the output layer in chunks
    of 1024 tokens (lib/trainer/head.py), and one weight gradient."""
    hidden, inner = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    return {
        "q_proj": (tokens, hidden, config.num_attention_heads * head_dim),
        "k_proj": (tokens, hidden, config.num_key_value_heads * head_dim),
        "up_proj": (tokens, hidden, inner),
        "down_proj": (tokens, inner, hidden),
        "output_layer": (min(tokens, 1024), hidden, config.vocab_size),
        "up_proj_grad": (hidden, tokens, inner),
    }


def section_peaks(config, tokens: int, trainer_threads: int) -> dict:
    import torch

    figures = {"matmul": {}, "bandwidth": {}}
    for count in sorted({1, trainer_threads}):
        with threads(count):
            for name, (m, k, n) in shapes(config, tokens).items():
                for dtype in (torch.float32, torch.bfloat16):
                    wall, cpu = matmul_gflops(m, k, n, dtype)
                    key = f"{name} {m}x{k}x{n} {str(dtype)[6:]} x{count}"
                    figures["matmul"][key] = {"gflops": wall, "gflops_per_cpu_second": cpu}
                    print(f"  matmul {key:40s} {wall:6.0f} GFLOP/s, {cpu:6.0f} per CPU second")
            figures["bandwidth"][f"x{count}"] = bandwidth_gbs()
            print(f"  bandwidth {count} thread(s): {figures['bandwidth'][f'x{count}']}")
    for dtype in ("float32", "bfloat16"):
        one = [v for k, v in figures["matmul"].items() if k.endswith(f" {dtype} x1")]
        wall, cpu = max(v["gflops"] for v in one), max(v["gflops_per_cpu_second"] for v in one)
        figures[f"peak_{dtype}"] = {"gflops": wall * trainer_threads, "gflops_per_cpu_second": cpu}
        print(
            f"  peak {dtype}: {wall:.0f} GFLOP/s on one thread x {trainer_threads} = {wall * trainer_threads:.0f}; "
            f"{cpu:.0f} per CPU second"
        )
    return figures


CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
    "attention": ("scaled_dot_product",),
    "casts": ("aten::copy_", "aten::_to_copy"),
    "optimizer": ("adam", "aten::linalg_vector_norm", "aten::_foreach"),
}


def op_split(function) -> dict[str, float]:
    """Shares of the profiled self time of `function()` by kind of op (CATEGORIES, else `other`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        function()
    split = dict.fromkeys([*CATEGORIES, "other"], 0.0)
    for event in profiled.key_averages():
        kind = next((k for k, names in CATEGORIES.items() if any(n in event.key for n in names)), "other")
        split[kind] += event.self_cpu_time_total
    total = sum(split.values())
    return {kind: seconds / total for kind, seconds in split.items()}


def model_flops(config, tokens: int, samples: int, scored: int, lora_rank: int) -> float:
    """Training FLOPs of one packed row of `samples` equal samples, `scored` tokens scored by the output layer."""
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    projections = {"q": (hidden, q), "k": (hidden, kv), "v": (hidden, kv), "o": (q, hidden)}
    projections |= {"gate": (hidden, inner), "up": (hidden, inner), "down": (inner, hidden)}
    body = layers * sum(a * b for a, b in projections.values())
    output_layer = config.vocab_size * hidden
    length = tokens // samples
    attention = 12 * layers * q * samples * length * (length + 1) / 2  # causal (query, key) pairs
    if not lora_rank:
        return 6 * body * tokens + 6 * output_layer * scored + attention
    adapters = layers * sum(lora_rank * (a + b) for a, b in projections.values())
    return 4 * body * tokens + 4 * output_layer * scored + 6 * adapters * tokens + attention


def packed_row(vocab_size: int, tokens: int, samples: int):
    """(1, T) random ids, positions restarting at each sample, and a mask on each sample's second half."""
    import torch

    ids = torch.randint(0, vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    positions = (torch.arange(tokens) % (tokens // samples))[None]  # (1, T)
    return ids, positions, positions >= tokens // samples // 2


def trainer_row(model_dir: str, kind: str, lora_rank: int, bf16: bool, args, peaks: dict) -> dict:
    from lib.models.load import ModelConfig
    from lib.trainer.optim import OptimConfig, build_optimizer, optimizer_step
    from lib.trainer.trainable import LoraConfig, load_trainable

    config = ModelConfig(name=model_dir, device="cpu", autocast="on" if bf16 else "off")
    model, _, autocast = load_trainable(config, LoraConfig(rank=lora_rank), "cpu", 1, packing=True)
    optimizer, scheduler = build_optimizer(model.parameters(), OptimConfig(lr=1e-6), 1000)
    ids, positions, mask = packed_row(model.config.vocab_size, args.tokens, args.samples)
    if kind == "sft":
        scored = int((positions[:, 1:] > 0).sum())  # every next token within a sample
        compute_loss = lambda: sft_loss(model, autocast, ids, positions)  # noqa: E731
    else:
        scored = int(mask[:, 1:].sum())  # each sample's second half, as a completion
        compute_loss = lambda: rl_loss(model, autocast, ids, positions, mask)  # noqa: E731

    def step() -> tuple[float, float, float, float]:
        clock = Clock()
        compute_loss().backward()
        backward_wall, backward_cpu = clock.seconds()
        clock = Clock()
        optimizer_step(optimizer, scheduler, 1.0)
        return backward_wall, backward_cpu, *clock.seconds()

    step()  # allocates the optimizer state
    timed = [step() for _ in range(args.steps)]
    backward_wall, backward_cpu, update_wall, update_cpu = (statistics.median(t) for t in zip(*timed))
    flops = model_flops(model.config, args.tokens, args.samples, scored, lora_rank)
    wall, cpu = backward_wall + update_wall, backward_cpu + update_cpu
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Fused AdamW reads parameter, gradient and both moments and writes three, 4 bytes each; clipping reads
    # the gradients twice and writes them once.
    adamw_bytes = trained * 4 * (7 + 3)
    peak = peaks["peak_bfloat16"]["gflops"] * 1e9
    peak_cpu = peaks["peak_bfloat16"]["gflops_per_cpu_second"] * 1e9
    own_cpu = peaks["peak_bfloat16" if bf16 else "peak_float32"]["gflops_per_cpu_second"] * 1e9
    row = {
        "kind": kind,
        "lora_rank": lora_rank,
        "compute": "bf16 autocast" if bf16 else "float32",
        "tokens": args.tokens,
        "model_gflop_per_step": flops / 1e9,
        "tokens_per_second": args.tokens / wall,
        "tokens_per_cpu_second": args.tokens / cpu,
        "step_seconds": wall,
        "forward_backward_seconds": backward_wall,
        "optimizer_seconds": update_wall,
        "step_cpu_seconds": cpu,
        "forward_backward_cpu_seconds": backward_cpu,
        "optimizer_cpu_seconds": update_cpu,
        "optimizer_floor_seconds": adamw_bytes / (peaks["copy_gbs"] * 1e9),
        "mfu_bf16_peak": flops / wall / peak,
        "mfu_bf16_peak_cpu_time": flops / cpu / peak_cpu,
        "mfu_own_peak_cpu_time": flops / cpu / own_cpu,
        "forward_backward_mfu_bf16_peak_cpu_time": flops / backward_cpu / peak_cpu,
    }
    print(
        f"  {kind} {'LoRA r' + str(lora_rank) if lora_rank else 'full':9s} {row['compute']:13s}: "
        f"{row['tokens_per_second']:5.0f} tokens/s ({row['tokens_per_cpu_second']:.0f} per CPU s), "
        f"MFU of the bf16 peak {row['mfu_bf16_peak']:.1%} (CPU time {row['mfu_bf16_peak_cpu_time']:.1%}, "
        f"fwd+bwd alone {row['forward_backward_mfu_bf16_peak_cpu_time']:.1%}), of its dtype's "
        f"{row['mfu_own_peak_cpu_time']:.1%}; CPU s: fwd+bwd {backward_cpu:.2f} + optimizer {update_cpu:.2f} "
        f"(floor {row['optimizer_floor_seconds']:.2f} s)"
    )
    if args.profile:
        row["op_split"] = op_split(step)
        print("    time by op: " + ", ".join(f"{k} {v:.0%}" for k, v in row["op_split"].items()))
    return row


def section_sft(model_dir: str, args) -> list[dict]:
    from benchmarks.trainer.bench_packing import load_sft, reverse_text_conversations, write_jsonl
    from lib.config import parse

    work = Path(tempfile.mkdtemp(prefix="bench_limits_"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # its checkpoints run to gigabytes
    conversations = reverse_text_conversations(args.sft_batch * args.sft_steps, 0, 20, 200)
    data = write_jsonl(conversations, work / "data.jsonl")
    sft, rows = load_sft(), []
    for count in args.sft_threads:
        for mode in args.sft_modes:
            flags = [
                *SFT_MODES[mode], "--model.name", model_dir, "--data.id", str(data),
                "--steps", str(args.sft_steps), "--batch-size", str(args.sft_batch),
                "--micro-batch-size", str(args.sft_batch), "--seq-len", "1024", "--optim.lr", "5e-5",
                "--output-dir", str(work / f"run_{count}_{mode}"), "--log-every", "1000",
            ]  # fmt: skip
            with threads(count):
                history = sft.main(parse(sft.Config, flags))["history"]
            row = {
                "threads": count,
                "compute": mode,
                "tokens_per_second": statistics.median(m["perf/tokens_per_second"] for m in history[1:]),
                "first_loss": history[0]["train/loss"],
                "last_loss": history[-1]["train/loss"],
            }
            rows.append(row)
            print(
                f"  sft {count} thread(s) {row['compute']:13s}: {row['tokens_per_second']:.0f} tokens/s, "
                f"loss {row['first_loss']:.3f} -> {row['last_loss']:.3f} after {args.sft_steps} steps"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="a Hugging Face model directory")
    parser.add_argument("--sections", nargs="+", default=["peaks", "trainer", "sft"])
    parser.add_argument("--threads", type=int, default=None, help="the trainer's threads (default: torch's)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the trainer's packed row")
    parser.add_argument("--samples", type=int, default=4, help="equal samples packed in that row")
    parser.add_argument("--steps", type=int, default=1, help="timed optimizer steps per trainer row")
    parser.add_argument("--kinds", nargs="+", default=["sft", "rl"])
    parser.add_argument("--lora", type=int, nargs="+", default=[0, LORA_RANK], help="LoRA ranks (0 = full)")
    parser.add_argument("--sft-threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sft-steps", type=int, default=10)
    parser.add_argument("--sft-batch", type=int, default=4)
    parser.add_argument("--sft-modes", nargs="+", choices=list(SFT_MODES), default=["float32", "autocast"])
    parser.add_argument("--profile", action="store_true", help="split one more step of each row by op")
    parser.add_argument("--out", type=Path, default=None, help="write every figure here as JSON")
    args = parser.parse_args()
    check_model(args.model)

    import torch
    from transformers import AutoConfig

    from lib.models.load import cpu_has_bf16, cpu_name

    args.threads = args.threads or torch.get_num_threads()

    config = AutoConfig.from_pretrained(args.model).get_text_config()

    results = {
        "model": args.model,
        "threads": args.threads,
        "cpu": cpu_name(),
        "cpu_has_bf16": cpu_has_bf16(),
        "args": vars(args),
    }
    print(
        f"{args.model}: hidden {config.hidden_size}, {config.num_hidden_layers} layers; {cpu_name()}, native bf16: {cpu_has_bf16()}"
    )
    if "peaks" in args.sections or "trainer" in args.sections:
        print("peaks")
        results["peaks"] = section_peaks(config, args.tokens, args.threads)
    if "trainer" in args.sections:
        print(f"trainer: one row of {args.tokens} tokens in {args.samples} samples, {args.threads} thread(s)")
        peaks = results["peaks"] | {"copy_gbs": results["peaks"]["bandwidth"][f"x{args.threads}"]["copy_gbs"]}
        results["trainer"] = []
        with threads(args.threads):
            for kind in args.kinds:
                for lora_rank in args.lora:
                    for bf16 in (False, True):
                        results["trainer"].append(trainer_row(args.model, kind, lora_rank, bf16, args, peaks))
    if "sft" in args.sections:
        print(f"sft.py: {args.sft_steps} steps of {args.sft_batch} conversations")
        results["sft"] = section_sft(args.model, args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
