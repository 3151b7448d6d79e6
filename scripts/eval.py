"""Evaluates a model on an environment through any OpenAI-compatible endpoint.

Runs `-n` examples x `-r` rollouts, prints average reward (with its standard deviation), perfect
rate (reward == 1), pass@k (an example passes when one of k rollouts is perfect; unbiased estimator
over the -r rollouts), average completion tokens, errors and a few samples, and writes
outputs/eval/<name>/results.jsonl (one line per rollout, written as each example's group finishes, so
an interrupted eval keeps them) and summary.json. Without `-b`, starts the
builtin server (scripts/serve.py) on the model and stops it afterwards. An episode that fails (server
error, harness failure, an exception in a reward) is counted as an error with its cause, scores 0 in
the averages, and never stops the run; summary.json says how many failed (`error_rate`, `status`).
When every episode fails, or a -b endpoint does not answer at all, the run ends with one sentence and
exit code 2 (summary.json, when written, has `"status": "failed"` and `"avg_reward": null`); so does a
server that dies or freezes mid-run (its /health is checked every 5 s, as in rl.py's evaluations). A -b
server answers to the name it was started with, whatever it loaded since: with -m a local directory, the
weights it computes with are compared with -m's first (their fingerprints, lib/inference/weights/reload.py check_serves),
and a difference stops the run in one sentence before any episode (--reload-weights loads -m into the
server instead); summary.json's `served_weights` says what was compared, or why it could not be (a
hosted API, a hub id). Requests name the server's own name (GET /v1/models) when -m is a local directory
spelled otherwise; when -m is no local directory and a builtin or vLLM server does not list it, the run
stops in one sentence. A run that stops before its first episode leaves no run directory behind.
An example's rollouts at temperature 0 (or top_k 1) are identical: with -r > 1 a warning says so first
(configs/tiny/eval.toml is greedy; `--sampling.temperature 1.0` samples).

Usage:
    python scripts/eval.py reverse_text -m outputs/models/tiny -n 20 -r 3               # CPU, own server
    python scripts/eval.py reverse_text -m Qwen/Qwen3-0.6B -b http://localhost:8000/v1 -n 100 -r 4
    python scripts/eval.py alphabet_sort -m M -b URL --env-args '{"min_turns": 3, "max_turns": 3}'
"""

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)

# isort: split
import tyro

from lib.config import UserError, fail, given_api_key, parse, run_main, write_config
from lib.endpoint import check_base_url, check_reachable, request_name
from lib.log import WandbConfig
from lib.models.load import ModelConfig
from lib.orchestrator.envs import json_object
from lib.orchestrator.evaluation import pass_at_k, run_all, summarize  # noqa: F401 (pass_at_k: eval.pass_at_k for users)
from lib.sampling import SamplingConfig


@dataclasses.dataclass
class Config:
    env: tyro.conf.Positional[str] = "reverse_text"
    """Environment id: reverse_text, alphabet_sort, or any installed verifiers taskset."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model name sent to the endpoint (-m), and the directory served when no -b is given."""
    base_url: Annotated[str | None, tyro.conf.arg(aliases=("-b",))] = None
    """OpenAI-compatible base URL such as http://localhost:8000/v1; None starts a builtin server."""
    api_key: str | None = None
    """API key for the endpoint (default: $PLAINRL_API_KEY, else, for a -b endpoint, $OPENAI_API_KEY)."""
    reload_weights: bool = False
    """With -b and -m a local weights directory: when the server computes with other weights, load -m into
    it first (as rl.py reloads; the builtin engine needs -m under its --weights-root). Its other clients
    get -m's weights too."""
    engine: Literal["auto", "torch", "vllm"] = "auto"
    """Engine of the server started when no -b is given."""
    num_examples: Annotated[int, tyro.conf.arg(aliases=("-n",))] = 20
    """Examples to evaluate (-1 = all; an endless taskset needs a number)."""
    rollouts_per_example: Annotated[int, tyro.conf.arg(aliases=("-r",))] = 3
    """Rollouts per example; pass@k uses k = this."""
    env_args: str = "{}"
    """JSON object of environment arguments, e.g. '{"min_turns": 3}'."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """Sampling settings (--max-tokens is short for --sampling.max-tokens)."""
    max_concurrent: int = 32
    """Most episodes in flight at once."""
    name: str | None = None
    """Run name under output_dir (default: <env>-<model>-<time>)."""
    output_dir: Path = Path("outputs/eval")
    """Where results.jsonl and summary.json go."""
    num_samples_shown: int = 3
    """Sample completions printed at the end."""
    seed: int = 0
    """Seed of the example order and synthetic data."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases: the summary and a results table (off unless wandb.project is set)."""

    def __post_init__(self):
        if self.num_examples == 0 or self.num_examples < -1:
            raise UserError("num_examples must be -1 (all) or positive.")
        if self.rollouts_per_example < 1:
            raise UserError("rollouts_per_example must be at least 1.")
        if self.max_concurrent < 1:
            raise UserError("max_concurrent must be at least 1.")
        if self.base_url is not None:
            check_base_url(self.base_url, "base_url")
        elif self.reload_weights:
            raise UserError("reload_weights is for a -b server: a server eval.py starts serves -m already.")
        json_object(self.env_args, "env_args")


def main(cfg: Config) -> dict:
    # ---------------------------------------------------------------- config
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from rich.text import Text

    from lib import runlock
    from lib.config import to_dict
    from lib.endpoint import PauseWatch, is_healthy, key_in_environment, unless_paused
    from lib.inference.launch import running_server
    from lib.inference.weights.reload import check_serves, reload_weights
    from lib.log import wandb_eval
    from lib.models.load import check_model_name
    from lib.orchestrator.envs import EnvConfig, episode_reward, load_env, load_tasks, model_context
    from lib.orchestrator.evaluation import while_healthy
    from lib.orchestrator.tasks import check_env_ids
    from lib.provenance import write_provenance

    console = Console()
    api_key = given_api_key(cfg.api_key)
    if cfg.base_url is not None:  # a user's OpenAI key is for their endpoint, never for a server started here
        api_key = api_key or os.environ.get("OPENAI_API_KEY")

    greedy = cfg.sampling.temperature == 0 or cfg.sampling.top_k == 1
    if greedy and cfg.rollouts_per_example > 1:  # a greedy preset (configs/tiny/eval.toml) given -r
        group = cfg.rollouts_per_example
        print(
            f"WARNING: {group} rollouts an example at temperature 0 (or top_k 1) are identical, and "
            f"pass@{group} is pass@1: pass --sampling.temperature 1.0 to sample them, or -r 1",
            file=sys.stderr,
            flush=True,
        )

    # ---------------------------------------------------------------- environment
    env = EnvConfig(id=cfg.env, args=cfg.env_args, num_examples=cfg.num_examples, seed=cfg.seed)
    try:
        if cfg.base_url is None:
            check_model_name(cfg.model.name)
        check_env_ids(env)
        vf_env = load_env(env)
    except UserError as error:
        fail(str(error))
    if cfg.num_examples < 0 and not vf_env.taskset.bounded:
        fail(f"environment {cfg.env} is endless: give the number of examples to evaluate with -n.")
    tasks = list(load_tasks(vf_env, env).taskset)  # bounded: finite, or cut to -n
    if not tasks:
        fail(f"environment {cfg.env} gave no tasks.")
    if cfg.base_url is not None:
        check_reachable(cfg.base_url, api_key)  # else every episode would fail on it, one by one
        # Requests name the server's own name: it answers to -m only as spelled when it was started.
        requested = request_name(cfg.base_url, cfg.model.name, api_key)
        # A server answers to the name it was started with, whatever it loaded since (an attached rl.py
        # run loads its own weights): what it computes with must be -m, or no score is -m's.
        try:
            served = check_serves(cfg.base_url, Path(cfg.model.name), api_key)
        except UserError:
            if not cfg.reload_weights:
                raise
            directory = Path(cfg.model.name)
            reload_weights([cfg.base_url], directory, api_key, label=directory.resolve().name)
            served = f"{check_serves(cfg.base_url, directory, api_key)} (loaded by --reload-weights)"
    # The run directory only once the input is known good: a refused run leaves nothing behind.
    name = (
        cfg.name
        or f"{Path(cfg.env).name.removesuffix('.py')}-{Path(cfg.model.name).name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    run_dir = cfg.output_dir / name
    made = [path for path in (run_dir, *run_dir.parents) if not path.exists()]  # what a failed start removes
    runlock.hold(run_dir)  # made here, and one evaluation in it at a time
    print(f"run dir: {run_dir}", flush=True)
    write_config(cfg, run_dir / "config.toml")

    # ---------------------------------------------------------------- server
    with contextlib.ExitStack() as stack:
        base_url, command = cfg.base_url, None  # an attached server's command line is not known here
        if base_url is None:
            what = {"torch": "the builtin server", "vllm": "a vLLM server", "auto": "a server (engine auto)"}
            log = run_dir / "server.log"
            # print, not rich: its console breaks lines at 80 columns, mid-path, when the output is no terminal
            print(f"starting {what[cfg.engine]} for {cfg.model.name} (log: {log})", flush=True)
            serving = running_server(cfg.model.name, engine=cfg.engine, api_key=api_key, log_path=log)
            try:
                server = stack.enter_context(serving)
                base_url, command = server.url, server.process.args
                served = check_serves(base_url, Path(cfg.model.name), api_key)
            except BaseException as error:  # Ctrl-C too: no episode ran, so the run leaves nothing behind
                if made:
                    shutil.rmtree(made[-1], ignore_errors=True)
                if isinstance(error, RuntimeError):
                    fail(str(error).replace(f"end of {log}:", "end of its log:"))
                raise
            requested = cfg.model.name  # the name it was started with
        print(f"served weights: {served}", flush=True)
        stack.enter_context(key_in_environment(api_key))
        ctx = model_context(base_url, requested, cfg.sampling)
        write_provenance(run_dir, [{"url": base_url, "command": command, "weights": served}], api_key)

        # ------------------------------------------------------------ rollouts
        total = len(tasks) * cfg.rollouts_per_example
        columns = [TextColumn("[bold]eval"), MofNCompleteColumn(), BarColumn(), TimeElapsedColumn()]
        columns.append(TextColumn("{task.fields[reward]}"))
        start = time.perf_counter()
        results = run_dir / "results.jsonl"
        with Progress(*columns, console=console, transient=False) as progress, open(results, "w") as out:
            bar = progress.add_task("eval", total=total, reward="")
            rewards = []

            def advance(episode):
                rewards.append(episode_reward(episode))
                progress.update(bar, advance=1, reward=f"avg reward {statistics.fmean(rewards):.3f}")

            try:
                rollouts = run_all(
                    vf_env, tasks, ctx, cfg.rollouts_per_example, cfg.max_concurrent, advance, out
                )
                # The client has no read timeout: a server that freezes, dies or is left paused would hold
                # every request forever. Its /health is watched as in rl.py's evaluations (one sentence ends
                # the run); an endpoint without /health (a hosted API) only for a pause.
                if is_healthy(base_url, api_key):
                    rollouts = while_healthy(rollouts, base_url, api_key)
                else:
                    rollouts = unless_paused(rollouts, PauseWatch([base_url], api_key))
                records = asyncio.run(rollouts)
            except KeyboardInterrupt:
                done = len(results.read_text().splitlines())
                console.print(f"{done} of {total} rollouts (the groups that finished) are in {results}")
                raise
        seconds = time.perf_counter() - start

    # ---------------------------------------------------------------- results
    results.write_text("".join(json.dumps(line) + "\n" for line in records))
    summary = {"env": cfg.env, "model": cfg.model.name, **summarize(records, cfg.rollouts_per_example)}
    summary["seconds"], summary["served_weights"] = seconds, served
    # No episode was scored: a 0.0 would read as a model that scores nothing.
    if summary["status"] == "failed":
        summary.update(avg_reward=None, std_reward=None, perfect_rate=None, pass_at_k={})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    wandb_eval(cfg.wandb, run_dir, to_dict(cfg), summary, records)

    # ---------------------------------------------------------------- summary
    for line in records[: cfg.num_samples_shown]:
        users = [m["content"] for m in line["messages"] if m["role"] == "user"]
        replies = [m["content"] for m in line["messages"] if m["role"] == "assistant"]
        prompt, completion = (users[-1] if users else ""), (replies[-1] if replies else "")
        console.rule(f"example {line['example']} rollout {line['rollout']}  reward {line['reward']:.3f}")
        console.print(Text(str(prompt)[-300:], style="dim"))
        console.print(Text(str(completion)[:600] or "(no completion)"))
    table = Table(title=f"{cfg.env} · {cfg.model.name}", show_header=False)
    table.add_row(
        "rollouts", f"{summary['num_examples']} examples x {cfg.rollouts_per_example} in {seconds:.1f} s"
    )
    if summary["avg_reward"] is None:
        table.add_row("avg reward", Text("none: no episode was scored", style="bold red"))
    else:
        table.add_row("avg reward", f"{summary['avg_reward']:.4f} ± {summary['std_reward']:.4f}")
        table.add_row("perfect rate", f"{summary['perfect_rate']:.4f}")
    for k, value in summary["pass_at_k"].items():
        table.add_row(f"pass@{k}", f"{value:.4f}")
    table.add_row("avg completion tokens", f"{summary['avg_completion_tokens']:.1f}")
    errors = f"{summary['num_errors']} of {summary['num_rollouts']} ({summary['error_rate']:.1%})"
    table.add_row("errors", Text(errors, style="bold red") if summary["num_errors"] else "0")
    console.print(table)
    if summary["status"] == "partial":
        console.print(Text("failed episodes count as reward 0 in the averages above; causes:", style="red"))
    for cause, count in list(summary["errors"].items())[:5]:
        console.print(Text(f"{count} x ", style="red") + Text(cause))
    if any("sampling distribution replay requires" in cause for cause in summary["errors"]):
        console.print(
            "The server returns kept sets (--return-sampling-mask), so it refuses requests at temperature 0 or "
            "without top_k: pass --sampling.top-k K and a temperature > 0 (greedy: top_k 1 at temperature 1)."
        )
    print(f"run dir: {run_dir}", flush=True)
    if summary["status"] == "failed":
        cause = next(iter(summary["errors"])).splitlines()[0][:200]
        raise UserError(f"every one of the {summary['num_rollouts']} episodes failed (first cause: {cause})")
    return summary


if __name__ == "__main__":
    run_main(main, parse(Config, description=__doc__))
