"""Buffer: group advantages, flat and stale groups dropped, waiting for the producer."""

import asyncio

import pytest

from lib.orchestrator.rollouts import AdvantageConfig, Buffer, Rollout, group_advantages, is_flat


def rollout(reward, version=0, length=4, first_token=0):
    return Rollout(
        token_ids=list(range(first_token, first_token + length)),
        loss_mask=[False] + [True] * (length - 1),
        inference_logp=[0.0] + [-0.5] * (length - 1),
        reward=reward,
        policy_version=version,
    )


def test_group_advantages_hand_computed():
    # mean 0.5 -> (-0.5, 0, 0.5); sample std sqrt((0.25 + 0 + 0.25) / 2) = 0.5 -> (-1, 0, 1).
    assert group_advantages([0.0, 0.5, 1.0]) == pytest.approx([-0.5, 0.0, 0.5])
    assert group_advantages([0.0, 0.5, 1.0], normalize=True) == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)
    # mean 0.25: (0.75, -0.25, -0.25, -0.25), summing to zero.
    assert group_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert is_flat([0.3, 0.3, 0.3]) and not is_flat([0.3, 0.3, 0.31])


def test_take_drops_flat_and_stale_groups():
    async def run():
        buffer = Buffer(examples_per_step=3, max_async_level=1)
        buffer.put([rollout(0.2, version=1), rollout(0.9, version=1)])  # stale at step 3 (3 - 1 > 1)
        buffer.put([rollout(0.5, version=2), rollout(0.5, version=2)])  # flat
        buffer.put([rollout(1.0, version=3), rollout(0.0, version=3)])
        buffer.put([rollout(0.0, version=2), rollout(0.5, version=3), rollout(1.0, version=3)])
        return await buffer.take(step=3)

    batch = asyncio.run(run())
    assert len(batch.groups) == 3  # the flat group counts toward examples_per_step
    assert batch.num_flat_groups == 1 and batch.num_stale_rollouts == 2
    assert [r.advantage for r in batch.rollouts] == pytest.approx([0.5, -0.5, -0.5, 0.0, 0.5])
    # The groups (what rl.py writes to rollouts/step_N.jsonl) carry the same advantages.
    assert [r.advantage for g in batch.groups for r in g] == pytest.approx([0, 0, 0.5, -0.5, -0.5, 0, 0.5])
    assert batch.staleness_max == 1  # a version-2 rollout at step 3
    assert batch.staleness_mean == pytest.approx(3 / 7)


def test_fully_on_policy_keeps_only_the_current_version():
    async def run():
        buffer = Buffer(examples_per_step=1, max_async_level=0, advantage=AdvantageConfig(normalize="group"))
        buffer.put([rollout(0.0, version=4), rollout(1.0, version=5)])  # one old rollout spoils the group
        buffer.put([rollout(0.0, version=5), rollout(1.0, version=5)])
        return await buffer.take(step=5)

    batch = asyncio.run(run())
    assert batch.num_stale_rollouts == 2 and batch.staleness_max == 0
    assert [r.advantage for r in batch.rollouts] == pytest.approx([-0.7071, 0.7071], abs=1e-4)


def test_every_group_flat_means_an_empty_step_not_a_hang():
    async def run():
        buffer = Buffer(examples_per_step=2, max_async_level=0)
        buffer.put([rollout(1.0), rollout(1.0)])
        buffer.put([rollout(0.0), rollout(0.0)])
        return await asyncio.wait_for(buffer.take(step=0), timeout=5)

    batch = asyncio.run(run())
    assert batch.rollouts == [] and batch.num_flat_groups == 2


def test_take_waits_for_the_producer_and_says_how_long():
    async def producer(buffer):
        for _ in range(2):
            await asyncio.sleep(0.05)
            buffer.put([rollout(0.0), rollout(1.0)])

    async def run():
        buffer = Buffer(examples_per_step=2, max_async_level=0)
        task = asyncio.create_task(producer(buffer))
        batch = await buffer.take(step=0)
        await task
        return batch

    batch = asyncio.run(run())
    assert len(batch.rollouts) == 4
    assert 0.08 < batch.wait_seconds < 2


def test_rloo_and_std_by_group_or_step_hand_computed():
    # RLOO: reward - the mean of the others. (0, 0.5, 1): 0 - 0.75, 0.5 - 0.5, 1 - 0.25 = (-0.75, 0, 0.75),
    # 3/2 of the group mean's (-0.5, 0, 0.5); over their std (0.75) the same (-1, 0, 1) as GRPO's.
    assert group_advantages([0.0, 0.5, 1.0], baseline="rloo") == pytest.approx([-0.75, 0.0, 0.75])
    assert group_advantages([0.0, 0.5, 1.0], normalize=True, baseline="rloo") == pytest.approx(
        [-1.0, 0.0, 1.0], abs=1e-5
    )

    def take(advantage):
        async def run():
            buffer = Buffer(examples_per_step=3, max_async_level=0, advantage=advantage)
            buffer.put([rollout(1.0), rollout(0.0)])
            buffer.put([rollout(0.0), rollout(0.0), rollout(0.0), rollout(1.0)])
            buffer.put([rollout(0.5), rollout(0.5)])  # flat: in no std
            return await buffer.take(step=0)

        return [r.advantage for r in asyncio.run(run()).rollouts]

    # Group means: (0.5, -0.5) and (-0.25, -0.25, -0.25, 0.75). Over the step: sample std of the six is
    # sqrt((0.25 + 0.25 + 3 x 0.0625 + 0.5625) / 5) = 0.5. Over each group: 0.7071 and 0.5.
    assert take(AdvantageConfig()) == pytest.approx([0.5, -0.5, -0.25, -0.25, -0.25, 0.75])
    assert take(AdvantageConfig(normalize="step")) == pytest.approx([1, -1, -0.5, -0.5, -0.5, 1.5], abs=1e-5)
    assert take(AdvantageConfig(normalize="group")) == pytest.approx(
        [0.7071, -0.7071, -0.5, -0.5, -0.5, 1.5], abs=1e-4
    )
    # RLOO, n = 2 then 4: (1 - 0, 0 - 1) and 4/3 of the group means'.
    assert take(AdvantageConfig(baseline="rloo")) == pytest.approx([1, -1, -1 / 3, -1 / 3, -1 / 3, 1])


def test_branches_of_an_episode_share_its_advantage_and_its_number_in_the_step():
    import dataclasses

    async def run():
        buffer = Buffer(examples_per_step=2, max_async_level=0, advantage=AdvantageConfig(baseline="rloo"))
        # Episode 1 (reward 1) forked into two branches, episode 2 (reward 0): RLOO over 2 episodes, not 3.
        forked = [dataclasses.replace(rollout(1.0), episode=1), dataclasses.replace(rollout(1.0), episode=1)]
        buffer.put([*forked, dataclasses.replace(rollout(0.0), episode=2)])
        buffer.put([rollout(0.0), rollout(1.0)])  # episodes of their own (episode None)
        return await buffer.take(step=0)

    rollouts = asyncio.run(run()).rollouts
    assert [r.advantage for r in rollouts] == pytest.approx([1, 1, -1, -1, 1])
    assert [r.step_episode for r in rollouts] == [0, 0, 1, 2, 3]


def test_a_reward_that_is_not_a_finite_number_is_refused_before_any_advantage():
    # Seen: NaN rewards broke the group std (AttributeError from statistics.stdev) or, without it, trained the
    # weights into NaN in one step.
    from lib.config import UserError

    for bad in (float("nan"), float("inf"), -float("inf")):
        buffer = Buffer(examples_per_step=1, max_async_level=0)
        group = [rollout(1.0), rollout(bad)]
        group[1].env, group[1].task_id = "some_env", "task 7"
        with pytest.raises(UserError, match=rf"environment some_env gave the reward {bad} \(task task 7\)"):
            buffer.put(group)
        assert buffer.ready() == 0
