"""Run logs, rank 0 only: tensorboard and metrics.jsonl always, Weights & Biases when asked, a progress bar and
console lines."""

import dataclasses
import html
import importlib.util
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from lib import dist, rundir
from lib.config import UserError, write_atomically

WANDB_INSTALL = "pip install wandb (or: pip install -r requirements.lock, which has it)"
# wandb's x-axis: the trainer's step, logged with every row. wandb's own step only grows, and drops rows
# whose step goes back, as a resumed run's do (it logs again from its checkpoint's step).
STEP_METRIC = "trainer/step"


@dataclasses.dataclass
class WandbConfig:
    project: str | None = None
    """Weights & Biases project; None = no wandb (tensorboard only)."""
    name: str | None = None
    """Run name shown in wandb (default: wandb picks one)."""
    entity: str | None = None
    """wandb team or user (default: your default entity)."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Tags of the wandb run."""
    offline: bool = False
    """Write the wandb run to run_dir/wandb only (no network); `wandb sync` uploads it later."""

    def __post_init__(self):
        if self.project is None and (self.name or self.entity or self.tags or self.offline):
            raise UserError(
                "wandb.name, wandb.entity, wandb.tags and wandb.offline need wandb.project as well."
            )
        # Checked when the config is parsed: a run that asks for wandb fails before any heavy work.
        if self.project is not None and importlib.util.find_spec("wandb") is None:
            raise UserError(
                f"wandb.project needs the wandb package, which is not installed: {WANDB_INSTALL}."
            )
        if self.project is not None and not self.offline and (missing := wandb_login_missing()):
            raise UserError(
                f"wandb.project needs a wandb login, and {missing}: run `wandb login` once (it keeps the key "
                "in ~/.netrc), or add --wandb.offline (or set WANDB_MODE=offline) to log to the run directory "
                "and `wandb sync` it later."
            )


def wandb_login_missing() -> str | None:
    """Why wandb.init would stop for want of a login (None when it would not), found where wandb looks
    (WANDB_MODE, WANDB_API_KEY, ~/.netrc, its settings files), offline and writing nothing. Asked when the
    config is parsed: found only by wandb.init, the mistake ended the run after its servers started."""
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return None
    # A wandb older than the lock's keeps its login elsewhere: its init says.
    if importlib.util.find_spec("wandb.sdk.lib.wbauth") is None:
        return None
    from wandb.errors import AuthenticationError
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib.wbauth import authenticate

    settings = wandb_setup.singleton().settings  # the environment and wandb's settings files
    if settings._offline or settings._noop:
        return None
    try:
        found = authenticate.authenticate_session(
            host=settings.base_url, source="plainrl", prompt=False, update_session=False
        )
    except AuthenticationError as error:  # a key in the wrong shape: wandb's own words say which
        return f"the key found is not valid ({str(error).rstrip('.')})"
    return None if found else f"none was found for {settings.base_url}"


def start_wandb(cfg: WandbConfig, run_dir: Path, config: dict, resume: bool = False):
    """The wandb run (files under run_dir/wandb), or None when cfg.project is None.

    The run id is kept in run_dir/wandb_id, so a resumed training run continues the same wandb run. Every
    other metric is plotted against STEP_METRIC."""
    if cfg.project is None:
        return None
    import wandb

    id_file = Path(run_dir) / rundir.WANDB_ID
    run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:8]
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id + "\n")
    run = wandb.init(
        project=cfg.project,
        name=cfg.name,
        entity=cfg.entity,
        tags=cfg.tags or None,
        mode="offline" if cfg.offline else None,
        dir=str(run_dir),
        config=config,
        id=run_id,
        resume="allow",
    )
    run.define_metric(STEP_METRIC)
    run.define_metric("*", step_metric=STEP_METRIC)
    return run


def wandb_eval(cfg: WandbConfig, run_dir: Path, config: dict, summary: dict, records: list[dict]) -> None:
    """eval.py's wandb run (when cfg.project is set): the summary's numbers and a table of the results."""
    run = start_wandb(cfg, run_dir, config)
    if run is None:
        return
    import wandb

    flat = {k: v for k, v in summary.items() if isinstance(v, int | float)}
    flat.update({f"pass@{k}": v for k, v in summary.get("pass_at_k", {}).items()})
    run.summary.update(flat)
    columns = [
        "example",
        "rollout",
        "task_id",
        "reward",
        "num_completion_tokens",
        "error",
        "prompt",
        "completion",
    ]
    rows = [
        [r[c] if c not in ("prompt", "completion") else json.dumps(r[c]) for c in columns] for r in records
    ]
    run.log({"results": wandb.Table(columns=columns, data=rows)})
    run.finish()


def say(*lines: str) -> None:
    """Prints each line on rank 0 only: every script's console output goes through here. While a RunLog draws
    its progress bar, rich redirects stdout, so the lines appear above the bar."""
    if dist.world()[0] == 0:
        for line in lines:
            print(line, flush=True)


def fmt(value: float) -> str:
    """0.5, 3.000e-04, 25k: the console's numbers (the thousands as rl.py's step line writes them)."""
    if value >= 1000:
        return thousands(value)
    return f"{value:.3e}" if value and (abs(value) < 1e-3 or abs(value) >= 1e5) else f"{value:.4g}"


def plural(count: int, noun: str) -> str:
    """1 micro-batch, 2 micro-batches."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith(('s', 'ch')) else 's'}"


def wrap(head: str, items: list[str], width: int = 100) -> list[str]:
    """`head` then the items two spaces apart, on lines of at most `width` columns (the next ones indented)."""
    lines = [head]
    for item in items:
        if len(lines[-1]) + 2 + len(item) > width and lines[-1].strip():
            lines.append("   ")
        lines[-1] += f"  {item}" if lines[-1].strip() else item
    return lines


def tensorboard_command() -> str:
    """tensorboard as this python's environment has it (.venv/bin/tensorboard; make users have no PATH to it)."""
    installed = Path(sys.executable).parent / "tensorboard"
    if not installed.is_file():
        return "tensorboard"
    return str(installed.relative_to(Path.cwd())) if installed.is_relative_to(Path.cwd()) else str(installed)


def thousands(value: float) -> str:
    """850, 2.3k, 12k."""
    return f"{value:.0f}" if value < 1000 else f"{value / 1000:.{1 if value < 10_000 else 0}f}k"


def shorten(text: str, width: int) -> str:
    """`text` on one line, cut to `width` characters."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def rl_line(values: dict[str, float], previous: dict[str, float] | None) -> str:
    """rl.py's console line: the reward and its change since the previous step (a mixture's per environment;
    distilling, the reverse KL to the teacher), the step's seconds and what it waited for (the teacher, an
    evaluation among them), and tokens per second sampled and trained. Every other metric: tensorboard."""
    reward = values["reward/mean"]
    line = f"reward {reward:.3f}" + (f" ({reward - previous['reward/mean']:+.3f})" if previous else "")
    names = [name.split("/")[1] for name in values if name.startswith("env/") and name.endswith("/groups")]
    if len(names) > 1:
        # None: the environment had no group this step.
        rewards = [(name, values.get(f"env/{name}/reward/mean")) for name in names]
        line += " [" + ", ".join(f"{name} {'-' if r is None else f'{r:.3f}'}" for name, r in rewards) + "]"
    # Within 100 columns with "step 1000/1000  " before it: seconds waited for rollouts, the weight sync, an eval.
    waits = f"rollouts {values['time/wait_rollouts']:.1f}"
    if "time/wait_teacher" in values:  # of which the teacher was scoring, and the reverse KL it measured
        waits += f" (teacher {values['time/wait_teacher']:.1f})"
        line += f" kl {values.get('distill/reverse_kl', 0.0):.3f}"
    waits += f", sync {values['time/wait_sync']:.1f}"
    evaluated = [v for name, v in values.items() if name.startswith("eval/") and name.endswith("seconds")]
    if evaluated:
        waits += f", eval {sum(evaluated):.1f}"
    sampled, trained = values["perf/rollout_tokens_per_second"], values["perf/tokens_per_second"]
    return f"{line}  {values['time/step']:.1f} s: {waits}  {thousands(sampled)}/{thousands(trained)} tok/s sampled/trained"


class RunLog:
    """Rank 0 writes tensorboard events to run_dir/tb, a line per step to run_dir/metrics.jsonl and draws the
    bar; other ranks do nothing.

    Events and lines past `start_step` from an earlier, interrupted run are discarded so a resumed run's
    curves do not overlap. Console lines (`line`'s, by default every value) are printed for the first step and
    every `print_every` steps; the bar is drawn only on a terminal, so a log file gets the lines alone.
    """

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        enabled: bool,
        print_every: int,
        wandb: WandbConfig | None = None,
        config: dict | None = None,
        line: Callable[[dict[str, float], dict[str, float] | None], str] | None = None,
    ):
        self.enabled, self.print_every, self.run_dir = enabled, print_every, Path(run_dir)
        if not enabled:
            return
        self.total_steps, self.start_step, self.line, self.previous = total_steps, start_step, line, None
        self.began = time.perf_counter()
        self.metrics_path = self.run_dir / rundir.METRICS
        kept = []
        if self.metrics_path.exists():  # a resumed run's: the steps past its checkpoint go
            complete = self.metrics_path.read_text().split("\n")[:-1]  # a line cut by a kill has no newline
            kept = [line for line in complete if json.loads(line)["step"] <= start_step]
        write_atomically(self.metrics_path, "".join(line + "\n" for line in kept))
        self.metrics_file = open(self.metrics_path, "ab")
        # The last line, which values logged later at the same step join (an evaluation, then its step's).
        self.last_record = json.loads(kept[-1]) if kept else None
        self.last_offset = self.metrics_file.tell() - len(kept[-1]) - 1 if kept else 0
        self.wandb_settings = (wandb or WandbConfig(), run_dir, config or {})
        self.wandb = start_wandb(*self.wandb_settings, resume=start_step > 0)
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            str(Path(run_dir) / rundir.TENSORBOARD), purge_step=start_step + 1 if start_step else None
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

    def _record(self, step: int, values: dict[str, float]) -> None:
        """Every scalar to tensorboard and metrics.jsonl, and to wandb when asked."""
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log({**values, STEP_METRIC: step})
        record = {"step": step, **values}
        if self.last_record is not None and self.last_record["step"] == step:
            record = {**self.last_record, **values}
            self.metrics_file.truncate(self.last_offset)
        else:
            self.last_offset = self.metrics_file.tell()
        self.metrics_file.write((json.dumps(record) + "\n").encode())
        self.metrics_file.flush()  # `tail -f` and a killed run see every step
        self.last_record = record

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Logs `values` at `step` (1-based: the number of optimizer steps done) and advances the bar."""
        if not self.enabled:
            return
        self._record(step, values)
        if self.line is not None:  # with the step's evaluation, which came first (its seconds are the step's)
            summary = self.line(self.last_record, self.previous)
        else:  # the last part of a name, but an environment's metrics keep its id (env/<id>/groups: <id>/groups)
            names = [n.removeprefix("env/") if n.startswith("env/") else n.split("/")[-1] for n in values]
            summary = "  ".join(f"{name} {fmt(value)}" for name, value in zip(names, values.values()))
        self.previous = values
        self.progress.update(self.task, completed=step, metrics=summary)
        # The first step always: with a large print_every a slow start would show nothing for minutes.
        if step % self.print_every == 0 or step == self.start_step + 1:
            say(*wrap(f"step {step}/{self.total_steps}", summary.split("  ")))

    def evaluation(self, step: int, values: dict[str, float]) -> None:
        """Logs an evaluation's eval/* scalars at `step` (0 = before training) with one console line."""
        if not self.enabled:
            return
        self._record(step, values)
        say(*wrap(f"eval at step {step}", [f"{k.removeprefix('eval/')} {fmt(v)}" for k, v in values.items()]))

    def flush(self) -> None:
        """Puts every event so far on disk (call it with each checkpoint: a killed run keeps its curves)."""
        if self.enabled:
            self.writer.flush()
        if self.enabled and self.wandb is not None:
            # wandb writes its log in 32 KiB blocks and loses the last, partial one when the process is
            # killed; only finishing the run writes it. The same run goes on (about half a second).
            self.wandb.finish()
            self.wandb = start_wandb(*self.wandb_settings, resume=True)

    def text(self, step: int, tag: str, text: str) -> None:
        if self.enabled:
            self.writer.add_text(tag, text, step)
            if self.wandb is not None:
                import wandb

                self.wandb.log({tag: wandb.Html(f"<pre>{html.escape(text)}</pre>"), STEP_METRIC: step})

    def sample(self, step: int, messages: list[dict], reward: float) -> None:
        """An episode and its reward: every turn as tensorboard text; on the console its last turn (a multi-turn
        episode's says which), the user's message and the reply, both shortened."""
        if self.enabled:
            episode = "\n".join(f"[{m['role']}] {m['content'] or ''}" for m in messages)
            self.text(step, "samples", f"reward {reward:.3f}\n\n```\n{episode}\n```")
            replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            last = replies[-1] if replies else len(messages)
            asked = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
            reply = messages[last]["content"] if replies else ""
            turn = f" (turn {len(replies)} of {len(replies)})" if len(replies) > 1 else ""
            say(
                f"sample at step {step}, reward {reward:.3f}{turn}",
                f"  user: {shorten(asked or '', 120)}",
                f"  completion: {shorten(reply or '', 400)}",
            )

    def summary(self, history: list[dict], key: str, weights: Path, curve: Path, points=None) -> None:
        """The run's last lines: `key`'s mean over the first and the last tenth of the steps, each evaluation
        series of `points` (as plot_curve takes them) at its first and last, the minutes, and where the
        outputs are; the run directory last."""
        if self.enabled and history:
            minutes = (time.perf_counter() - self.began) / 60
            speed = sum(m["perf/tokens_per_second"] for m in history) / len(history)
            # A step's value is one noisy draw (a flat run's first and last rewards read 0.289 -> 0.198): means
            # of a tenth of the steps each, at least one.
            tenth, first, last = (
                max(1, len(history) // 10),
                self.start_step + 1,
                self.start_step + len(history),
            )
            means = [sum(m[key] for m in steps) / tenth for steps in (history[:tenth], history[-tenth:])]
            spans = (
                f"means of steps {first}-{first + tenth - 1} and {last - tenth + 1}-{last}"
                if tenth > 1
                else f"steps {first} and {last}"
            )
            say(
                f"done: steps {first}-{last} in {minutes:.1f} min, {thousands(speed)} tokens/s trained on average",
                f"{key} {means[0]:.3f} -> {means[1]:.3f} ({spans})",
            )
            for name, series in (points or {}).items():
                if series:
                    steps = f"{len(series)} evaluations, steps {series[0][0]}-{series[-1][0]}"
                    say(f"{name} {series[0][1]:.3f} -> {series[-1][1]:.3f} ({steps})")
            say(
                f"weights:     {weights}",
                f"curve:       {curve}",
                f"metrics:     {self.metrics_path}   (a line per step: docs/metrics.md)",
                f"tensorboard: {tensorboard_command()} --logdir {self.run_dir / 'tb'}",
            )
        say(f"run dir: {self.run_dir}")

    def close(self) -> None:
        if self.enabled:
            self.progress.stop()
            self.writer.close()
            self.metrics_file.close()
            if self.wandb is not None:
                self.wandb.finish()
