"""Step time of the tiny RL workload with each weight-sync pause mode (wait, keep), on both engines.

The workload is configs/tiny/rl.toml (reverse_text, 8 x 8 rollouts, up to 128 tokens, max_async_level 1)
on the tiny model after 300 SFT steps (the tests' `trained_tiny`, cached in outputs/test-cache/): it
earns some reward, so steps train, and its completions' lengths spread as an RL batch's do. With `wait` every sync waits for the longest completion in flight; with `keep` the
sync holds them, loads the weights and lets them go on under the new ones. Per engine, one server
serves every run (attached with --inference.urls), so both modes see the same warm server; the runs
alternate wait, keep, wait, keep... Printed: mean step, sync and rollout-wait seconds per mode and
engine (steps after the first), and keep's step time over wait's. The vLLM half needs `make setup-vllm`.

Usage:
    python benchmarks/inference/bench_pause_mode.py                         # 12 steps per run, both engines
    python benchmarks/inference/bench_pause_mode.py --steps 20 --repeats 2 --engines torch
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402

MODES = ("wait", "keep")


def run(url: str, model: Path, out: Path, mode: str, steps: int) -> list[dict]:
    """The metrics of one rl.py run attached to `url` (the first step, which includes warm-up, left out)."""
    from benchmarks.common import load_script
    from lib.config import parse

    rl = load_script("rl")
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--output-dir", str(out)]
    args += ["--steps", str(steps), "--max-async-level", "1", "--checkpoint-every", str(steps)]
    args += ["--inference.urls", url, "--inference.pause-mode", mode]
    return rl.main(parse(rl.Config, args))["history"][1:]


def mean(history: list[dict], key: str) -> float:
    return sum(m[key] for m in history) / len(history)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode and engine, alternating")
    parser.add_argument("--engines", nargs="+", default=["torch", "vllm"], choices=["torch", "vllm"])
    args = parser.parse_args()
    from benchmarks.common import trained_tiny
    from lib.inference import launch
    from lib.models.tiny import write_tiny

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = trained_tiny(write_tiny(tmp / "tiny"))  # the tests' trained_tiny: one cache entry
        for engine in args.engines:
            # 1 GiB of KV cache for vLLM's CPU build (its default, 4, may not fit beside other work).
            extra = ["--model.dtype", "float32", "--max-model-len", "2048", "--vllm.cpu-kv-cache-gib", "1"]
            with launch.running_server(
                str(model), engine=engine, weights_root=tmp, log_path=tmp / f"{engine}.log", extra_args=extra
            ) as server:
                for repeat in range(args.repeats):
                    for mode in MODES:
                        out = tmp / f"{engine}-{mode}-{repeat}"
                        results.setdefault((engine, mode), []).extend(
                            run(server.url, model, out, mode, args.steps)
                        )
            report(results)  # after each engine, so a failure in the next one loses nothing


def report(results: dict) -> None:
    print(f"{'engine':8} {'mode':6} {'step s':>8} {'sync s':>8} {'wait s':>8}")
    for (engine, mode), history in results.items():
        step, sync, wait = (mean(history, f"time/{k}") for k in ("step", "sync_weights", "wait_rollouts"))
        print(f"{engine:8} {mode:6} {step:8.3f} {sync:8.3f} {wait:8.3f}")
    for engine in dict.fromkeys(engine for engine, _ in results):
        ratio = mean(results[(engine, "keep")], "time/step") / mean(results[(engine, "wait")], "time/step")
        print(f"{engine}: keep / wait step time {ratio:.2f}")


if __name__ == "__main__":
    main()
