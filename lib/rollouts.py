"""Rollouts and their buffer: finished groups in, advantages out, stale and flat groups dropped."""

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Callable


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
    advantage: float = 0.0
    """Set by the buffer: the episode's reward minus the group's mean episode reward (divided by the
    group std when normalised)."""
    episode: int | None = None
    """Which episode of its group it comes from (None: an episode of its own): the branches of one episode (a chat template that
    rewrites history forks it) share its reward and its advantage, and count once in the group mean."""


def group_advantages(rewards: list[float], normalize: bool = False, eps: float = 1e-6) -> list[float]:
    """reward - mean(group reward), optionally divided by (std + eps).

    The group mean is GRPO's baseline (Shao et al. 2024, arXiv:2402.03300). The std is the sample
    std (n - 1), as GRPO implementations compute it; leaving it out (the default) follows Dr. GRPO
    (Liu et al. 2025, arXiv:2503.20783), which finds the division biases toward easy and hard prompts.
    """
    mean = sum(rewards) / len(rewards)
    adv = [reward - mean for reward in rewards]
    if normalize and len(rewards) > 1:
        std = statistics.stdev(rewards)
        adv = [a / (std + eps) for a in adv]
    return adv


def is_flat(rewards: list[float], tolerance: float = 1e-9) -> bool:
    """A group whose rewards are all equal has zero advantage everywhere: no learning signal."""
    return max(rewards) - min(rewards) <= tolerance


@dataclasses.dataclass
class StepBatch:
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
    rollouts was longer than seq_len; set by the producer: those dropped since the previous step."""
    num_resampled: int = 0
    """Flat groups the producer replaced by new ones since the previous step (filter_flat_groups)."""

    def metrics(self, env_id: str) -> dict[str, float]:
        """The step's reward and rollout scalars, as logged; reward/<env> per environment of its rollouts
        (`env_id` names those without one)."""
        rewards = [r.reward for group in self.groups for r in group]
        mean = sum(rewards) / len(rewards)
        by_env: dict[str, list[float]] = {}
        for r in (r for group in self.groups for r in group):
            by_env.setdefault(r.env or env_id, []).append(r.reward)
        return {
            "reward/mean": mean,
            "reward/std": (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5,
            **{f"reward/{env}": sum(values) / len(values) for env, values in sorted(by_env.items())},
            "rollouts/flat_groups": self.num_flat_groups,
            "rollouts/stale_dropped": self.num_stale_rollouts,
            "rollouts/too_long": self.num_too_long,
            "rollouts/resampled": self.num_resampled,
            "rollouts/staleness_mean": self.staleness_mean,
            "rollouts/staleness_max": self.staleness_max,
        }


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
        normalize_advantage: bool = False,
        on_stale: Callable[[], None] | None = None,
    ):
        assert examples_per_step > 0 and max_async_level >= 0, "bad buffer settings"
        self.examples_per_step = examples_per_step
        self.max_async_level = max_async_level
        self.normalize_advantage = normalize_advantage
        # Called once per group dropped as stale, so the producer can sample a replacement.
        self.on_stale = on_stale
        self.queue: asyncio.Queue[list[Rollout]] = asyncio.Queue()

    def put(self, group: list[Rollout]) -> None:
        """Adds one finished, scored group (all rollouts of one example)."""
        assert group, "a group needs at least one rollout"
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

        rollouts, num_flat = [], 0
        for index, group in enumerate(groups):
            # One reward per episode, however many branches it has: the mean is over episodes.
            episodes = [(i,) if r.episode is None else r.episode for i, r in enumerate(group)]
            rewards = {episode: r.reward for episode, r in zip(episodes, group)}
            if is_flat(list(rewards.values())):
                num_flat += 1
                continue
            advantages = group_advantages(list(rewards.values()), self.normalize_advantage)
            by_episode = dict(zip(rewards, advantages))
            groups[index] = [dataclasses.replace(r, advantage=by_episode[e]) for r, e in zip(group, episodes)]
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
