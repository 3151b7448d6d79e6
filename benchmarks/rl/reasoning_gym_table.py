"""SmolLM2-135M-Instruct across reasoning-gym's tasks: for each task, base -> SFT -> RL and RL alone (from the base
model), each model evaluated on the task's test split (sampled at temperature 1 and greedily), with
configs/reasoning_gym's presets, one set of steps for every task and the task settings of TASKS. Prints a
Markdown table: rewards, paired gains with their size in standard errors, minutes per stage. Runs go one
after another: every task's base -> SFT -> RL first, then (--more-rl-steps N) each SFT+RL run continued to N
steps, then RL alone. A rerun goes on where it stopped (lib/stages.py: a stage done from the same inputs is
skipped); --table only prints the table of what is there. ~10 minutes a task for the first pass on 2 cores.

Usage:
    python benchmarks/rl/reasoning_gym_table.py --more-rl-steps 40    # the 8 tasks of docs/environments.md
    python benchmarks/rl/reasoning_gym_table.py --tasks chain_sum gcd --sft-steps 60 --rl-steps 20
    python benchmarks/rl/reasoning_gym_table.py --table --more-rl-steps 40   # the table of the runs so far
"""

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import DEFAULT_MODEL, ROOT, command_stage, evaluated, load_script  # noqa: E402

# One task of each kind, with the settings (reasoning-gym's config) that fit a 135M model where its defaults do
# not: docs/environments.md says why for each.
TASKS = {
    "chain_sum": {"min_terms": 2, "max_terms": 3, "max_digits": 2},
    "word_sequence_reversal": {"max_words": 5},
    "syllogism": {},
    "family_relationships": {},
    "gcd": {"max_value": 100},
    "letter_counting": {},
    "simple_equations": {"max_terms": 2, "max_value": 20},
    "spell_backward": {"max_word_len": 6},
}
PRESETS = Path("configs/reasoning_gym")
TASKSET = ROOT / "lib" / "orchestrator" / "tasksets" / "plainrl_reasoning_gym"
# (stage, the model it evaluates) in the table's order; "rl-alone" is RL from the base model with no SFT.
EVALS = [("base", None), ("after-sft", "sft"), ("after-rl", "rl"), ("after-rl-alone", "rl-alone")]
# The gains the table gives, each with the bar (in standard errors of the paired differences) it is held to.
GAINS = [("base", "after-rl", 4), ("after-sft", "after-rl", 2), ("base", "after-rl-alone", 4)]
LABELS = {"base": "base", "after-sft": "SFT", "after-rl": "SFT+RL", "after-rl-alone": "RL alone"}
STAGE_LABELS = {"sft": "SFT", "rl": "RL", "rl-alone": "RL alone"}


def layout(more: int | None) -> tuple[list[str], list[tuple], dict[str, str], dict[str, str]]:
    """The table's evaluations, gains (before, after, bar), their labels and its trained stages' labels; with
    `more`, the longer RL run's too."""
    names, gains, labels, stages = [name for name, _ in EVALS], list(GAINS), dict(LABELS), dict(STAGE_LABELS)
    if more:
        names.append(f"after-rl{more}")
        gains.append(("after-sft", f"after-rl{more}", 2))
        labels[f"after-rl{more}"], stages[f"rl{more}"] = f"SFT+RL, {more} steps", f"{more} steps"
    return names, gains, labels, stages


def stages(demo, task: str, out: Path, sft_steps: int, rl_steps: int, seed: int, more: int | None) -> list:
    """The task's stages; with `more`, SFT+RL's run continued from its rl_steps to `more` steps (a copy of
    the run, resumed, in rl<more>/) and evaluated, after the others."""
    import shutil

    from lib.stages import Stage, resolved_command

    config = {"config": TASKS[task]} if TASKS.get(task) else {}
    args = json.dumps({"task": task, **config})
    weights = {
        None: DEFAULT_MODEL,
        "sft": out / "sft" / "weights" / f"step_{sft_steps}",
        "rl": out / "rl" / "weights" / f"step_{rl_steps}",
        "rl-alone": out / "rl-alone" / "weights" / f"step_{rl_steps}",
    }
    sft = ["scripts/sft.py", "@", str(PRESETS / "sft.toml"), "--data.args", args, "--steps", str(sft_steps)]
    sft += ["--model.name", str(DEFAULT_MODEL), "--checkpoint-every", str(max(1, sft_steps // 4))]
    sft += ["--output-dir", str(out / "sft"), "--seed", str(seed), "--resume"]

    def rl(name: str, start: Path, steps: int = rl_steps) -> list[str]:
        command = ["scripts/rl.py", "@", str(PRESETS / "rl.toml"), "--env.args", args, "--steps", str(steps)]
        command += ["--model.name", str(start), "--checkpoint-every", str(max(1, steps // 4))]
        return command + ["--output-dir", str(out / name), "--seed", str(seed), "--resume"]

    def evals(run_dir: Path, model: Path) -> list[list[str]]:
        test = json.dumps({"task": task, **config, "split": "test"})
        command = [
            "scripts/eval.py",
            "plainrl_reasoning_gym",
            "@",
            str(PRESETS / "eval.toml"),
            "-m",
            str(model),
        ]
        return [
            [*command, "--env-args", test, "--sampling.temperature", temperature]
            + ["--output-dir", str(into.parent), "--name", into.name]
            for temperature, into in (("1.0", run_dir), ("0.0", demo.greedy(run_dir)))
        ]

    def made(name: str, done, commands: list, start: Path, run_dir: Path | None = None) -> Stage:
        return command_stage(demo, name, done, commands, (start, TASKSET), out, run_dir)

    every = [
        made("sft", lambda: demo.trained(out / "sft", sft_steps), [sft], DEFAULT_MODEL, out / "sft"),
        made(
            "rl",
            lambda: demo.trained(out / "rl", rl_steps),
            [rl("rl", weights["sft"])],
            weights["sft"],
            out / "rl",
        ),
        made(
            "rl-alone",
            lambda: demo.trained(out / "rl-alone", rl_steps),
            [rl("rl-alone", DEFAULT_MODEL)],
            DEFAULT_MODEL,
            out / "rl-alone",
        ),
    ]
    for name, trained_by in EVALS:  # each evaluation right after the stage that made its model
        run_dir = out / "eval" / name
        stage = made(
            f"eval {name}",
            lambda run_dir=run_dir: evaluated(demo, run_dir),
            evals(run_dir, weights[trained_by]),
            weights[trained_by],
        )
        at = 0 if trained_by is None else 1 + next(i for i, s in enumerate(every) if s.name == trained_by)
        every.insert(at, stage)
    if more:
        longer, run_dir = out / f"rl{more}", out / "eval" / f"after-rl{more}"
        weights[longer.name] = longer / "weights" / f"step_{more}"
        command = rl(longer.name, weights["sft"], more)

        def continuing() -> None:
            if not longer.exists():  # the shorter run's last checkpoint and records, to resume from
                longer.mkdir()
                for part in ("checkpoints", "rollouts"):
                    shutil.copytree(out / "rl" / part, longer / part)
                for part in ("config.toml", "metrics.jsonl", "provenance.json", "base.json"):
                    shutil.copy2(out / "rl" / part, longer / part)
            demo.run(*command)

        settings = [resolved_command(command, out)]
        every.append(
            Stage(
                longer.name,
                lambda: demo.trained(longer, more),
                continuing,
                (weights["rl"], TASKSET),
                longer,
                settings,
            )
        )
        every.append(
            made(
                f"eval {run_dir.name}",
                lambda: evaluated(demo, run_dir),
                evals(run_dir, weights[longer.name]),
                weights[longer.name],
            )
        )
    return every


def row(demo, task: str, out: Path, counts: dict, more: int | None) -> str:
    """The table's line for a task: sampled (greedy) rewards, the paired gains with their size in standard
    errors, the minutes; a cell whose evaluations are not finished is "-". `counts` tallies, per gain, the
    tasks where the sampled gain passes its bar (GAINS)."""
    from lib.orchestrator.evaluation import paired_gain
    from lib.stages import minutes

    names, gains, _, trained = layout(more)
    dirs = {name: out / "eval" / name for name in names}
    done = {name for name, run_dir in dirs.items() if evaluated(demo, run_dir)}

    def rewards(name: str) -> str:
        if name not in done:
            return "-"
        return f"{demo.reward(dirs[name]):.3f} ({demo.reward(demo.greedy(dirs[name])):.3f})"

    def gain(before: str, after: str, bar: float) -> str:
        if not {before, after} <= done:
            return "-"
        said = []
        for kind in (lambda d: d, demo.greedy):
            value, error = paired_gain(kind(dirs[before]), kind(dirs[after]))
            said.append(f"{value:+.3f} ({value / error:+.1f})" if error > 0 else f"{value:+.3f}")
            if kind is not demo.greedy:
                counts[(before, after, bar)] += error > 0 and value > bar * error
        return "; ".join(said)

    took = minutes(out / "inputs.json")
    stage_minutes = "/".join(f"{took[name]:.1f}" if name in took else "-" for name in trained)
    evals = sum(value for name, value in took.items() if name.startswith("eval "))
    cells = [f"`{task}`", *(rewards(name) for name in names)]
    cells += [gain(before, after, bar) for before, after, bar in gains]
    return "| " + " | ".join(cells + [f"{stage_minutes}, evals {evals:.1f}"]) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "reasoning_gym_table")
    parser.add_argument("--sft-steps", type=int, default=60)
    parser.add_argument("--rl-steps", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--more-rl-steps",
        type=int,
        help="also continue each SFT+RL run to this many steps (after every task's first RL), and evaluate it",
    )
    parser.add_argument("--table", action="store_true", help="print the table of the runs there; run nothing")
    args = parser.parse_args()
    demo = load_script("demo")
    if not args.table:
        from lib.stages import run_stages

        if not (DEFAULT_MODEL / "config.json").is_file():
            demo.run("scripts/smollm2.py", "--out", str(DEFAULT_MODEL))
        # Base -> SFT -> RL on every task first, then the longer RL, then RL alone: the main columns first.
        later = [f"rl{args.more_rl_steps}", "rl-alone"]
        for passing in range(3):
            for task in args.tasks:
                out = args.out / task
                out.mkdir(parents=True, exist_ok=True)
                every = stages(demo, task, out, args.sft_steps, args.rl_steps, args.seed, args.more_rl_steps)
                every = [s for s in every if not any(s.name.endswith(name) for name in later[passing:])]
                run_stages(every, out / "inputs.json", f"{task} in {out}")
    more = args.more_rl_steps
    names, gains, labels, trained = layout(more)
    header = [labels[name] for name in names] + [
        f"{labels[after]} - {labels[before]}" for before, after, _ in gains
    ]
    header = ["task", *header, "minutes: " + "/".join(trained.values())]
    print(
        f"\nheld-out reward on the test split, sampled (greedy), {args.sft_steps} SFT steps, {args.rl_steps} RL "
        "steps; gains paired over the same problems, (their size in standard errors)\n\n"
        f"| {' | '.join(header)} |\n|" + "---|" * len(header)
    )
    counts = collections.Counter()
    for task in args.tasks:
        print(row(demo, task, args.out / task, counts, more))
    print(
        "\ntasks whose sampled gain passes its bar: "
        + ", ".join(
            f"{after} - {before} > {bar} se: {count}" for (before, after, bar), count in counts.items()
        )
    )


if __name__ == "__main__":
    main()
