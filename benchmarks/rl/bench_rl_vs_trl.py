"""plainrl vs TRL's GRPOTrainer on CPU, in one run: seconds per optimizer step and rollouts per second.

Both train the same model on the same chats (bench_trl_grpo.make_prompts, in the same order) with the
same reward, 8 prompts x 8 completions per step, at most 64 completion tokens, temperature 1, AdamW at
lr 1e-4, and the same loss: TRL's defaults, which configs/recipes/trl.toml writes out for plainrl (--recipe
picks another, such as rl.py's default dppo, which then compares two algorithms as well). TRL runs
bench_trl_grpo.py in its own throw-away virtualenv (--trl-python; plainrl does not depend on TRL); plainrl
runs scripts/rl.py with a preset (--preset, the tiny one by default), as a user would: it starts its builtin
server, splits the cores between server and trainer, and keeps up to max_async_level = 1 step of rollouts
ahead.

Both figures are intervals between consecutive optimizer-step ends after --warmup steps (their mean
is the timed steps over the wall time from the end of the last warm-up step to the last timed step's
end), so they include generation, scoring, the update and (plainrl) the weight push to the server.
TRL's is read from its trainer callback, plainrl's from the wall time of each step's tensorboard
event; plainrl's last step ends when the server has loaded its weights (the final sync, which runs
beside the next step in the loop, read from server.log). The two runs go one after the other, never
side by side: on 2 cores a neighbour would distort both.

Give a model whose groups carry signal (an SFT-warmed tiny model). TRL trains every completion, flat
groups (all rewards equal, zero advantages) included; plainrl drops flat groups from the backward. The
difflib reward is continuous, so flat groups are rare on a warmed model: plainrl's mean count per step
is printed (flat_groups) so the difference in work is visible.

Rewards: each side's mean over the last 10 steps, per seed and over the seeds (mean +- standard error of the
seed means), and plainrl's minus TRL's paired by seed and step (both sides sample the same prompts at the
same step, so their difficulty cancels; the standard error is over every paired step, not 3 seed means).

Usage:
    python benchmarks/rl/bench_rl_vs_trl.py --model outputs/tiny/sft/weights/step_2000
    python benchmarks/rl/bench_rl_vs_trl.py --model M --trl-python /tmp/trlvenv/bin/python --steps 20
    python benchmarks/rl/bench_rl_vs_trl.py --model M --trl-threads 1 --seeds 0 1 2   # a busy machine, three seeds
    python benchmarks/rl/bench_rl_vs_trl.py --model M --top-p 0.9 --top-k 20      # kept sets replayed
    python benchmarks/rl/bench_rl_vs_trl.py --model outputs/demo/sft/weights/step_150 --preset configs/smollm2/rl.toml \
        --plainrl-args "--micro-batch-size 2 --model.dtype float32" --steps 4 --warmup 1   # the real model
    # the control on reverse_text itself: TRL trains on the tasks a demo's RL stage drew, in its order, and
    # eval.py scores the start model and both sides' last weights on the same held-out tasks
    python benchmarks/rl/bench_rl_vs_trl.py --model outputs/demo/sft/weights/step_200 --taskset reverse_text \
        --plainrl-run outputs/demo/rl --warmup 0 --steps 30 --trl-bf16 --save-every 10 \
        --score configs/smollm2/eval.toml --out outputs/trl-control
(bench_trl_grpo.py's docstring shows how to make the TRL virtualenv.)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
from benchmarks.common import ROOT  # noqa: E402

HERE = Path(__file__).resolve().parent


def step_intervals(wall_times: list[float], warmup: int) -> list[float]:
    """Seconds between consecutive step ends, from the end of warm-up step `warmup` on."""
    timed = wall_times[warmup - 1 :] if warmup else wall_times
    return [b - a for a, b in zip(timed, timed[1:])]


def last_reload_time(server_log: Path) -> float:
    """Epoch seconds of the server's last "loaded weights" log line (0 when there is none)."""
    import datetime

    stamps = [line[:23] for line in server_log.read_text().splitlines() if "loaded weights from" in line]
    if not stamps:
        return 0.0
    return datetime.datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def summary(name: str, intervals: list[float], rollouts_per_step: int, **extra) -> dict:
    mean, median = statistics.fmean(intervals), statistics.median(intervals)
    return {
        "framework": name,
        "steps_timed": len(intervals),
        "seconds_per_step": round(mean, 4),
        "seconds_per_step_median": round(median, 4),
        "rollouts_per_second": round(rollouts_per_step / mean, 2),
        "rollouts_per_second_median": round(rollouts_per_step / median, 2),
        **extra,
    }


def run_trl(args, out: Path, prompts: Path | None) -> dict:
    command = [
        args.trl_python,
        str(HERE / "bench_trl_grpo.py"),
        args.model,
        "--output-dir",
        str(out),
        "--save-every",
        str(args.save_every),
        *(["--prompts", str(prompts)] if prompts else []),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--max-tokens",
        str(args.max_tokens),
        "--lr",
        str(args.lr),
        "--seed",
        str(args.seed),
        "--threads",
        str(args.trl_threads),
        *(["--bf16"] if args.trl_bf16 else []),
        "--top-p",
        str(args.top_p),
        "--top-k",
        str(max(args.top_k, 0)),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"the TRL run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_plainrl(args, out: Path) -> dict:
    steps = args.warmup + args.steps
    command = [
        sys.executable,
        str(ROOT / "scripts/rl.py"),
        "@",
        str(ROOT / args.preset),
        "@",
        str(ROOT / "configs/recipes" / f"{args.recipe}.toml"),  # the loss (trl: TRL's own, by default)
        "--model.name",
        args.model,
        # reverse_text: the preset's own tasks, drawn as rl.py draws them (TRL then takes the same ones)
        *(
            ["--env.id", "trl_bench_taskset", "--env.num-examples", str(steps * 8)]
            if args.taskset == "trl_bench"
            else []
        ),
        "--steps",
        str(steps),
        "--examples-per-step",
        "8",
        "--rollouts-per-example",
        "8",
        "--micro-batch-size",
        "64",
        "--sampling.temperature",
        "1.0",
        "--sampling.max-tokens",
        str(args.max_tokens),
        "--optim.lr",
        str(args.lr),
        "--seed",
        str(args.seed),
        "--max-async-level",
        str(args.max_async_level),
        "--sampling.top-p",
        str(args.top_p),
        "--sampling.top-k",
        str(args.top_k),
        "--inference.engine",
        "torch",
        "--checkpoint-every",
        str(steps),
        "--output-dir",
        str(out),
        *args.plainrl_args.split(),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"the plainrl run failed:\n{result.stderr[-3000:]}")
    return plainrl_figures(args, out)


def plainrl_figures(args, out: Path) -> dict:
    """The figures of an rl.py run directory: step times from tensorboard, rewards, the loss's diagnostics."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb")).Reload()
    ends = [event.wall_time for event in events.Scalars("time/step")]
    ends[-1] = max(ends[-1], last_reload_time(out / "server.log"))
    rewards = [event.value for event in events.Scalars("reward/mean")]

    def timed_mean(name: str) -> float:
        return round(statistics.fmean(e.value for e in events.Scalars(name)[args.warmup :]), 4)

    splits = {
        name: timed_mean(f"time/{name}") for name in ("wait_rollouts", "train", "sync_weights", "wait_sync")
    }
    return summary(
        "plainrl",
        step_intervals(ends, args.warmup),
        64,
        max_async_level=args.max_async_level,
        recipe=args.recipe,
        mean_seconds=splits,
        rollout_tokens_per_second=timed_mean("perf/rollout_tokens_per_second"),
        train_tokens_per_second=timed_mean("perf/tokens_per_second"),
        importance_ratio=timed_mean("train/importance_ratio"),
        flat_groups=timed_mean("rollouts/flat_groups"),
        reward_mean=round(statistics.fmean(rewards), 4),
        reward_last10=round(statistics.fmean(rewards[-10:]), 4),
        rewards=[round(reward, 4) for reward in rewards],
    )


def drawn_prompts(run_dir: Path, steps: int, out: Path) -> Path:
    """The prompts an rl.py run drew, in its order (one per group, from rollouts/step_N.jsonl), as
    bench_trl_grpo.py's --prompts file: TRL then trains on the very tasks plainrl did, step by step."""
    lines = []
    for step in range(1, steps + 1):
        path = run_dir / "rollouts" / f"step_{step}.jsonl"
        if not path.is_file():
            sys.exit(f"{path} is missing: the plainrl run has fewer than {steps} steps.")
        seen = set()
        for record in map(json.loads, path.read_text().splitlines()):
            if record["task_id"] in seen:
                continue
            seen.add(record["task_id"])
            # rollout records show the prompt as "[system] ...\n[user] ..." (lib/orchestrator/envs.py)
            system, _, user = record["prompt"].partition("\n[user] ")
            if not system.startswith("[system] ") or "\n[" in user:
                sys.exit(f"{path}: a prompt other than one system and one user message: {record['prompt']!r}")
            messages = [{"role": "system", "content": system[9:]}, {"role": "user", "content": user}]
            lines.append(json.dumps({"prompt": messages, "text": user}) + "\n")
    out.write_text("".join(lines))
    return out


def score(args, weights: Path, name: str, out: Path) -> dict:
    """eval.py's held-out reward of `weights` on reverse_text with the --score preset: sampled at temperature 1
    and greedy, each with its standard error."""
    figures = {}
    for kind, temperature in (("sampled", "1.0"), ("greedy", "0.0")):
        run_name = f"{name}-{kind}"
        if not (out / run_name / "summary.json").is_file():
            command = [
                sys.executable,
                str(ROOT / "scripts/eval.py"),
                "reverse_text",
                "@",
                str(ROOT / args.score),
            ]
            command += ["-m", str(weights), "--sampling.temperature", temperature]
            command += ["--output-dir", str(out), "--name", run_name]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"eval.py failed on {weights}:\n{result.stderr[-3000:]}")
        summary = json.loads((out / run_name / "summary.json").read_text())
        error = summary["std_reward"] / summary["num_rollouts"] ** 0.5
        figures[kind] = f"{summary['avg_reward']:.3f} +- {error:.3f}"
    return {"weights": str(weights), **figures}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="HF directory of the model both sides train.")
    parser.add_argument(
        "--trl-python", default="/tmp/trlvenv/bin/python", help="Python of the TRL virtualenv."
    )
    parser.add_argument("--steps", type=int, default=20, help="Timed optimizer steps on each side.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed steps before them.")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="Most completion tokens (an answer of a 4-word text with its tags is ~55).",
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="Both sides' seeds: one comparison each, then a summary.",
    )
    parser.add_argument(
        "--trl-bf16",
        action="store_true",
        help="TRL under bf16 autocast (plainrl's default where the CPU has it).",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="TRL's torch threads (0 = torch's default, one per core); on a busy machine 2 threads on 2 "
        "cores stall each other many times over, and plainrl's split gives each side 1.",
    )
    parser.add_argument("--max-async-level", type=int, default=1, help="plainrl's (TRL is on-policy).")
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="Both sides' top_p (1 = off). plainrl then scores each token over its kept set (served by its "
        "builtin engine); TRL over the full vocabulary.",
    )
    parser.add_argument("--top-k", type=int, default=-1, help="Both sides' top_k (-1 = off).")
    parser.add_argument("--preset", default="configs/tiny/rl.toml", help="plainrl's preset (configs/smollm2/rl.toml "
                        "for SmolLM2, with --plainrl-args '--micro-batch-size 2').")  # fmt: skip
    parser.add_argument("--recipe", default="trl", help="plainrl's loss, a configs/recipes/ name: trl (TRL's "
                        "defaults, the same algorithm on both sides) or e.g. dppo (rl.py's default).")  # fmt: skip
    parser.add_argument("--plainrl-args", default="", help="More rl.py flags, after the others (e.g. '--model.dtype "
                        "float32', TRL's dtype).")  # fmt: skip
    parser.add_argument(
        "--skip-trl", action="store_true", help="plainrl's side alone (TRL's figures from another run)."
    )
    parser.add_argument("--taskset", choices=("trl_bench", "reverse_text"), default="trl_bench", help="The "
                        "training tasks: trl_bench (2-4 common words, both sides' prompts made alike) or "
                        "reverse_text (the preset's own, as rl.py draws them; TRL gets the same ones in the same "
                        "order from plainrl's rollout records, so plainrl runs first).")  # fmt: skip
    parser.add_argument("--plainrl-run", help="An rl.py run directory to compare with instead of running plainrl "
                        "(one seed; e.g. a demo's rl/, run with this bench's settings).")  # fmt: skip
    parser.add_argument("--out", help="Keep the runs here (plainrl-seedN/, trl-seedN/ with TRL's weights) "
                        "instead of a temporary directory.")  # fmt: skip
    parser.add_argument("--save-every", type=int, default=0, help="TRL saves its weights every N steps (the "
                        "last step's always when --score is given).")  # fmt: skip
    parser.add_argument("--score", help="An eval.py preset (configs/smollm2/eval.toml): score the start model "
                        "and both sides' last weights on its held-out reverse_text tasks, sampled at "
                        "temperature 1 and greedily. Needs --out.")  # fmt: skip
    args = parser.parse_args()
    total = args.warmup + args.steps
    if args.score and not args.out:
        sys.exit("--score needs --out: the weights it scores are kept there.")
    if args.score and not args.save_every:
        args.save_every = total
    if args.plainrl_run and len(args.seeds) > 1:
        sys.exit("--plainrl-run is one run: give one seed.")
    if not (ROOT / "configs/recipes" / f"{args.recipe}.toml").is_file():
        sys.exit(f"no recipe configs/recipes/{args.recipe}.toml.")
    if not args.skip_trl and not Path(args.trl_python).is_file():
        sys.exit(f"no TRL virtualenv at {args.trl_python}: make one as bench_trl_grpo.py's docstring shows.")

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.out or tmp)
        base.mkdir(parents=True, exist_ok=True)
        for seed in args.seeds:
            args.seed = seed
            plainrl_dir = Path(args.plainrl_run) if args.plainrl_run else base / f"plainrl-seed{seed}"
            trl_dir, trl = base / f"trl-seed{seed}", None
            if args.taskset == "trl_bench" and not args.skip_trl:
                trl = run_trl(args, trl_dir, None)
                print(json.dumps({"seed": seed, **trl}), flush=True)
            if args.plainrl_run:
                plainrl = plainrl_figures(args, plainrl_dir)
            else:
                plainrl = run_plainrl(args, plainrl_dir)
            print(json.dumps({"seed": seed, **plainrl}), flush=True)
            if args.taskset == "reverse_text" and not args.skip_trl:
                prompts = drawn_prompts(plainrl_dir, total, base / f"prompts-seed{seed}.jsonl")
                trl = run_trl(args, trl_dir, prompts)
                print(json.dumps({"seed": seed, **trl}), flush=True)
            if args.score:
                scores = {"start": score(args, Path(args.model), "start", base / "scores")}
                scores["plainrl"] = score(
                    args, plainrl_dir / "weights" / f"step_{total}", f"plainrl-seed{seed}", base / "scores"
                )
                if trl:
                    scores["trl"] = score(
                        args, trl_dir / f"checkpoint-{total}", f"trl-seed{seed}", base / "scores"
                    )
                print(json.dumps({"seed": seed, "held_out": scores}), flush=True)
            runs.append((trl, plainrl))
    if args.skip_trl:
        return
    from lib.models.load import cpu_name

    speedups = [trl["seconds_per_step"] / plainrl["seconds_per_step"] for trl, plainrl in runs]
    medians = [trl["seconds_per_step_median"] / plainrl["seconds_per_step_median"] for trl, plainrl in runs]
    last10 = {
        side: [run[index]["reward_last10"] for run in runs] for index, side in enumerate(("trl", "plainrl"))
    }

    def mean_se(values: list[float]) -> str:
        spread = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
        return f"{statistics.fmean(values):.3f} +- {spread:.3f}"

    # Both sides draw the same prompts at the same step: paired by seed and step, the prompts' difficulty
    # cancels, and the standard error comes from every step rather than from 3 seed means.
    differences = [
        plainrl_reward - trl_reward
        for trl, plainrl in runs
        for trl_reward, plainrl_reward in zip(trl["rewards"][-10:], plainrl["rewards"][-10:])
    ]

    print(
        json.dumps(
            {
                "seeds": args.seeds,
                "cpu": cpu_name(),
                "plainrl_speedup": [round(x, 2) for x in speedups],
                "plainrl_speedup_median": [round(x, 2) for x in medians],
                "reward_last10": {side: mean_se(values) for side, values in last10.items()},
                "reward_last10_plainrl_minus_trl_paired": mean_se(differences),
                "target": 1.5,
            }
        )
    )


if __name__ == "__main__":
    main()
