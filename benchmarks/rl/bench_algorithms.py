"""Every recipe side by side on CPU: held-out reward against steps and minutes, over seeds, with and without a KL.

Each recipe (configs/recipes/{dppo,grpo,dr_grpo,dapo,gspo,cispo}.toml, dppo being rl.py's default), with and
without --loss.kl-coef, trains the same SFT-warmed tiny model on reverse_text with the tiny preset under it
(the demo's RL: 8 prompts x 8 rollouts a step, temperature 1, lr 3e-4; its own loss, GSPO's, is replaced by
the recipe's), the same number of steps, once per seed. Each run evaluates the same held-out tasks (the
taskset's last --eval-examples, never trained on) at step 0, every --eval-every steps and at the end
(eval/reward: sampled at temperature 1). Runs go one after the other, never side by side (2 cores), and a
finished run is kept: rerunning the command goes on where it stopped.

The report (out/table.md, out/results.json, out/algorithms.png): per configuration, the final held-out reward
as the mean over seeds +- its standard error, the gain over step 0, the minutes, and the mismatch and
reference KL of the last step. "Clearly better" than dppo: a final reward higher by more than 2 standard
errors of the difference of the two means. Wall times are those of a shared machine: compare minutes only
between runs of one invocation.

--preset puts another RL preset under the recipes (configs/smollm2/rl.toml for the real model: its batch,
lengths and learning rate stay, its loss is the recipe's); --override adds rl.py arguments to one recipe's
runs (GSPO's clip, chosen for the model at hand).

Without --model, the tiny model is made and SFT-warmed as scripts/demo.py does (1200 steps, the learning
rate ending at 30% of its peak).

Usage:
    python benchmarks/rl/bench_algorithms.py                                        # ~12 x 3 runs of 250 steps
    python benchmarks/rl/bench_algorithms.py --model outputs/demo-tiny/sft/weights/step_1200 --recipes dppo grpo
    python benchmarks/rl/bench_algorithms.py --configs dppo gspo cispo+kl --eval-every 50 --eval-examples 128
    python benchmarks/rl/bench_algorithms.py --steps 2 --seeds 1 --sft-steps 10 --eval-examples 4 --eval-every 1
    python benchmarks/rl/bench_algorithms.py --preset configs/smollm2/rl.toml --model outputs/demo-vllm/sft/weights/step_150 \
        --configs dppo gspo cispo --override gspo="--loss.clip-low 0.01 --loss.clip-high 0.01" --steps 15 --eval-every 15
"""

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402

RECIPES = ["dppo", "grpo", "dr_grpo", "dapo", "gspo", "cispo"]


def run(command: list[str]) -> None:
    print(f"\n$ {' '.join(command)}", flush=True)
    subprocess.run([sys.executable, *command], cwd=ROOT, check=True)


def warmed_model(args) -> Path:
    """The demo's SFT-warmed tiny model, made under out/ unless it is there already."""
    model, sft = args.out / "model", args.out / "sft"
    weights = sft / "weights" / f"step_{args.sft_steps}"
    if not weights.is_dir():
        run(["scripts/tiny.py", "--out", str(model)])
        run(["scripts/sft.py", "@", "configs/tiny/sft.toml", "--model.name", str(model), "--steps",
             str(args.sft_steps), "--checkpoint-every", str(args.sft_steps), "--optim.min-lr-ratio",
             str(args.sft_min_lr_ratio), "--output-dir", str(sft)])  # fmt: skip
    return weights


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Every tensorboard scalar of a run: {tag: [(step, wall time, value)]}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0}).Reload()
    return {
        tag: [(e.step, e.wall_time, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def train(args, model: Path, recipe: str, kl_coef: float, seed: int) -> dict:
    """One run (skipped when its last evaluation is on disk): its held-out curve and last-step metrics."""
    run_dir = args.out / "runs" / f"{recipe}{'+kl' if kl_coef else ''}" / f"seed_{seed}"
    done = run_dir / "tb"
    if not (done.is_dir() and any(s == args.steps for s, _, _ in scalars(run_dir).get("eval/reward", []))):
        run(["scripts/rl.py", "@", args.preset, "@", f"configs/recipes/{recipe}.toml",
             "--model.name", str(model), "--steps", str(args.steps), "--seed", str(seed), "--loss.kl-coef", str(kl_coef),
             "--eval.every", str(args.eval_every), "--eval.num-examples", str(args.eval_examples),
             "--checkpoint-every", str(args.steps), "--output-dir", str(run_dir), *args.overrides.get(recipe, [])])  # fmt: skip
    tags = scalars(run_dir)
    evals = tags["eval/reward"]
    began = evals[0][1]  # the step-0 evaluation: minutes count from there
    last = {tag: values[-1][2] for tag, values in tags.items() if tag.startswith("train/")}
    return {
        "curve": [(step, (wall - began) / 60, value) for step, wall, value in evals],
        "greedy": [value for _, _, value in tags.get("eval/reward_greedy", [])],
        "mismatch_kl": last.get("train/mismatch_kl", float("nan")),
        "ref_kl": last.get("train/ref_kl", float("nan")),
    }


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (0 with one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def report(args, results: dict[str, list[dict]]) -> str:
    rows = ["| configuration | held-out reward at the end | gain over step 0 | greedy at the end | minutes | mismatch_kl | ref_kl | vs dppo |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    finals = {name: mean_and_error([r["curve"][-1][2] for r in runs]) for name, runs in results.items()}
    base = finals.get("dppo")
    for name, runs in results.items():
        final, error = finals[name]
        gain, gain_error = mean_and_error([r["curve"][-1][2] - r["curve"][0][2] for r in runs])
        minutes = statistics.fmean(r["curve"][-1][1] for r in runs)
        verdict = ""
        if base is not None and name != "dppo":
            difference, difference_error = final - base[0], math.hypot(error, base[1])
            clearly = difference_error > 0 and abs(difference) > 2 * difference_error
            verdict = f"{difference:+.3f} ({'clearly ' + ('better' if difference > 0 else 'worse') if clearly else 'within 2 SE'})"
        greedy = "-"
        if all(r.get("greedy") for r in runs):  # runs from before the column was kept have none
            greedy = "{:.3f} +- {:.3f}".format(*mean_and_error([r["greedy"][-1] for r in runs]))
        mismatch = statistics.fmean(r["mismatch_kl"] for r in runs)
        ref_kl = statistics.fmean(r["ref_kl"] for r in runs)
        rows.append(f"| {name} | {final:.3f} +- {error:.3f} | {gain:+.3f} +- {gain_error:.3f} | {greedy} | {minutes:.1f} | "
                    f"{mismatch:.4f} | {'-' if math.isnan(ref_kl) else f'{ref_kl:.4f}'} | {verdict} |")  # fmt: skip
    seeds = len(next(iter(results.values())))
    return (f"{args.steps} steps, {seeds} seed(s), held-out reward of {args.eval_examples} tasks x 4 samples "
            "(mean +- standard error over seeds)\n\n" + "\n".join(rows) + "\n")  # fmt: skip


def plot(path: Path, results: dict[str, list[dict]]) -> None:
    """Held-out reward (mean over seeds, error bars of one standard error) against steps and minutes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_minute) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, runs in results.items():
        points = list(
            zip(*[r["curve"] for r in runs])
        )  # per evaluation, every seed's (step, minutes, reward)
        steps = [p[0][0] for p in points]
        minutes = [statistics.fmean(seed[1] for seed in p) for p in points]
        means, errors = zip(*[mean_and_error([seed[2] for seed in p]) for p in points])
        recipe = name.removesuffix("+kl")
        style = {
            "color": f"C{RECIPES.index(recipe)}",  # a recipe's two runs share a colour; +kl is dashed
            "linestyle": "--" if name.endswith("+kl") else "-",
            "marker": "o",
            "capsize": 3,
            "label": name,
        }
        by_step.errorbar(steps, means, yerr=errors, **style)
        by_minute.errorbar(minutes, means, yerr=errors, **style)
    by_step.set(xlabel="step", ylabel="held-out reward (sampled)")
    by_minute.set(xlabel="minutes (mean over seeds)")
    for axes in (by_step, by_minute):
        axes.grid(alpha=0.3)
    by_minute.legend(loc="best", fontsize="small")
    figure.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, help="an SFT-warmed model (default: warm the tiny one as the demo does)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_algorithms")
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    parser.add_argument(
        "--kl-coef", type=float, default=0.04, help="the +kl runs' coefficient (0: no +kl runs)"
    )
    parser.add_argument(
        "--configs", nargs="+", choices=RECIPES + [f"{r}+kl" for r in RECIPES],
        help="only these configurations, each a recipe with or without +kl (default: every --recipes x KL)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-examples", type=int, default=100)
    parser.add_argument("--sft-steps", type=int, default=1200)
    parser.add_argument("--sft-min-lr-ratio", type=float, default=0.3)
    parser.add_argument("--preset", default="configs/tiny/rl.toml", help="the RL preset under every recipe")
    parser.add_argument(
        "--override", action="append", default=[], metavar="RECIPE=ARGS",
        help='more rl.py arguments for one recipe, e.g. gspo="--loss.clip-low 0.01 --loss.clip-high 0.01"',
    )  # fmt: skip
    args = parser.parse_args()
    args.overrides = {}
    for override in args.override:
        recipe, _, extra = override.partition("=")
        if recipe not in RECIPES:
            parser.error(
                f"--override {override!r}: the recipe before '=' must be one of {', '.join(RECIPES)}"
            )
        args.overrides[recipe] = shlex.split(extra)
    args.out = args.out.resolve()
    print(f"run dir: {args.out}")
    model = (args.model or warmed_model(args)).resolve()
    names = args.configs or [
        f"{recipe}{kl}" for recipe in args.recipes for kl in (["", "+kl"] if args.kl_coef else [""])
    ]
    results = {}
    for name in names:
        recipe, kl_coef = name.removesuffix("+kl"), args.kl_coef if name.endswith("+kl") else 0.0
        results[name] = [train(args, model, recipe, kl_coef, seed) for seed in range(args.seeds)]
    table = report(args, results)
    (args.out / "table.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(args.out / "algorithms.png", results)
    print("\n" + table)
    print(f"plot: {args.out / 'algorithms.png'}")
    print(f"run dir: {args.out}")


if __name__ == "__main__":
    main()
