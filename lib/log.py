"""Training logs: tensorboard scalars and text, a progress bar with ETA, and periodic console lines (rank 0 only)."""

from pathlib import Path


def fmt(value: float) -> str:
    return f"{value:.3e}" if value and (abs(value) < 1e-3 or abs(value) >= 1e5) else f"{value:.4g}"


class RunLog:
    """Rank 0 writes tensorboard events to run_dir/tb and draws the bar; other ranks do nothing.

    Events past `start_step` from an earlier, interrupted run are discarded so a resumed run's curves
    do not overlap. Console lines are printed every `print_every` steps; the bar is drawn only on a
    terminal, so a log file gets the lines alone.
    """

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool, print_every: int):
        self.enabled, self.print_every = enabled, print_every
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            str(Path(run_dir) / "tb"), purge_step=start_step + 1 if start_step else None
        )
        console = Console()
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeRemainingColumn(elapsed_when_finished=True),
            TextColumn("{task.fields[metrics]}"),
            console=console,
            disable=not console.is_terminal,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=start_step, metrics="")
        self.progress.start()

    def print(self, *lines: str) -> None:
        if self.enabled:
            for line in lines:
                self.progress.console.print(line, highlight=False, markup=False, soft_wrap=True)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Logs `values` at `step` (1-based: the number of optimizer steps done) and advances the bar."""
        if not self.enabled:
            return
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        summary = "  ".join(f"{name.split('/')[-1]} {fmt(value)}" for name, value in values.items())
        self.progress.update(self.task, completed=step, metrics=summary)
        if step % self.print_every == 0:
            self.print(f"step {step}  {summary}")

    def flush(self) -> None:
        """Puts every event so far on disk (call it with each checkpoint: a killed run keeps its curves)."""
        if self.enabled:
            self.writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self.writer.add_text(tag, text, step)

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
            self.writer.close()
