"""Where the builtin engine's decode step goes, in process (a benchmark, not a test): milliseconds a step of
--rows sequences of a real model, its time by operator (torch.profiler), and the model's linear layers timed
by themselves against a large matmul's rate on the same threads.

Each row's prompt is 42 distinct tokens (an evaluation's prompt length on the demo's taskset); the rows are
prefilled together, decoded --warmup steps, then --steps steps are timed and --profile more profiled. The
linear layers (every nn.Linear, the output layer included, prepacked as the engine lays them out) run once
each on --rows random rows, best of 10; the large matmul is 2048 x 2048 x 2048 in the model's dtype. What
the step spends beside its linear layers is what fusing its small operators could win (docs/benchmarks.md,
the demo's stages on CPUs without AVX-512).

Usage (make smollm2 first):
    python benchmarks/inference/bench_decode_step.py --dtype bfloat16 --rows 64
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benchmarks/inference/bench_decode_step.py --dtype float32 --rows 32
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
import torch  # noqa: E402

from benchmarks.common import DEFAULT_MODEL, check_model, matmul_gflops  # noqa: E402
from lib.inference.server import linear  # noqa: E402
from lib.inference.server.decode import Decoder, SamplingParams, Sequence  # noqa: E402
from lib.models.load import ModelConfig, load_model  # noqa: E402

PROMPT = 42


def timed(function, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls."""
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--profile", type=int, default=5, help="steps profiled after the timed ones (0: none)"
    )
    args = parser.parse_args()
    check_model(args.model)
    torch.set_num_threads(args.threads)
    model = load_model(ModelConfig(name=args.model, device="cpu", dtype=args.dtype))
    if linear.prepacks(model):
        linear.prepack(model)
    decoder = Decoder(model, pad_id=0, detokenize=lambda ids, skip: "", seed=0)
    params = SamplingParams(max_tokens=args.warmup + args.steps + args.profile + 2, ignore_eos=True)
    prompts = [list(range(100 + row * PROMPT, 100 + (row + 1) * PROMPT)) for row in range(args.rows)]
    sequences = [Sequence(prompt, params, None, frozenset(), None, 0) for prompt in prompts]
    with torch.inference_mode():
        batch, _ = decoder.step(None, sequences, "bench")
        for _ in range(args.warmup):
            batch, _ = decoder.step(batch, [], "bench")
        began = time.perf_counter()
        for _ in range(args.steps):
            batch, _ = decoder.step(batch, [], "bench")
        step = (time.perf_counter() - began) / args.steps
        print(f"{args.dtype}, {args.rows} rows, {args.threads} threads: {step * 1e3:.1f} ms a decode step")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as profiled:
                for _ in range(args.profile):
                    batch, _ = decoder.step(batch, [], "bench")
            print(profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))

        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        dtype = next(model.parameters()).dtype
        inputs = {m.in_features: torch.randn(args.rows, m.in_features, dtype=dtype) for m in layers}
        flops = sum(2 * args.rows * m.in_features * m.out_features for m in layers)
        seconds = timed(lambda: [m(inputs[m.in_features]) for m in layers], 10)
        peak = matmul_gflops(2048, 2048, 2048, dtype)[0]
    rate = flops / seconds / 1e9
    print(
        f"linear layers alone ({len(layers)}, output layer included): {seconds * 1e3:.1f} ms = {rate:.0f} "
        f"GFLOP/s, {rate / peak:.0%} of a 2048^3 matmul's {peak:.0f}; the rest of the step "
        f"{(step - seconds) * 1e3:.1f} ms ({1 - seconds / step:.0%})"
    )


if __name__ == "__main__":
    main()
