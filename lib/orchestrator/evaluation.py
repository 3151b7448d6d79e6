"""Evaluation: rollouts of held-out tasks, their records, pass@k, the summary (eval.py's and rl.py's), and the paired
gain between two evaluations of the same tasks."""

import asyncio
import dataclasses
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

from lib.config import UserError
from lib.endpoint import HEALTH_EVERY_S, PauseWatch, check_servers
from lib.orchestrator.tasks import task_id


@dataclasses.dataclass
class EvalConfig:
    every: int = 0
    """rl.py evaluates every N steps, at the start and at the end (0 = never)."""
    num_examples: int = 32
    """Held-out examples: the taskset's last N, which the run then never trains on."""
    rollouts_per_example: int = 4
    """Sampled rollouts per example (at the run's sampling settings); pass@k uses k = this."""
    greedy: bool = True
    """Also one greedy (temperature 0) rollout per example, logged as eval/reward_greedy."""
    max_concurrent: int = 32
    """Most evaluation episodes in flight at once."""

    def __post_init__(self):
        if self.every < 0:
            raise UserError("eval.every must be >= 0 (0 = no evaluation).")
        if self.num_examples < 1 or self.rollouts_per_example < 1 or self.max_concurrent < 1:
            raise UserError(
                "eval.num_examples, eval.rollouts_per_example and eval.max_concurrent must be >= 1."
            )


def split_held_out(tasks: list, num_held_out: int) -> tuple[list, list]:
    """(training tasks, held-out tasks): the last num_held_out are held out, disjoint by task id (the one
    the producer records: `id`, else `idx` as upstream tasksets set it)."""
    if num_held_out >= len(tasks):
        raise UserError(
            f"eval.num_examples {num_held_out} leaves no training examples of the {len(tasks)} the env has."
        )
    train, held_out = tasks[:-num_held_out], tasks[-num_held_out:]
    shared = {task_id(t.data) for t in train} & {task_id(t.data) for t in held_out}
    if shared:
        raise UserError(
            f"the env's task ids are not unique, so held-out tasks cannot be kept apart: {sorted(shared, key=str)[:3]}."
        )
    return train, held_out


def pass_at_k(num_rollouts: int, num_correct: int, k: int) -> float:
    """Probability that at least one of k rollouts drawn from num_rollouts is correct (Chen et al. 2021)."""
    if num_rollouts - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_rollouts - num_correct, k) / math.comb(num_rollouts, k)


def record(example: int, rollout: int, episode) -> dict:
    """One results.jsonl line: the whole conversation, the reward, its parts, tokens and any error; the user's
    mistake in the environment (lib/orchestrator/envs.py raise_user_error) ends the evaluation instead."""
    from lib.orchestrator.envs import episode_error, episode_reward, raise_user_error

    raise_user_error(episode)

    trace = episode.traces[-1] if episode.traces else None
    messages = [{"role": m.role, "content": m.content} for m in trace.messages] if trace else []
    first_reply = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    return {
        "example": example,
        "rollout": rollout,
        "task_id": task_id(episode.task.data),
        "prompt": messages[:first_reply],
        "completion": messages[first_reply:],
        "messages": messages,
        "reward": episode_reward(episode),
        "rewards": {k: v.score for k, v in trace.rewards.items() if v is not None} if trace else {},
        "metrics": {k: v for k, v in trace.metrics.items() if v is not None} if trace else {},
        "num_prompt_tokens": trace.num_input_tokens if trace else 0,
        "num_completion_tokens": trace.num_output_tokens if trace else 0,
        "num_turns": trace.num_turns if trace else 0,
        "stop_condition": trace.stop_condition if trace else None,
        "error": episode_error(episode),
    }


def summarize(records: list[dict], rollouts_per_example: int) -> dict:
    """The summary of a run's records. A failed episode counts as reward 0 in every average; `status` says
    whether any failed ("ok", "partial", "failed": all of them), `error_rate` what share did."""
    rewards = [r["reward"] for r in records]
    by_example: dict[int, list[dict]] = {}
    for r in records:
        by_example.setdefault(r["example"], []).append(r)
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64) if k <= rollouts_per_example} | {rollouts_per_example})
    correct = [sum(r["reward"] >= 1.0 for r in group) for group in by_example.values()]
    causes: dict[str, int] = {}
    for r in records:
        if r["error"]:
            causes[r["error"][:300]] = causes.get(r["error"][:300], 0) + 1
    num_errors = sum(bool(r["error"]) for r in records)
    return {
        "status": "ok" if num_errors == 0 else "failed" if num_errors == len(records) else "partial",
        "avg_reward": statistics.fmean(rewards),
        "std_reward": statistics.pstdev(rewards),
        "perfect_rate": statistics.fmean(reward >= 1.0 for reward in rewards),
        "pass_at_k": {
            str(k): statistics.fmean(pass_at_k(rollouts_per_example, c, k) for c in correct) for k in ks
        },
        "avg_completion_tokens": statistics.fmean(r["num_completion_tokens"] for r in records),
        "num_examples": len(by_example),
        "num_rollouts": len(records),
        "num_errors": num_errors,
        "error_rate": num_errors / len(records),
        "errors": causes,
    }


async def run_all(
    vf_env,
    tasks: list,
    ctx,
    rollouts_per_example: int,
    max_concurrent: int,
    on_episode: Callable | None = None,
    results=None,
) -> list[dict]:
    """Every rollout of every task in verifiers' serving session, at most max_concurrent in flight.

    `on_episode(episode)` is called as each episode ends (a progress bar); each finished group's
    records go to `results` (an open file) at once, so an interrupted eval keeps what it has done.
    Returns every record, sorted by example and rollout."""
    from lib.orchestrator.envs import run_group, serving

    semaphore = asyncio.Semaphore(max_concurrent)
    records = []

    async def group(example: int, task):
        episodes = await run_group(vf_env, task, ctx, rollouts_per_example, semaphore, on_episode)
        lines = [record(example, rollout, episode) for rollout, episode in enumerate(episodes)]
        if results is not None:
            results.write("".join(json.dumps(line) + "\n" for line in lines))
            results.flush()
        records.extend(lines)

    async with serving(vf_env):
        await asyncio.gather(*(group(example, task) for example, task in enumerate(tasks)))
    return sorted(records, key=lambda line: (line["example"], line["rollout"]))


async def while_healthy(work, base_url: str, api_key: str | None):
    """Awaits the coroutine `work`, checking every HEALTH_EVERY_S that the server answers /health and that no
    other client holds it paused (a paused server answers /health too): the verifiers client has no read
    timeout, so a server that dies, freezes or stays paused would leave `work` waiting forever; one sentence
    ends it instead. rl.py's own reloads never count: it waits for them before it evaluates."""
    running, watch = asyncio.ensure_future(work), PauseWatch([base_url], api_key)
    try:
        while True:
            done, _ = await asyncio.wait({running}, timeout=HEALTH_EVERY_S)
            if done:
                return running.result()
            try:
                await asyncio.to_thread(check_servers, [base_url], api_key)
                await asyncio.to_thread(watch.check)
            except UserError:
                # Its episodes end here, not in asyncio.run's shutdown, which prints a traceback for each
                # episode's interception still open.
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                raise
    finally:
        running.cancel()
        watch.stop.set()  # else asyncio.run waits, after Ctrl-C, for a check still polling in its thread


def paired_gain(before: Path, after: Path) -> tuple[float, float]:
    """The mean reward gain from evaluation `before` to `after` over the tasks both scored (the same held-out
    tasks), and the standard error of that mean: of the per-task differences, so it is the gain's own noise."""

    def per_task(run_dir: Path) -> dict:
        lines = (run_dir / "results.jsonl").read_text().splitlines()
        return {(r["task_id"], r["rollout"]): r["reward"] for r in map(json.loads, lines)}

    old, new = per_task(before), per_task(after)
    differences = [new[key] - old[key] for key in old.keys() & new.keys()]
    if len(differences) < 2:
        return float("nan"), float("nan")
    return statistics.fmean(differences), statistics.stdev(differences) / len(differences) ** 0.5


class Evaluator:
    """rl.py's evaluations of the held-out tasks on whatever weights the server at base_url holds:
    eval.py's client, records and summary; sampled (pass@k over rollouts_per_example) and greedy."""

    def __init__(
        self,
        run_config,
        tasks: list,
        base_url: str,
        model: str,
        api_key: str | None,
        out: Path,
        env=None,
        prefix="eval",
    ):
        """run_config: rl.py's Config (its sampling and eval tables, and its env unless `env` is given, as a
        mixture gives each of its environments); scalars are named `prefix`/reward and so on."""
        from lib.orchestrator.envs import load_env

        # Its own env, so its own serving session (in its own event loop), beside the producer's.
        self.vf_env, self.tasks, self.base_url, self.model = (
            load_env(env or run_config.env),
            tasks,
            base_url,
            model,
        )
        self.prefix = prefix
        from lib.sampling import bounded

        self.sampling = bounded(run_config.sampling)  # top_k bounded, as rl.py's rollouts sample
        self.cfg, self.api_key, self.out = run_config.eval, api_key, out
        self.history: list[tuple[int, dict]] = []
        """(step, eval/* scalars) of every evaluation so far."""

    def __call__(self, step: int) -> dict:
        """Evaluates (writing out/step_N/{sampled,greedy}.jsonl) and returns the eval/* scalars."""
        import time

        from lib.orchestrator.envs import model_context

        began = time.perf_counter()
        out = self.out / f"step_{step}"
        out.mkdir(parents=True, exist_ok=True)
        runs = [("sampled", self.sampling, self.cfg.rollouts_per_example)]
        if self.cfg.greedy:
            greedy = dataclasses.replace(self.sampling, temperature=0.0)
            if self.sampling.top_k > 0:
                # A server returning kept sets (--return-sampling-mask) refuses temperature 0 and requests
                # without top_k: top_k 1 at temperature 1 picks the same most likely token.
                greedy = dataclasses.replace(self.sampling, temperature=1.0, top_k=1, top_p=1.0)
            runs.append(("greedy", greedy, 1))
        metrics = {}
        for name, settings, rollouts in runs:
            ctx = model_context(self.base_url, self.model, settings)
            with open(out / f"{name}.jsonl", "w") as results:
                work = run_all(
                    self.vf_env, self.tasks, ctx, rollouts, self.cfg.max_concurrent, results=results
                )
                records = asyncio.run(while_healthy(work, self.base_url, self.api_key))
            summary = summarize(records, rollouts)
            if name == "greedy":
                metrics["reward_greedy"] = summary["avg_reward"]
                continue
            metrics["reward"] = summary["avg_reward"]
            metrics["reward_std"] = summary["std_reward"]
            metrics["perfect_rate"] = summary["perfect_rate"]
            metrics.update({f"pass@{k}": v for k, v in summary["pass_at_k"].items() if int(k) > 1})
            metrics["completion_tokens"] = summary["avg_completion_tokens"]
            metrics["errors"] = summary["num_errors"]
        metrics["seconds"] = time.perf_counter() - began
        metrics = {f"{self.prefix}/{name}": value for name, value in metrics.items()}
        self.history.append((step, metrics))
        return metrics
