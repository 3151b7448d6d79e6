"""Producer with the real Buffer on made-up episodes: version tags, async slots, branches, resume order."""

import asyncio
import contextlib
import time
import types

import pytest

import lib.rollouts
from lib.buffer import Rollout
from lib.rollouts import Producer


@pytest.fixture
def fake_env(monkeypatch):
    """Episodes of task {"id", "delay", "reward", "branches"}: they sleep `delay` s; the group's n-th
    episode gets the n-th reward (None: the episode fails) and gives the n-th number of branches."""

    @contextlib.asynccontextmanager
    async def serving(env):
        yield

    async def run_episode(env, task, context):
        await asyncio.sleep(task.get("delay", 0.01))
        rewards, branches = task.get("reward", [0.0, 1.0]), task.get("branches", [1])
        task["episodes"] = task.get("episodes", 0) + 1
        n = task["episodes"] - 1
        return task, rewards[n % len(rewards)], branches[n % len(branches)]

    def training_samples(episode, policy_version, env, task_id, episode_index):
        task, reward, branches = episode
        if reward is None:
            return [], "the episode failed"
        rollout = Rollout(
            [1, 2, 3], [False, True, True], [0.0, -1.0, -1.0], reward, policy_version, env, str(task["id"]),
            task_id, episode=episode_index,
        )  # fmt: skip
        return [rollout] * branches, None

    monkeypatch.setattr(lib.rollouts.envs, "serving", serving)
    monkeypatch.setattr(lib.rollouts.envs, "run_episode", run_episode)
    monkeypatch.setattr(lib.rollouts.envs, "training_samples", training_samples)


class FakeTask(dict):
    """A made-up task: its settings as a dict, and the `data.id` the producer records."""

    @property
    def data(self):
        return types.SimpleNamespace(id=self["id"], idx=None)


def producer(tasks, examples_per_step=1, max_async_level=1, max_concurrent=64, **kwargs) -> Producer:
    tasks = [FakeTask(task) for task in tasks]
    return Producer(
        None, tasks, [None], 2, examples_per_step, max_async_level, max_concurrent, False, "fake", **kwargs
    )


def test_an_episode_is_tagged_with_the_weights_of_its_first_request(fake_env):
    # One slot for two episodes: task 1's episodes queue behind task 0's and start after version 1 is live.
    tasks = [{"id": i, "delay": 0.5} for i in range(8)]
    run = producer(tasks, max_concurrent=2)
    run.start()
    try:
        time.sleep(0.2)  # task 0 is sampling, task 1 was queued at version 0 and waits for a slot
        run.set_version(1)
        first, second = run.take(0), run.take(1)
    finally:
        run.stop()
    assert [r.policy_version for r in first.rollouts] == [0, 0]
    assert [r.policy_version for r in second.rollouts] == [1, 1]


def test_stale_drops_give_their_slots_back(fake_env):
    # Task 0 is slow: it comes back stale and is dropped; the producer must still run a step ahead.
    tasks = [{"id": 0, "delay": 1.2}] + [{"id": i, "delay": 0.02} for i in range(1, 100)]
    run = producer(tasks)
    run.start()
    stale, step = 0, 0
    try:
        while not stale:
            batch = run.take(step)
            stale += batch.num_stale_rollouts
            assert batch.staleness_max <= 1
            step += 1
            run.set_version(step)
            time.sleep(0.1)
        time.sleep(0.2)
        # Every slot the trainer allows is in use again: started groups minus the one dropped.
        assert stale == 2 and run.task_index - 1 == (step + 1 + 1) * 1, (run.index, step)
        for _ in range(3):  # and a group is ready ahead of the trainer, step after step
            time.sleep(0.3)
            assert run.buffer.ready() >= 2
            run.take(step)
            step += 1
            run.set_version(step)
    finally:
        run.stop()


def test_advantages_are_per_episode_and_a_group_needs_two_episodes(fake_env):
    # Task 0: an episode of reward 1 with three branches and one of reward 0 with one branch.
    # Task 1: one episode fails, the other has two branches: two rows but a single episode.
    tasks = [
        {"id": 0, "reward": [1.0, 0.0], "branches": [3, 1]},
        {"id": 1, "reward": [1.0, None], "branches": [2]},
        {"id": 2, "reward": [0.0, 1.0]},
    ]
    run = producer(tasks, examples_per_step=2, max_async_level=0)
    run.start()
    try:
        batch = run.take(0)
    finally:
        run.stop()
    by_task = {group[0].completion: group for group in batch.groups}
    assert sorted(by_task) == ["0", "2"], "a group of one episode has no advantage"
    assert sorted(r.advantage for r in by_task["0"]) == [-0.5, 0.5, 0.5, 0.5]
    assert run.num_errors == 1


def test_resume_neither_replays_nor_skips_more_than_the_groups_in_flight(fake_env):
    # Every third task is slow, so groups finish out of order, as real episodes do.
    def tasks():
        return [{"id": i, "delay": 0.3 if i % 3 == 0 else 0.02} for i in range(200)]

    def trained(run, steps) -> list[int]:
        ids = []
        for step in steps:
            batch = run.take(step)
            ids += [int(group[0].completion) for group in batch.groups]
            run.set_version(step + 1)
        return ids

    examples_per_step, max_async_level, kill_at, steps = 3, 1, 3, 6
    whole = producer(tasks(), examples_per_step, max_async_level)
    whole.start()
    try:
        uninterrupted = trained(whole, range(steps))
    finally:
        whole.stop()

    first = producer(tasks(), examples_per_step, max_async_level)
    first.start()
    try:
        before = trained(first, range(kill_at))
        task_index = first.task_index  # what the checkpoint of step kill_at saves
    finally:
        first.stop()
    second = producer(
        tasks(), examples_per_step, max_async_level, start_version=kill_at, start_index=task_index
    )
    second.start()
    try:
        after = trained(second, range(kill_at, steps))
    finally:
        second.stop()
    resumed = before + after

    in_flight = (max_async_level + 1) * examples_per_step  # groups started but not trained at the kill
    assert len(resumed) == len(set(resumed)) == len(uninterrupted), f"replayed: {sorted(resumed)}"
    assert len(set(uninterrupted) - set(resumed)) <= in_flight, (sorted(uninterrupted), sorted(resumed))
