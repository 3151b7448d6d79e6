"""The rollout buffer: finished groups in, advantages out, stale and flat groups dropped, packed micro-batches."""

import asyncio
import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lib import data

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class Rollout:
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

    def metrics(self, env_id: str) -> dict[str, float]:
        """The step's reward and rollout scalars, as logged."""
        rewards = [r.reward for group in self.groups for r in group]
        mean = sum(rewards) / len(rewards)
        return {
            "reward/mean": mean,
            "reward/std": (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5,
            f"reward/{env_id}": mean,
            "rollouts/flat_groups": self.num_flat_groups,
            "rollouts/stale_dropped": self.num_stale_rollouts,
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


@dataclasses.dataclass
class MicroBatch:
    """One forward/backward's worth of packed rows; every tensor is (R, T).

    Several rollouts share a row back to back; position_ids restart at 0 for each, which is how
    transformers tells packed sequences apart: call the model with position_ids, no attention_mask
    and use_cache=False (with a KV cache it skips the check and lets rollouts attend to each other).
    """

    input_ids: "torch.Tensor"
    """Token ids (long); padding after the last rollout of a row."""
    position_ids: "torch.Tensor"
    """Position of each token within its own rollout (long); the padding counts from 0 as one more sequence."""
    loss_mask: "torch.Tensor"
    """True on sampled tokens (bool); False on prompts, env turns and padding."""
    inference_logp: "torch.Tensor"
    """Server logprob of each token (float32); 0 off the loss mask."""
    advantages: "torch.Tensor"
    """The rollout's advantage on each of its tokens (float32); 0 on padding."""

    def to(self, device) -> "MicroBatch":
        return MicroBatch(**{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def pack(
    samples: list[Rollout],
    seq_len: int,
    rows_per_micro_batch: int = 1,
    pad_token_id: int = 0,
    num_micro_batches_multiple: int = 1,
    packing: bool = True,
) -> list[MicroBatch]:
    """Packs samples into rows of at most seq_len tokens, then rows into micro-batches.

    With packing off every sample gets a row of its own (longest first, so micro-batches pad little);
    the model then needs no packed attention.

    Each micro-batch is padded to its longest row, not to seq_len. Empty micro-batches (one padding
    token, no loss) are appended until their number is a multiple of num_micro_batches_multiple, so
    every rank can run the same number of forward/backward passes in lockstep.
    """
    import torch

    for s in samples:
        assert len(s.token_ids) == len(s.loss_mask) == len(s.inference_logp), (
            "rollout fields differ in length"
        )
        # token_logp gives the first token of a packed sample a value predicted from the previous sample.
        assert not s.loss_mask[0], "a rollout cannot start with a sampled token (it has no context)"
    lengths = [len(s.token_ids) for s in samples]
    if packing:
        rows = data.pack(lengths, seq_len)
    else:
        rows = [[i] for i in sorted(range(len(samples)), key=lambda i: -lengths[i])]

    micro_batches = []
    for first in range(0, len(rows), rows_per_micro_batch):
        chunk = rows[first : first + rows_per_micro_batch]
        width = max(sum(len(samples[i].token_ids) for i in row) for row in chunk)
        input_ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)  # (R, T)
        position_ids = torch.zeros((len(chunk), width), dtype=torch.long)  # (R, T)
        loss_mask = torch.zeros((len(chunk), width), dtype=torch.bool)  # (R, T)
        inference_logp = torch.zeros((len(chunk), width), dtype=torch.float32)  # (R, T)
        advantages = torch.zeros((len(chunk), width), dtype=torch.float32)  # (R, T)
        for r, row in enumerate(chunk):
            offset = 0
            for i in row:
                s, n = samples[i], len(samples[i].token_ids)
                mask = torch.tensor(s.loss_mask, dtype=torch.bool)  # (n,)
                input_ids[r, offset : offset + n] = torch.tensor(s.token_ids, dtype=torch.long)
                position_ids[r, offset : offset + n] = torch.arange(n)
                loss_mask[r, offset : offset + n] = mask
                logp = torch.tensor(s.inference_logp, dtype=torch.float32)  # (n,)
                inference_logp[r, offset : offset + n] = torch.where(mask, logp, 0.0)
                advantages[r, offset : offset + n] = s.advantage
                offset += n
            position_ids[r, offset:] = torch.arange(width - offset)
        micro_batches.append(MicroBatch(input_ids, position_ids, loss_mask, inference_logp, advantages))

    while len(micro_batches) % num_micro_batches_multiple:
        empty = torch.zeros((1, 1), dtype=torch.long)  # (1, 1)
        micro_batches.append(
            MicroBatch(
                torch.full_like(empty, pad_token_id),
                empty.clone(),
                empty.bool(),
                empty.float(),
                empty.float(),
            )
        )
    return micro_batches
