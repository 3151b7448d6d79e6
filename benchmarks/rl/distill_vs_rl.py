"""On-policy distillation against RL alone: SmolLM2-135M-Instruct on two-digit arithmetic (docs/algorithms.md).

From the same start (the demo's SFT model, and the base model) each method runs the same steps with the same
rollouts a step, from its preset (configs/smollm2_two_digit/{distill,rl}.toml), at each of its learning
rates; the teacher is the demo's RL model. Every run's last weights are scored on the demo's held-out
problems (256, sampled and greedy, as the demo scores), and so are the starts and the teacher; the best
learning rate of each method and start (by its last sampled reward) is also scored every --eval-every steps:
held-out reward against steps and minutes. Prints a table per start and the two targets (from SFT:
distillation reaches the teacher's reward - 0.05 in at most half the steps RL needs; from the base model:
distillation beats RL at the last step by more than 4 standard errors), and draws the curves. A rerun goes
on where it stopped (lib/stages.py); --table prints what is there and runs nothing.

Usage:
    make demo                                                    # once: the teacher and the SFT model
    python benchmarks/rl/distill_vs_rl.py --plot docs/distill_vs_rl.png
    python benchmarks/rl/distill_vs_rl.py --starts sft --plot docs/distill_vs_rl.png   # half of it: from SFT
    python benchmarks/rl/distill_vs_rl.py --distill-lrs 3e-5 --rl-lrs 3e-5 --steps 20 --eval-every 10
    python benchmarks/rl/distill_vs_rl.py --table
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import DEFAULT_MODEL, ROOT, command_stage, evaluated, fail, load_script  # noqa: E402

PRESETS = Path("configs/smollm2_two_digit")
TASKSET = ROOT / "lib" / "orchestrator" / "tasksets" / "plainrl_arithmetic"
STARTS = ("sft", "base")
METHODS = ("distill", "rl")


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: its start ("sft" or "base"), its method ("distill" or "rl") and learning rate."""

    start: str
    method: str
    lr: str

    @property
    def name(self) -> str:
        return f"{self.start}-{self.method}-lr{self.lr}"

    def directory(self, out: Path) -> Path:
        return out / self.start / f"{self.method}-lr{self.lr}"

    def scored(self, out: Path, step: int) -> Path:
        """Where the evaluation of its weights at `step` goes (step 0: its start's)."""
        return out / "eval" / (f"start-{self.start}" if step == 0 else f"{self.name}/step_{step}")

    def minutes(self, out: Path) -> dict[int, float]:
        """{step: training minutes up to its end}, from the steps' own times in metrics.jsonl."""
        path, total, took = self.directory(out) / "metrics.jsonl", 0.0, {0: 0.0}
        for record in map(json.loads, path.read_text().splitlines() if path.is_file() else []):
            if "time/step" in record:
                total += record["time/step"]
                took[record["step"]] = total / 60
        return took


def marks(args) -> list[int]:
    """The steps a best run is scored at: 0 (its start), every --eval-every, the last."""
    return sorted({*range(0, args.steps, args.eval_every), args.steps})


def scored(demo, run_dir: Path) -> tuple[float, float] | None:
    """(sampled, greedy) held-out reward of an evaluation, or None before both finished."""
    if evaluated(demo, run_dir):
        return demo.reward(run_dir), demo.reward(demo.greedy(run_dir))
    return None


def curve(demo, args, run: Run) -> dict[int, tuple[float, float]]:
    """{step: (sampled, greedy)} of the run's evaluations so far."""
    points = {step: scored(demo, run.scored(args.out, step)) for step in marks(args)}
    return {step: point for step, point in points.items() if point is not None}


def runs(args, start: str, method: str) -> list[Run]:
    return [Run(start, method, lr) for lr in (args.distill_lrs if method == "distill" else args.rl_lrs)]


def best(demo, args, start: str, method: str) -> Run | None:
    """The run of this start and method whose last step scored highest (sampled), of those scored."""
    last = {run: scored(demo, run.scored(args.out, args.steps)) for run in runs(args, start, method)}
    last = {run: point[0] for run, point in last.items() if point is not None}
    return max(last, key=last.get) if last else None


def reaching(demo, args, run: Run, bar: float) -> tuple[int | None, str]:
    """The first step scored whose sampled reward reaches `bar`, and it said with its training minutes."""
    step = next((s for s, point in sorted(curve(demo, args, run).items()) if point[0] >= bar), None)
    if step is None:
        return None, "not by any step scored"
    return step, f"step {step}, {run.minutes(args.out).get(step, 0):.1f} min"


def stages(demo, args, cfg, curves: bool) -> list:
    """Every stage: the starts' and the teacher's evaluations, each run and its last step's evaluation; with
    `curves`, the best runs' evaluations every --eval-every steps too."""
    teacher = args.demo / "rl" / "weights" / f"step_{cfg.rl_steps}"
    starts = {"sft": args.demo / "sft" / "weights" / f"step_{cfg.sft_steps}", "base": DEFAULT_MODEL}
    for path in (teacher, starts["sft"]):
        if not (path / "config.json").is_file():
            fail(
                f"{path} is not there: `make demo` (or --demo DIR) gives the teacher and the SFT model first."
            )

    def made(name: str, done, commands: list[list[str]], weights: Path, run_dir: Path | None = None):
        return command_stage(demo, name, done, commands, (weights, TASKSET), args.out, run_dir)

    def evaluation(name: str, weights: Path, into: Path):
        commands = demo.eval_commands(cfg, weights, into)
        return made(f"eval {name}", lambda: evaluated(demo, into), commands, weights)

    every = [evaluation("teacher", teacher, args.out / "eval" / "teacher")]
    every += [evaluation(f"start-{s}", starts[s], args.out / "eval" / f"start-{s}") for s in args.starts]
    # The weights of every step the best runs are scored at: on a CPU rl.py syncs in memory and writes weights
    # every --checkpoint-every steps (lib/inference/weights/sync.py), so these outlive the run.
    kept = len(marks(args)) + 1
    for run in (run for start in args.starts for method in METHODS for run in runs(args, start, method)):
        run_dir = run.directory(args.out)
        preset, model = str(PRESETS / f"{run.method}.toml"), str(starts[run.start])
        command = ["scripts/rl.py", "@", preset, "--model.name", model, "--optim.lr", run.lr]
        command += ["--steps", str(args.steps), "--checkpoint-every", str(args.eval_every)]
        command += ["--keep-weights", str(kept), "--output-dir", str(run_dir), "--seed", str(args.seed)]
        command += (["--teacher.model", str(teacher)] if run.method == "distill" else []) + ["--resume"]
        trained = lambda d=run_dir: demo.trained(d, args.steps)  # noqa: E731
        every.append(made(run.name, trained, [command], starts[run.start], run_dir))
        chosen = curves and best(demo, args, run.start, run.method) == run
        for step in marks(args)[1:] if chosen else [args.steps]:
            name = run.name + ("" if step == args.steps else f" step {step}")
            every.append(evaluation(name, run_dir / "weights" / f"step_{step}", run.scored(args.out, step)))
    return every


def report(demo, args) -> list[str]:
    """The tables' and the targets' lines, from what is evaluated so far ("-" where not yet)."""
    from lib.orchestrator.evaluation import paired_gain

    teacher = scored(demo, args.out / "eval" / "teacher")
    lines = [f"teacher (the demo's RL model): {teacher[0]:.3f} ({teacher[1]:.3f})"] if teacher else []
    for start in args.starts:
        model = "the demo's SFT model" if start == "sft" else "the base model"
        header = ["run", *(f"step {step}" for step in marks(args)), "minutes"]
        lines += ["", f"from {model}: held-out reward, sampled (greedy); training minutes", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        chosen = {method: best(demo, args, start, method) for method in METHODS}
        for run in (run for method in METHODS for run in runs(args, start, method)):
            points, took = curve(demo, args, run), run.minutes(args.out)
            cells = [f"{points[s][0]:.3f} ({points[s][1]:.3f})" if s in points else "-" for s in marks(args)]
            label = f"{run.method}, lr {run.lr}" + (" (best)" if chosen[run.method] == run else "")
            cells.append(f"{took[args.steps]:.1f}" if args.steps in took else "-")
            lines.append("| " + " | ".join([label, *cells]) + " |")
        distill, rl = chosen["distill"], chosen["rl"]
        if distill is None or rl is None:
            continue
        if start == "sft" and teacher:
            bar = teacher[0] - 0.05

            (d, d_said), (r, r_said) = reaching(demo, args, distill, bar), reaching(demo, args, rl, bar)
            met = d is not None and (r is None or 2 * d <= r)
            lines.append(
                f"\nheld-out reward >= the teacher's - 0.05 = {bar:.3f}: distillation at {d_said}, RL at {r_said}: "
                f"{'met' if met else 'not met'} (distillation in at most half RL's steps)"
            )
        if start == "base":
            value, error = paired_gain(rl.scored(args.out, args.steps), distill.scored(args.out, args.steps))
            size = value / error if error > 0 else float("nan")
            lines.append(
                f"\nat step {args.steps}, distillation - RL: {value:+.3f} +- {error:.3f} ({size:+.1f} se): "
                f"{'met' if size > 4 else 'not met'} (more than 4 standard errors)"
            )
    return lines


def plot(demo, args, path: Path) -> Path:
    """Held-out sampled reward of each start's best runs against steps and against training minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lib.plot import save

    figure, (by_step, by_minute) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for start, style in zip(args.starts, ("-", ":")):
        for method, color in zip(METHODS, ("tab:green", "tab:blue")):
            run = best(demo, args, start, method)
            if run is None:
                continue
            points, took = sorted(curve(demo, args, run).items()), run.minutes(args.out)
            label = f"{method} from {start} (lr {run.lr})"
            by_step.plot(
                [s for s, _ in points], [p[0] for _, p in points], style, marker="o", color=color, label=label
            )
            timed = [(took[s], p[0]) for s, p in points if s in took]
            by_minute.plot([t for t, _ in timed], [r for _, r in timed], style, marker="o", color=color)
    teacher = scored(demo, args.out / "eval" / "teacher")
    for axes, xlabel in ((by_step, "step"), (by_minute, "training minutes")):
        if teacher:
            axes.axhline(teacher[0], color="gray", linestyle="--", label="teacher")
        axes.set(xlabel=xlabel, ylabel="held-out reward (sampled)")
        axes.grid(alpha=0.3)
    by_step.legend(loc="best", fontsize="small")
    figure.suptitle("SmolLM2-135M-Instruct, two-digit arithmetic: on-policy distillation against RL alone")
    return save(figure, path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--demo", type=Path, default=ROOT / "outputs" / "demo", help="make demo's run directory"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "distill_vs_rl")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10, help="the best runs are scored every N steps")
    parser.add_argument("--distill-lrs", nargs="+", default=["1e-5", "3e-5", "1e-4"])
    parser.add_argument(
        "--rl-lrs", nargs="+", default=["3e-5"], help="the RL preset's (the demo's screens chose it)"
    )
    parser.add_argument(
        "--starts", nargs="+", choices=STARTS, default=list(STARTS), help="the models runs start from"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table", action="store_true", help="print the tables of what is there; run nothing")
    parser.add_argument("--plot", type=Path, help="also draw the best runs' curves into this PNG")
    args = parser.parse_args()
    if args.steps < 1 or not 1 <= args.eval_every <= args.steps:
        fail("--steps must be >= 1 and --eval-every between 1 and --steps.")
    demo = load_script("demo")
    cfg = demo.resolved(demo.Config(out=args.demo))
    if not args.table:
        from lib.stages import run_stages

        args.out.mkdir(parents=True, exist_ok=True)
        # Every run and its last step first: the best learning rates are known only then.
        for curves in (False, True):
            run_stages(
                stages(demo, args, cfg, curves),
                args.out / "inputs.json",
                f"distillation against RL in {args.out}",
            )
    print("\n".join(report(demo, args)))
    if args.plot:
        print(f"\ncurves: {plot(demo, args, args.plot)}")


if __name__ == "__main__":
    main()
