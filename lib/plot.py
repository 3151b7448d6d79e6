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
    return save(figure, path)


def eval_points(evaluator) -> dict[str, list[tuple[int, float]]]:
    """An Evaluator's (or None's) evaluations as plot_curve's points: sampled and greedy reward."""
    evals = evaluator.history if evaluator is not None else []
    keys = {"eval, sampled": "eval/reward", "eval, greedy": "eval/reward_greedy"}
    return {
        name: [(step, values[key]) for step, values in evals if key in values] for name, key in keys.items()
    }


def plot_stages(
    path: Path,
    sft_loss: list[tuple[int, float]],
    rl_reward: list[tuple[int, float]],
    evaluations: dict[str, list[float]],
    title: str,
) -> Path:
    """The demo's figure: SFT's loss (right axis) over its steps, then RL's reward over its own (left axis),
    on one step axis; each of `evaluations` (sampled, greedy) as points before SFT, after it and after RL.
    Written as plot_curve writes its PNG (save)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sft_steps = sft_loss[-1][0] if sft_loss else 0
    figure, reward_axes = plt.subplots(figsize=(8, 4.5))
    loss_axes = reward_axes.twinx()
    if sft_loss:
        xs, ys = zip(*sft_loss)
        loss_axes.plot(xs, ys, color="tab:gray", alpha=0.6, label="SFT loss (right axis)")
    if rl_reward:
        xs, ys = zip(*rl_reward)
        reward_axes.plot(
            [sft_steps + x for x in xs],
            ys,
            color="tab:blue",
            alpha=0.5,
            marker=".",
            label="RL reward (mean of each step's sampled rollouts)",
        )
    at = [0, sft_steps, sft_steps + (rl_reward[-1][0] if rl_reward else 0)]
    for (name, values), color in zip(evaluations.items(), ("tab:red", "tab:green")):
        reward_axes.plot(at[-len(values) :], values, marker="o", color=color, linestyle=":", label=name)
        for x, y in zip(at[-len(values) :], values):
            reward_axes.annotate(
                f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize="small"
            )
    reward_axes.axvline(sft_steps, color="black", linewidth=0.8, linestyle="--")
    reward_axes.set(
        xlabel=f"step (SFT 1-{sft_steps}, then RL)", ylabel="reward", title=title, ylim=(-0.02, 1.02)
    )
    loss_axes.set_ylabel("SFT loss")
    handles = [h for axes in (reward_axes, loss_axes) for h in axes.get_legend_handles_labels()[0]]
    reward_axes.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, fontsize="small"
    )
    reward_axes.grid(alpha=0.3)
    return save(figure, path)


def save(figure, path: Path) -> Path:
    """Writes `figure` as a PNG to a temporary name and renames it: a reader never sees half a PNG."""
    import matplotlib.pyplot as plt

    path = Path(path)
    partial = path.with_name(f".{path.name}.partial.png")
    figure.savefig(partial, dpi=120, bbox_inches="tight")
    plt.close(figure)
    partial.replace(path)
    return path
