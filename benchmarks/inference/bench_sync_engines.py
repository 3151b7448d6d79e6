"""Weight-sync seconds and rollouts per second of a tiny RL run: vLLM's CPU build vs the builtin engine.

Both runs are the same rl.py workload (configs/tiny/rl.toml on a fresh tiny model, on-policy so every
step waits for its rollouts, one server that rl.py starts), one after the other in this process's
machine state. Per engine it prints the server's start time, the mean seconds of a weight sync
(pause, reload, label, probe, resume: `time/sync_weights`) and rollouts per second (the step's rollouts
over the step's time, steps after the first). Needs `make setup-vllm`.

Usage:
    python benchmarks/inference/bench_sync_engines.py                 # 20 steps each
    python benchmarks/inference/bench_sync_engines.py --steps 40
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402


def run(engine: str, model: Path, out: Path, steps: int) -> dict:
    from benchmarks.common import load_script
    from lib.config import parse
    from lib.inference import launch

    rl = load_script("rl")
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--output-dir", str(out)]
    args += ["--steps", str(steps), "--max-async-level", "0", "--inference.engine", engine]
    args += ["--sampling.max-tokens", "64", "--checkpoint-every", str(steps)]
    started = {}
    start_server = launch.start_server

    def timed_start(*a, **k):
        began = time.perf_counter()
        server = start_server(*a, **k)
        started["seconds"] = time.perf_counter() - began
        return server

    launch.start_server = timed_start
    try:
        history = rl.main(parse(rl.Config, args))["history"][1:]
    finally:
        launch.start_server = start_server
    rollouts = 8 * 8  # examples_per_step x rollouts_per_example of the preset
    return {
        "start_s": started["seconds"],
        "sync_s": sum(m["time/sync_weights"] for m in history) / len(history),
        "rollouts_per_s": rollouts * len(history) / sum(m["time/step"] for m in history),
        "wait_s": sum(m["time/wait_rollouts"] for m in history) / len(history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from lib.models.tiny import write_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny(Path(tmp) / "tiny")
        results = {engine: run(engine, model, Path(tmp) / engine, args.steps) for engine in ("torch", "vllm")}
    print(f"{'engine':8} {'start s':>8} {'sync s':>8} {'wait s':>8} {'rollouts/s':>11}")
    for engine, r in results.items():
        print(
            f"{engine:8} {r['start_s']:8.1f} {r['sync_s']:8.3f} {r['wait_s']:8.3f} {r['rollouts_per_s']:11.1f}"
        )
    ratio = results["vllm"]["rollouts_per_s"] / results["torch"]["rollouts_per_s"]
    print(f"vLLM CPU build / builtin engine: {ratio:.2f}x rollouts per second")


if __name__ == "__main__":
    main()
