"""RL curves from rl.py run directories: held-out reward against the step, beside the training reward, a table.

For each run (a directory rl.py wrote with `--eval.every N`): the held-out evaluations (sampled and greedy,
each with its standard error, from eval/step_N/*.jsonl), the training steps' reward and entropy over the
first and last ten steps, the share of groups with any reward spread, and what the last evaluation's
sampled completions get wrong, counted by kind (reverse_text and plainrl_arithmetic). Prints a Markdown
table and draws the curves into one PNG. Reads only what the runs wrote; runs nothing.

Usage:
    python benchmarks/rl/rl_curves.py preset=outputs/curves/preset trl=outputs/curves/trl --plot docs/curves.png
    python benchmarks/rl/rl_curves.py outputs/curves/* --samples 3     # also quote 3 wrong completions a run
"""

import argparse
import json
import re
import statistics
import sys
import tomllib
from collections import Counter, defaultdict
from difflib import SequenceMatcher
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mean_and_se(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return (values[0] if values else float("nan")), float("nan")
    return statistics.fmean(values), statistics.stdev(values) / len(values) ** 0.5


def reply(row: dict) -> str:
    """The last assistant message of an evaluation record."""
    for message in reversed(row.get("messages") or []):
        if message.get("role") == "assistant":
            return message.get("content") or ""
    return row.get("completion") if isinstance(row.get("completion"), str) else ""


def user_text(row: dict) -> str:
    for message in row.get("messages") or []:
        if message.get("role") == "user":
            return message.get("content") or ""
    return ""


def reverse_text_failure(row: dict, cut: bool) -> str:
    """What a reverse_text reply gets wrong, one kind a reply (first that applies)."""
    text, answer = user_text(row), reply(row)
    if row["reward"] >= 1.0:
        return "exact"
    if "<reversed_text>" not in answer:
        return "no opening tag"
    if "</reversed_text>" not in answer:
        hacked = re.search(r"</reversed[^_]", answer) or answer.rstrip().endswith("</reversed")
        if hacked:
            return "other closing tag (</reversed...)"
        return "never closed, cut at max_tokens" if cut else "never closed"
    inside = answer.split("<reversed_text>", 1)[1].split("</reversed_text>", 1)[0].strip()
    if SequenceMatcher(None, inside, text).ratio() > SequenceMatcher(None, inside, text[::-1]).ratio():
        return "copied forward, not reversed"
    if len(inside) < 0.8 * len(text):
        return "reversed, but too short (words left out)"
    if len(inside) > 1.2 * len(text):
        return "reversed, but too long (words added)"
    return "reversed, characters wrong"


def arithmetic_failure(row: dict, cut: bool) -> str:
    """What a plainrl_arithmetic reply gets wrong."""
    import plainrl_arithmetic as arith

    question = user_text(row).removeprefix("What is ").removesuffix("?")
    value = eval(question.replace(" ", "")) if re.fullmatch(r"[\d +\-*]+", question) else None
    answer = arith.parse_answer(reply(row))
    if row["reward"] >= 1.0:
        return "right"
    if answer is None:
        return "no number"
    if value is not None and answer == -value:
        return "sign wrong"
    if cut and "<answer>" not in reply(row):
        return "cut at max_tokens"
    return "wrong value"


FAILURES = {"reverse_text": reverse_text_failure, "plainrl_arithmetic": arithmetic_failure}


def summarise(label: str, run: Path, samples: int) -> dict:
    steps = read_jsonl(run / "metrics.jsonl")
    trained = [s for s in steps if "reward/mean" in s]
    evals = []
    for directory in sorted((run / "eval").glob("step_*"), key=lambda p: int(p.name[5:])):
        sampled = read_jsonl(directory / "sampled.jsonl") if (directory / "sampled.jsonl").is_file() else []
        greedy = read_jsonl(directory / "greedy.jsonl") if (directory / "greedy.jsonl").is_file() else []
        evals.append(
            {
                "step": int(directory.name[5:]),
                "sampled": mean_and_se([r["reward"] for r in sampled]),
                "greedy": mean_and_se([r["reward"] for r in greedy]),
                "rows": sampled,
            }
        )
    spread = []
    for path in sorted((run / "rollouts").glob("step_*.jsonl")):
        groups = defaultdict(list)
        for row in read_jsonl(path):
            groups[row["task_id"]].append(row["reward"])
        spread += [max(r) > min(r) for r in groups.values()]
    config = tomllib.loads((run / "config.toml").read_text())  # the run's resolved config
    env, max_tokens = config["env"]["id"], config["sampling"]["max_tokens"]
    kinds, quoted = Counter(), []
    if evals and env in FAILURES:
        for row in evals[-1]["rows"]:
            kind = FAILURES[env](row, cut=row.get("num_completion_tokens", 0) >= max_tokens)
            kinds[kind] += 1
            if kind not in ("exact", "right") and len(quoted) < samples:
                quoted.append((kind, user_text(row), reply(row)))

    def window(key: str, rows: list[dict]) -> float:
        values = [s[key] for s in rows if key in s]
        return statistics.fmean(values) if values else float("nan")

    return {
        "label": label,
        "run": run,
        "env": env,
        "evals": evals,
        "steps": [s["step"] for s in trained],
        "train_reward": [s["reward/mean"] for s in trained],
        "first": {k: window(k, trained[:10]) for k in ("reward/mean", "train/entropy")},
        "last": {k: window(k, trained[-10:]) for k in ("reward/mean", "train/entropy")},
        "spread": sum(spread) / len(spread) if spread else float("nan"),
        "kinds": kinds,
        "quoted": quoted,
    }


def table(runs: list[dict]) -> str:
    head = (
        "| run | steps | held-out sampled: start -> end (SE) | greedy: start -> end | "
        "train reward, first 10 -> last 10 | entropy | groups with spread |\n|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in runs:
        first, last = r["evals"][0] if r["evals"] else None, r["evals"][-1] if r["evals"] else None
        held = greedy = "-"
        if first and last:
            diff_se = (first["sampled"][1] ** 2 + last["sampled"][1] ** 2) ** 0.5
            held = (
                f"{first['sampled'][0]:.3f} -> {last['sampled'][0]:.3f} "
                f"({last['sampled'][0] - first['sampled'][0]:+.3f}, {diff_se:.3f})"
            )
            greedy = f"{first['greedy'][0]:.3f} -> {last['greedy'][0]:.3f}"
        lines.append(
            f"| {r['label']} | {r['steps'][-1] if r['steps'] else 0} | {held} | {greedy} | "
            f"{r['first']['reward/mean']:.3f} -> {r['last']['reward/mean']:.3f} | "
            f"{r['first']['train/entropy']:.2f} -> {r['last']['train/entropy']:.2f} | {r['spread']:.0%} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (held, train) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, r in enumerate(runs):
        color = f"C{index}"
        steps = [e["step"] for e in r["evals"]]
        held.errorbar(
            steps,
            [e["sampled"][0] for e in r["evals"]],
            [e["sampled"][1] for e in r["evals"]],
            color=color,
            marker="o",
            capsize=3,
            label=r["label"],
        )
        held.plot(
            steps,
            [e["greedy"][0] for e in r["evals"]],
            color=color,
            ls="--",
            marker="x",
        )
        train.plot(r["steps"], r["train_reward"], color=color, alpha=0.8)
    held.set(xlabel="RL step", ylabel="held-out reward", title="held-out (sampled ± SE, greedy dashed)")
    train.set(xlabel="RL step", ylabel="reward", title="training steps' own reward (mean of the step)")
    # One legend for both panels, under them: a run's colour is the same in each, and inside a panel the
    # legend hid the last evaluations.
    figure.legend(loc="lower center", ncol=min(len(runs), 6), fontsize=8)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run directories, each as LABEL=DIR or DIR")
    parser.add_argument("--plot", type=Path, help="where to draw the curves (PNG)")
    parser.add_argument("--samples", type=int, default=0, help="wrong completions to quote per run")
    args = parser.parse_args()
    runs = []
    for spec in args.runs:
        label, _, directory = spec.rpartition("=")
        runs.append(summarise(label or Path(directory).name, Path(directory), args.samples))
    print(table(runs))
    for r in runs:
        total = sum(r["kinds"].values())
        counts = ", ".join(f"{kind} {count}" for kind, count in r["kinds"].most_common())
        print(f"\n{r['label']} ({r['env']}), last evaluation's {total} sampled replies: {counts}")
        for kind, prompt, answer in r["quoted"]:
            print(f"  [{kind}] {prompt!r} -> {answer!r}")
    if args.plot:
        plot(runs, args.plot)
        print(f"\ncurves: {args.plot}")


if __name__ == "__main__":
    main()
