"""Rollouts: the record each episode gives, group advantages, and the buffer each step's groups come from."""

import asyncio
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from lib.config import UserError

if TYPE_CHECKING:
    import numpy as np


@dataclasses.dataclass
class Rollout:
    """One training sequence of an episode, exactly as the model saw it, from the episode to the loss."""

    token_ids: list[int]
    """Every token of the episode exactly as the model saw it: prompt, completions and env turns."""
    loss_mask: list[bool]
    """True on tokens the policy sampled (assistant turns); prompt and env tokens carry no loss."""
    inference_logp: list[float]
    """Logprob of each token under the server that sampled it (any placeholder, e.g. 0, off the mask)."""
    reward: float
    """Scalar reward of the whole episode."""
    policy_version: int
    """Optimizer steps behind the weights that served the episode's first request (0 = the initial weights)."""
    env: str = ""
    """Environment name, for per-environment reward metrics."""
    completion: str = ""
    """The assistant turns as text, for logs and rollout records."""
    task_id: str = ""
    """Id of the task (example) the episode played, for rollout records."""
    prompt: str = ""
    """The prompt as text (roles tagged), for rollout records."""
    messages: list[dict] = dataclasses.field(default_factory=list, compare=False, repr=False)
    """The whole episode, every turn's messages (role, content, tool calls), whichever branch this is: for
    rollout records and the console's sample; the episode's branches share it."""
    advantage: float = 0.0
    """Set by the buffer: the episode's reward minus the group's mean episode reward (divided by the
    group std when normalised)."""
    episode: int | None = None
    """Which episode of its group it comes from (None: an episode of its own): the branches of one episode (a chat template that
    rewrites history forks it) share its reward and its advantage, and count once in the group mean."""
    finish_reasons: list[str] = dataclasses.field(default_factory=list)
    """Why each model turn of its episode ended, in order: stop, length (max_tokens, or what seq_len left), ..."""
    truncated: bool = False
    """Its episode was cut by a token limit: any turn ended by length, not only the last (verifiers'
    Trace.is_truncated looks at the last), or a verifiers token limit stopped it. loss.mask_truncated reads it."""
    step_episode: int | None = None
    """Set by the buffer: its episode's number among the episodes trained on in the step (branches share it)."""
    kept_ids: "np.ndarray | None" = dataclasses.field(default=None, compare=False, repr=False)
    """Served kept sets (the server's `sampling_mask`, verifiers' SamplingMask): the ids top-k/top-p left when
    each sampled token was drawn, one token after the other (int32, 4 bytes an id); None when the server sent
    none (the trainer recomputes them, or samples without top-k/top-p)."""
    kept_counts: "np.ndarray | None" = dataclasses.field(default=None, compare=False, repr=False)
    """How many of kept_ids each token owns, aligned with token_ids (int32, 4 bytes a token): > 0 exactly on
    the loss mask."""
    teacher_logp: list[float] | None = dataclasses.field(default=None, compare=False, repr=False)
    """On-policy distillation (--teacher.*): the teacher's logprob of each token given the ones before it, aligned
    with token_ids (0 at the first), scored by lib/orchestrator/teacher.py; None without a teacher."""


@dataclasses.dataclass
class AdvantageConfig:
    baseline: Literal["group_mean", "rloo"] = "group_mean"
    """What an episode's reward is compared with, among its group's episodes (branches count once).
    group_mean: the group's mean reward (GRPO, arXiv:2402.03300);
    rloo: the mean of the group's other episodes, n / (n - 1) times the former's advantage (arXiv:2402.14740)."""
    normalize: Literal["none", "group", "step"] = "none"
    """Divide advantages by their std. none: not at all (Dr. GRPO, arXiv:2503.20783);
    group: the std over the group's episodes (GRPO);
    step: the std over every episode trained on in the step (REINFORCE++, arXiv:2501.03262)."""


def group_advantages(
    rewards: list[float], normalize: bool = False, eps: float = 1e-6, baseline: str = "group_mean"
) -> list[float]:
    """reward - baseline, one reward per episode of the group, optionally divided by (std + eps).

    The std is the advantages' sample std (n - 1), as GRPO implementations compute it; leaving it out (the
    default) follows Dr. GRPO (Liu et al. 2025, arXiv:2503.20783), which finds the division biases toward
    easy and hard prompts.
    """
    total = sum(rewards)
    if baseline == "group_mean":
        # The group's mean reward: GRPO's baseline (Shao et al. 2024, arXiv:2402.03300).
        adv = [reward - total / len(rewards) for reward in rewards]
    elif baseline == "rloo":
        # Leave one out: the mean of the other episodes' rewards, so an episode's own reward never enters its
        # baseline (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).
        assert len(rewards) > 1, "a leave-one-out baseline needs two episodes"
        adv = [reward - (total - reward) / (len(rewards) - 1) for reward in rewards]
    else:
        raise ValueError(f"unknown advantage baseline {baseline!r} (choose group_mean or rloo).")
    if normalize and len(rewards) > 1:
        std = statistics.stdev(adv)
        adv = [a / (std + eps) for a in adv]
    return adv


def check_rewards(group: list[Rollout]) -> None:
    """A one-sentence UserError for a reward that is not a finite number, from any taskset: a NaN or an infinity
    makes the group's advantages, then after one step every weight, NaN."""
    for r in group:
        if not math.isfinite(r.reward):
            raise UserError(
                f"environment {r.env or '(unnamed)'} gave the reward {r.reward} (task {r.task_id}): a reward must be "
                "a finite number, and the run stops before any step trains on it."
            )


def is_flat(rewards: list[float], tolerance: float = 1e-9) -> bool:
    """A group whose rewards are all equal has zero advantage everywhere: no learning signal."""
    return max(rewards) - min(rewards) <= tolerance


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's rollouts and what happened to the groups on their way; the producer builds it once, in its
    own thread, so every count belongs to exactly one step."""

    groups: list[list[Rollout]]
    """Every fresh group taken for the step, flat ones included (the reward metrics need them all);
    rollouts of non-flat groups carry their advantages."""
    rollouts: list[Rollout]
    """What to train on: the rollouts of the non-flat groups, with their advantages set."""
    num_flat_groups: int
    """Groups taken but dropped because every reward in them was equal."""
    num_stale_rollouts: int
    """Rollouts dropped (whole groups) because their policy was older than step - max_async_level."""
    staleness_mean: float
    """Mean of step - policy_version over the rollouts taken."""
    staleness_max: int
    """Largest step - policy_version among the rollouts taken."""
    wait_seconds: float
    """How long take() waited for the producer."""
    num_too_long: int = 0
    """Rollouts dropped (whole groups, before their advantages, flat or not) because one of the group's
    rollouts was longer than seq_len, since the previous step."""
    replaced_groups: list[list[Rollout]] = dataclasses.field(default_factory=list)
    """Flat groups the producer replaced by new ones since the previous step (filter_flat_groups): sampled
    for this step, so they count in the reward metrics, but never trained on."""
    errors_by_env: dict[str, int] = dataclasses.field(default_factory=dict)
    """Rollout errors since the previous step, by environment."""
    teacher_seconds: float | None = None
    """Seconds the teacher was scoring (a request in flight) since the previous step, beside sampling and
    training (lib/orchestrator/teacher.py); None without a teacher."""
    teacher_wait_seconds: float | None = None
    """Of wait_seconds, those the teacher was scoring: at most what the step waited for it."""

    @property
    def num_resampled(self) -> int:
        return len(self.replaced_groups)

    @property
    def sampled_tokens(self) -> int:
        """Completion tokens the engines sampled for the step, replaced flat groups included."""
        return sum(sum(r.loss_mask) for group in self.groups + self.replaced_groups for r in group)

    def metrics(self, env_id: str, env_names: tuple[str, ...] = ()) -> dict[str, float]:
        """The step's reward and rollout scalars, as logged. Rewards cover every group sampled for the step:
        the groups taken and the flat ones the filter replaced (stale and too-long groups are counted, not
        averaged). reward/<env> per environment of its rollouts (`env_id` names those without one), and
        env/<name>/... for each of a mixture's `env_names`."""
        sampled = self.groups + self.replaced_groups
        rewards = [r.reward for group in sampled for r in group]
        mean = sum(rewards) / len(rewards)
        by_env: dict[str, list[float]] = {}
        for r in (r for group in sampled for r in group):
            by_env.setdefault(r.env or env_id, []).append(r.reward)
        metrics = {
            "reward/mean": mean,
            "reward/std": (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5,
            **{f"reward/{env}": sum(values) / len(values) for env, values in sorted(by_env.items())},
            "rollouts/flat_groups": self.num_flat_groups,
            "rollouts/stale_dropped": self.num_stale_rollouts,
            "rollouts/too_long": self.num_too_long,
            "rollouts/truncated": sum(r.truncated for group in sampled for r in group),
            "rollouts/resampled": self.num_resampled,
            "rollouts/staleness_mean": self.staleness_mean,
            "rollouts/staleness_max": self.staleness_max,
            "rollouts/errors": sum(self.errors_by_env.values()),
        }
        if self.teacher_seconds is not None:
            metrics["time/teacher"], metrics["time/wait_teacher"] = (
                self.teacher_seconds,
                self.teacher_wait_seconds,
            )
        for name in env_names:
            mine = [group for group in self.groups if group[0].env == name]
            replaced = [group for group in self.replaced_groups if group[0].env == name]
            rewards = [r.reward for group in mine + replaced for r in group]
            if rewards:
                metrics[f"env/{name}/reward/mean"] = sum(rewards) / len(rewards)
            metrics[f"env/{name}/groups"] = len(mine)
            metrics[f"env/{name}/flat_groups"] = sum(is_flat([r.reward for r in group]) for group in mine)
            metrics[f"env/{name}/resampled"] = len(replaced)
            metrics[f"env/{name}/errors"] = self.errors_by_env.get(name, 0)
            metrics[f"env/{name}/tokens"] = sum(len(r.token_ids) for group in mine for r in group)
        return metrics


class Buffer:
    """Holds finished groups from the background rollout producer until the trainer takes them.

    Asyncio-native: the producer calls put(group) from the event loop, the controller awaits
    take(step). When the producer's loop runs in another thread, call take through
    asyncio.run_coroutine_threadsafe(buffer.take(step), loop).result() (put stays in that loop).
    The producer keeps the lag bounded (it samples no further ahead than max_async_level allows);
    the buffer enforces the bound on what it hands out.
    """

    def __init__(
        self,
        examples_per_step: int,
        max_async_level: int,
        advantage: AdvantageConfig | None = None,
        on_stale: Callable[[], None] | None = None,
        train_flat: bool = False,
    ):
        assert examples_per_step > 0 and max_async_level >= 0, "bad buffer settings"
        # Distillation: a flat group still carries the teacher's per-token signal, so it is trained on
        # (with reward advantages 0); it is still counted as flat.
        self.train_flat = train_flat
        self.examples_per_step = examples_per_step
        self.max_async_level = max_async_level
        self.advantage = advantage or AdvantageConfig()
        # Called once per group dropped as stale, so the producer can sample a replacement.
        self.on_stale = on_stale
        self.queue: asyncio.Queue[list[Rollout]] = asyncio.Queue()

    def put(self, group: list[Rollout]) -> None:
        """Adds one finished, scored group (all rollouts of one example); a reward that is not a finite number
        ends the run (check_rewards)."""
        assert group, "a group needs at least one rollout"
        check_rewards(group)
        self.queue.put_nowait(group)

    def ready(self) -> int:
        """Groups waiting to be taken (stale ones included until take() looks at them)."""
        return self.queue.qsize()

    async def take(self, step: int) -> StepBatch:
        """Waits for examples_per_step fresh groups, scores them and returns the step's batch.

        A group is stale when its oldest rollout was sampled by weights older than
        step - max_async_level; it is dropped whole (a partial group would shift the group mean) and
        does not count toward examples_per_step. Flat groups do count: they were sampled for this
        step and are dropped only from training, so a step where every group is flat trains on
        nothing (the caller warns: no learning signal) instead of waiting forever.
        """
        start = time.perf_counter()
        groups, num_stale = [], 0
        while len(groups) < self.examples_per_step:
            group = await self.queue.get()
            if min(r.policy_version for r in group) < step - self.max_async_level:
                num_stale += len(group)
                if self.on_stale is not None:
                    self.on_stale()
                continue
            groups.append(group)
        wait_seconds = time.perf_counter() - start

        trained, num_flat = [], 0
        for index, group in enumerate(groups):
            # One reward per episode, however many branches it has: the mean is over episodes.
            episodes = [(i,) if r.episode is None else r.episode for i, r in enumerate(group)]
            rewards = {episode: r.reward for episode, r in zip(episodes, group)}
            if is_flat(list(rewards.values())):
                num_flat += 1
                if not self.train_flat:
                    continue
            advantages = group_advantages(
                list(rewards.values()),
                normalize=self.advantage.normalize == "group",
                baseline=self.advantage.baseline,
            )
            trained.append((index, episodes, dict(zip(rewards, advantages))))
        if self.advantage.normalize == "step" and trained:
            # One std over every episode trained on in the step (REINFORCE++'s batch normalisation): a group
            # whose rewards barely differ keeps its small advantages, where a group std would magnify them.
            values = [a for _, _, by_episode in trained for a in by_episode.values()]
            std = statistics.stdev(values) + 1e-6
            trained = [(i, episodes, {e: a / std for e, a in by.items()}) for i, episodes, by in trained]
        rollouts, numbers = [], {}  # numbers: (group, episode) -> the episode's number in the step
        for index, episodes, by_episode in trained:
            groups[index] = [
                dataclasses.replace(
                    r, advantage=by_episode[e], step_episode=numbers.setdefault((index, e), len(numbers))
                )
                for r, e in zip(groups[index], episodes)
            ]
            rollouts += groups[index]
        staleness = [step - r.policy_version for group in groups for r in group]
        return StepBatch(
            groups=groups,
            rollouts=rollouts,
            num_flat_groups=num_flat,
            num_stale_rollouts=num_stale,
            staleness_mean=sum(staleness) / len(staleness),
            staleness_max=max(staleness),
            wait_seconds=wait_seconds,
        )


def write_records(path: Path, groups: list[list[Rollout]]) -> None:
    """One JSON line per rollout of the step: environment, task id, its episode's number in the group, the
    branch's prompt and completion as text, the whole episode's messages (every turn, as eval.py's records
    hold them) and turns, reward, advantage, policy version, why each turn ended, and the rollout's tokens
    (all, and those sampled: its loss tokens)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = "env task_id episode prompt completion messages reward advantage policy_version finish_reasons"
    with path.open("w") as out:
        for group in groups:
            for r in group:
                record = {name: getattr(r, name) for name in fields.split()}
                record["num_turns"] = sum(m["role"] == "assistant" for m in r.messages)
                record["num_tokens"], record["num_sampled_tokens"] = len(r.token_ids), sum(r.loss_mask)
                out.write(json.dumps(record) + "\n")
