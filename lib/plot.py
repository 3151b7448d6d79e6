"""Curve plots: a run's per-step metric (reward or loss), its moving average and evaluation points, as a PNG."""

from pathlib import Path


def plot_curve(
    path: Path,
    steps: list[int],
    values: list[float],
    label: str,
    title: str,
    points: dict[str, list[tuple[int, float]]] | None = None,
    lines: dict[str, float] | None = None,
    window: int = 20,
) -> Path:
    """Writes the curve of `values` over `steps` (with a `window`-step moving average once it has that
    many), each series of `points` as markers joined by a line (evaluations), each of `lines` as a
    dashed horizontal line. Written to a temporary name and renamed: a reader never sees half a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(steps, values, marker=".", alpha=0.4, label=label)
    if len(values) >= window:  # per-step values are noisy: the moving average shows the trend
        smooth = [sum(values[i - window : i]) / window for i in range(window, len(values) + 1)]
        axes.plot(steps[window - 1 :], smooth, color="tab:blue", label=f"moving average of {window} steps")
    for (name, series), color in zip((points or {}).items(), ("tab:red", "tab:green", "tab:purple")):
        if series:
            xs, ys = zip(*series)
            axes.plot(xs, ys, marker="o", color=color, label=name)
    for (name, value), color in zip((lines or {}).items(), ("gray", "green", "black")):
        axes.axhline(value, color=color, linestyle="--", label=f"{name}: {value:.3f}")
    axes.set(xlabel="step", ylabel=label.split(" (")[0], title=title)
    axes.legend(loc="best", fontsize="small")
    axes.grid(alpha=0.3)
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial.png")
    figure.savefig(partial, dpi=120, bbox_inches="tight")
    plt.close(figure)
    partial.replace(path)
    return path


def eval_points(evaluator) -> dict[str, list[tuple[int, float]]]:
    """An Evaluator's (or None's) evaluations as plot_curve's points: sampled and greedy reward."""
    evals = evaluator.history if evaluator is not None else []
    keys = {"eval, sampled": "eval/reward", "eval, greedy": "eval/reward_greedy"}
    return {
        name: [(step, values[key]) for step, values in evals if key in values] for name, key in keys.items()
    }
