"""The flat-group filter at equal wall-clock time: held-out reward against minutes, per environment.

Runs scripts/rl.py twice, one after the other, each for the same --minutes of training (counted from
the end of its first evaluation): without --filter-flat-groups, then with it, both with --eval.every N on the same
held-out tasks. Each run is stopped by a Ctrl-C at the budget (it ends the step it is on). Prints, per
environment, every evaluation's sampled reward against the minutes of training, then each
run's gain over its own first evaluation and the filter's gain over the plain run at the last
evaluation inside the budget, each with its standard error: paired by held-out task (the same tasks in
both runs), the standard deviation of the per-task differences over sqrt(tasks). On the tiny model the
gains are a few hundredths, so a bare difference would be noise.

Usage:
    python benchmarks/rl/bench_filter.py --minutes 4                                   # configs/mix/rl.toml
    python benchmarks/rl/bench_filter.py --minutes 4 -- --model.name DIR --eval.num-examples 16
"""

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402


def run_arm(out: Path, minutes: float, flags: list[str]) -> float:
    """rl.py with `flags` for `minutes` after its first evaluation (start-up and that evaluation are not
    counted), then a Ctrl-C (it ends the step it is on and stops); returns when training started."""
    command = [sys.executable, str(ROOT / "scripts" / "rl.py"), *flags, "--output-dir", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None and "eval at step 0" not in out.with_suffix(".log").read_text():
            time.sleep(0.5)
        started = time.time()
        try:
            process.wait(timeout=minutes * 60)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)  # the rl.py process only: its server stops with it
            process.wait(timeout=600)
    if process.returncode not in (0, 130):  # 130: stopped by the Ctrl-C
        raise SystemExit(f"rl.py failed (exit {process.returncode}): see {out.with_suffix('.log')}")
    return started


def evaluations(out: Path, started: float) -> dict[str, list[tuple[float, int, dict[str, float]]]]:
    """{environment: [(minutes since `started`, step, {task id: mean sampled reward})]} of a run's evals."""
    found: dict[str, list] = {}
    for path in sorted(out.glob("eval/**/step_*/sampled.jsonl")):
        env = path.parent.parent.relative_to(out / "eval").as_posix() or "env"
        records = [json.loads(line) for line in path.open()]
        by_task: dict[str, list[float]] = {}
        for record in records:
            by_task.setdefault(record["task_id"], []).append(record["reward"])
        rewards = {task: statistics.fmean(values) for task, values in by_task.items()}
        step = int(path.parent.name.removeprefix("step_"))
        minutes = max(0.0, path.stat().st_mtime - started) / 60  # the first one ends as the clock starts
        found.setdefault(env, []).append((minutes, step, rewards))
    return {env: sorted(evals, key=lambda e: e[1]) for env, evals in found.items()}


def flat_share(out: Path) -> str:
    """Flat groups trained on nothing and groups replaced, per step, from the run's tensorboard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    flat, resampled = (
        [e.value for e in events.Scalars(f"rollouts/{name}")] for name in ("flat_groups", "resampled")
    )
    return f"{len(flat)} steps, {sum(flat) / len(flat):.2f} flat groups and {sum(resampled) / len(flat):.2f} replaced a step"


def gain(before: dict[str, float], after: dict[str, float]) -> tuple[float, float]:
    """Mean per-task difference after - before and its standard error, over the tasks both scored."""
    differences = [after[task] - before[task] for task in before if task in after]
    if len(differences) < 2:
        return float("nan"), float("nan")
    return statistics.fmean(differences), statistics.stdev(differences) / len(differences) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=4.0, help="wall-clock budget of each run")
    parser.add_argument("--preset", default="configs/mix/rl.toml")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_filter")
    parser.add_argument("flags", nargs="*", help="more rl.py flags, after --")
    args = parser.parse_args()
    common = ["@", args.preset, "--steps", "100000", "--eval.every", str(args.eval_every), *args.flags]
    results = {}
    for arm, extra in (("plain", []), ("filter", ["--filter-flat-groups"])):
        out = args.out / arm
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["rm", "-rf", str(out)], check=True)
        started = run_arm(out, args.minutes, [*common, *extra])
        results[arm] = evaluations(out, started)
        print(f"{arm}: {flat_share(out)}; log in {out.with_suffix('.log')}")

    budget = args.minutes
    print(
        f"\nheld-out sampled reward against minutes ({budget:g} min a run, eval every {args.eval_every} steps)"
    )
    for env in sorted(results["plain"]):
        print(f"\n{env}")
        for arm in ("plain", "filter"):
            points = "  ".join(
                f"{m:.1f}m/s{s}: {statistics.fmean(r.values()):.3f}" for m, s, r in results[arm][env]
            )
            print(f"  {arm:6s} {points}")
        last = {arm: [e for e in results[arm][env] if e[0] <= budget][-1] for arm in ("plain", "filter")}
        for arm in ("plain", "filter"):
            first = results[arm][env][0]
            mean, error = gain(first[2], last[arm][2])
            print(f"  {arm:6s} gain over its step 0 at step {last[arm][1]}: {mean:+.3f} +- {error:.3f}")
        mean, error = gain(last["plain"][2], last["filter"][2])
        print(f"  filter - plain at the budget: {mean:+.3f} +- {error:.3f} (paired by task)")


if __name__ == "__main__":
    main()
