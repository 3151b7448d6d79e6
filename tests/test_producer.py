"""Producer with the real Buffer on made-up episodes: version tags, async slots, branches, resume order,
failures, episodes longer than seq_len."""

import asyncio
import contextlib
import threading
import time
import types

import numpy as np
import pytest
from conftest import eventually

import lib.orchestrator.producer
from lib.orchestrator import patches
from lib.orchestrator.envs import model_context
from lib.orchestrator.mixture import Mixture, Source
from lib.orchestrator.producer import Producer
from lib.orchestrator.rollouts import Rollout
from lib.sampling import SamplingConfig


@pytest.fixture
def fake_env(monkeypatch):
    """Episodes of task {"id", "delay", "reward", "branches", "length", "raise", "kept"}: they sleep `delay` s;
    the group's n-th episode gets the n-th reward (None: the episode fails), gives the n-th number of
    branches of the n-th length, carries served kept sets if the n-th "kept" is true (none by default) and
    raises ConnectionError if the n-th "raise" is true; task["finished"] counts the episodes that ran to
    their end, task["cancelled"] those cancelled on the way."""

    @contextlib.asynccontextmanager
    async def serving(env):
        yield

    async def run_episode(env, task, context):
        task["episodes"] = task.get("episodes", 0) + 1
        n = task["episodes"] - 1

        def nth(key, default):
            values = task.get(key, default)
            return values[n % len(values)]

        if nth("raise", [False]):
            raise ConnectionError("the server went away")
        try:
            await asyncio.sleep(task.get("delay", 0.01))
        except asyncio.CancelledError:
            task["cancelled"] = task.get("cancelled", 0) + 1
            raise
        task["finished"] = task.get("finished", 0) + 1
        return task, nth("reward", [0.0, 1.0]), nth("branches", [1]), nth("length", [3]), nth("kept", [False])

    def training_samples(episode, policy_version, env, task_id, episode_index):
        task, reward, branches, length, kept = episode
        if reward is None:
            return [], "the episode failed"
        # Served kept sets: one id per sampled token (what lib/orchestrator/envs.py kept_sets gives when they are whole).
        counts = np.array([0] + [1] * (length - 1), np.int32)
        kept_sets = {"kept_ids": np.ones(length - 1, np.int32), "kept_counts": counts} if kept else {}
        rollout = Rollout(
            [1] * length, [False] + [True] * (length - 1), [0.0] + [-1.0] * (length - 1), reward,
            policy_version, env, str(task["id"]), task_id, episode=episode_index, finish_reasons=["length"],
            **kept_sets,
        )  # fmt: skip
        return [rollout] * branches, None

    monkeypatch.setattr(lib.orchestrator.producer.envs, "serving", serving)
    monkeypatch.setattr(lib.orchestrator.producer.envs, "run_episode", run_episode)
    monkeypatch.setattr(lib.orchestrator.producer.envs, "training_samples", training_samples)


class FakeTask(dict):
    """A made-up task: its settings as a dict, and the `data.id` the producer records."""

    @property
    def data(self):
        return types.SimpleNamespace(id=self["id"], idx=None)


def take_within(run: Producer, step: int, seconds: float = 20.0):
    """run.take(step), or a test failure (not a hung test) when it neither returns nor raises in time."""
    outcome = {}

    def take():
        try:
            outcome["batch"] = run.take(step)
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"take({step}) still waits after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["batch"]


def one_env(tasks, start_index=0, name="fake") -> Mixture:
    """A mixture of one made-up environment whose first `start_index` tasks were drawn already."""
    return Mixture([Source(name, None, tasks, count=start_index)], draws=start_index)


def producer(tasks, examples_per_step=1, max_async_level=1, max_concurrent=64, start_index=0, **kwargs):
    mixture = one_env([FakeTask(task) for task in tasks], start_index)
    return Producer(mixture, [None], 2, examples_per_step, max_async_level, max_concurrent, None, **kwargs)


def test_an_episode_is_tagged_with_the_weights_of_its_first_request(fake_env):
    # One slot for two episodes: task 1's episodes queue behind task 0's and start after version 1 is live.
    tasks = [{"id": i, "delay": 0.5} for i in range(8)]
    run = producer(tasks, max_concurrent=2)
    run.start()
    try:
        # Task 0 is sampling, task 1 was queued at version 0 and waits for a slot.
        drawn = run.mixture.sources[0].tasks
        assert eventually(lambda: drawn[0].get("episodes") == 2 and run.mixture.draws == 2)
        assert "episodes" not in drawn[1]
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
        # Every slot the trainer allows (version + max_async_level + 1 groups) is in use again: the
        # groups started are those plus one per group dropped.
        slots = step + 1 + 1
        assert eventually(lambda: run.mixture.draws == slots + stale // 2), (run.mixture.draws, slots, stale)
        for _ in range(3):  # and a group is ready ahead of the trainer, step after step
            assert eventually(lambda: run.buffer.ready() >= 2), run.buffer.ready()
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
        task_index = first.mixture.draws  # what the checkpoint of step kill_at saves
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


def test_an_episode_that_raises_is_counted_its_group_replaced_and_its_siblings_cancelled(fake_env):
    # Task 0's first episode raises at once; its sibling would run 2 s against the server for nothing.
    tasks = [{"id": 0, "delay": 2.0, "raise": [True, False]}] + [{"id": i} for i in range(1, 10)]
    run = producer(tasks, examples_per_step=2, max_async_level=0)
    run.start()
    try:
        batch = take_within(run, 0)
        assert sorted(group[0].completion for group in batch.groups) == ["1", "2"]
        assert run.num_errors == 1 and run.last_error == "ConnectionError: the server went away"
        failed = run.mixture.sources[0].tasks[0]
        assert failed.get("cancelled") == 1 and "finished" not in failed, "its sibling ran on"
    finally:
        run.stop()


def test_an_exception_outside_the_episodes_ends_the_run_with_its_traceback(fake_env, monkeypatch):
    def broken(*args, **kwargs):
        raise AssertionError("ragged branch")

    monkeypatch.setattr(lib.orchestrator.producer.envs, "training_samples", broken)
    run = producer([{"id": i} for i in range(10)])
    run.start()
    try:
        with pytest.raises(RuntimeError, match="rollout producer failed") as failure:
            take_within(run, 0)
        assert isinstance(failure.value.__cause__, AssertionError)
        assert run.num_errors == 0  # a bug, not a rollout error
    finally:
        run.stop()


def test_stop_closes_the_event_loop(fake_env):
    run = producer([{"id": i} for i in range(10)])
    run.start()
    take_within(run, 0)
    run.stop()
    assert run.loop.is_closed() and not run.thread.is_alive()


def test_a_group_with_a_rollout_longer_than_seq_len_is_dropped_whole_before_its_advantages(fake_env):
    tasks = [
        {"id": 0, "reward": [0.0, 1.0, 0.5], "length": [3, 9, 4]},  # one rollout too long
        {"id": 1, "reward": [1.0, 1.0, 1.0], "length": [9, 3, 3]},  # flat, and too long: counted too
        {"id": 2, "reward": [0.0, 1.0, 0.5], "length": [8, 3, 5]},  # fits exactly
        {"id": 3, "reward": [0.0, 1.0, 0.5], "length": [2, 3, 5]},
    ]
    context = model_context("http://127.0.0.1:9/v1", "m", SamplingConfig(), train=True)  # the fake ignores it
    run = Producer(one_env([FakeTask(t) for t in tasks]), [context], 3, 2, 0, 64, None, seq_len=8)
    run.start()
    try:
        batch = take_within(run, 0)
    finally:
        run.stop()
    assert sorted(group[0].completion for group in batch.groups) == ["2", "3"]
    assert batch.num_too_long == 6 and batch.metrics("fake")["rollouts/too_long"] == 6
    assert run.num_errors == 0
    for group in batch.groups:  # what is trained on still sums to zero, group by group
        assert sum(r.advantage for r in group) == pytest.approx(0.0)
        assert max(len(r.token_ids) for r in group) <= 8


def test_a_group_with_a_rollout_whose_kept_sets_were_dropped_is_left_out_and_counted(fake_env, capsys):
    # The servers send kept sets, but task 0's second episode came back without them, as when verifiers drops
    # a turn's whose counts do not match its tokens: the group leaves, as one rollout error that says why.
    later = [{"id": i, "kept": [True], "delay": 0.3} for i in range(1, 9)]
    tasks = [{"id": 0, "kept": [True, False]}, *later]
    run = producer(tasks, served_kept_sets=True)
    run.start()
    try:
        batch = take_within(run, 0)
    finally:
        run.stop()
    assert len(batch.groups) == 1 and batch.groups[0][0].completion != "0"
    assert all(r.kept_counts is not None for r in batch.rollouts)
    assert batch.metrics("fake")["rollouts/errors"] == 1 and run.num_errors == 1
    (message,) = capsys.readouterr().out.splitlines() + run.pop_errors()  # reported by take(), or not yet
    assert "verifiers drops a turn's sampling_mask whose counts do not match" in message
    assert "turns ended: length" in message and "--return-sampling-mask" not in message


def test_each_request_asks_for_what_is_left_of_seq_len_after_its_prompt():
    context = model_context("http://127.0.0.1:9/v1", "m", SamplingConfig(max_tokens=128), train=True)
    run = Producer(one_env([FakeTask({"id": 0})]), [context], 2, 1, 0, 1, None, seq_len=192)
    run.stop()
    sampling = run.contexts[0].sampling.model_dump(exclude_none=True)

    def asked(prompt_tokens: int) -> dict:
        body = {"token_ids": [5] * prompt_tokens, "sampling_params": dict(sampling)}
        return patches.fit_max_tokens(body)["sampling_params"]

    assert asked(40)["max_tokens"] == 128 and asked(100)["max_tokens"] == 92 and asked(191)["max_tokens"] == 1
    assert patches.SEQ_LEN_KEY not in asked(100), "the limit is plainrl's, never sent to a server"
    assert (
        "max_tokens" in context.sampling.model_dump()
        and patches.SEQ_LEN_KEY not in context.sampling.model_dump()
    )


def steps_of(run: Producer, num_steps: int) -> list:
    """The batches of `num_steps` steps, publishing each step's version as a training loop does."""
    batches = []
    for step in range(num_steps):
        batches.append(take_within(run, step))
        run.set_version(step + 1)
    return batches


def test_the_flat_group_filter_leaves_every_step_with_groups_that_teach(fake_env):
    # Half the tasks are trivial (every episode gets 1.0): with the filter they are replaced by new draws.
    tasks = [{"id": i, "reward": [1.0] if i % 2 else [0.0, 1.0]} for i in range(400)]
    run = producer(tasks, examples_per_step=4, filter_flat_groups=True)
    run.start()
    try:
        batches = steps_of(run, 6)
    finally:
        run.stop()
    for batch in batches:
        assert batch.num_flat_groups == 0 and len(batch.groups) == 4
        assert all(len({r.reward for r in group}) == 2 for group in batch.groups)
    assert sum(batch.num_resampled for batch in batches) >= 6 * 4 - 4  # about one flat per group trained
    assert all(batch.metrics("fake")["rollouts/resampled"] == batch.num_resampled for batch in batches)


def test_without_the_filter_flat_groups_are_trained_on_nothing_and_none_resampled(fake_env):
    tasks = [{"id": i, "reward": [1.0] if i % 2 else [0.0, 1.0]} for i in range(40)]
    run = producer(tasks, examples_per_step=4)
    run.start()
    try:
        batches = steps_of(run, 3)
    finally:
        run.stop()
    assert sum(batch.num_flat_groups for batch in batches) == 6
    assert all(batch.num_resampled == 0 for batch in batches)


def test_the_filter_passes_flat_groups_once_its_bound_is_reached(fake_env):
    # Every task is trivial: after RESAMPLE_LIMIT * examples_per_step replacements the step gets flat groups.
    run = producer(
        [{"id": i, "reward": [1.0]} for i in range(200)], examples_per_step=2, filter_flat_groups=True
    )
    run.start()
    try:
        batch = take_within(run, 0)
    finally:
        run.stop()
    assert batch.num_flat_groups == 2 and batch.num_resampled == lib.orchestrator.producer.RESAMPLE_LIMIT * 2


def test_the_reward_metric_means_the_same_with_and_without_the_filter(fake_env):
    # Half the tasks always solved, half solved by one rollout in two: the true mean is 0.75. Before, the
    # filter's replaced groups never reached the metric, which read 0.500 with the filter and 0.750 without.
    means = {}
    for filtered in (False, True):
        tasks = [{"id": i, "reward": [1.0] if i % 2 else [0.0, 1.0]} for i in range(400)]
        run = producer(tasks, examples_per_step=4, filter_flat_groups=filtered)
        run.start()
        try:
            batches = steps_of(run, 5)
        finally:
            run.stop()
        means[filtered] = sum(b.metrics("fake")["reward/mean"] for b in batches) / len(batches)
        assert all(b.num_flat_groups == 0 for b in batches) == filtered
    assert means[False] == pytest.approx(0.75) and means[True] == pytest.approx(0.75, abs=0.1)
    batch = batches[0]  # the filtered run's first step
    assert batch.metrics("fake", ("fake",))["env/fake/resampled"] == len(batch.replaced_groups) > 0


def test_every_error_is_counted_in_exactly_one_step(fake_env):
    # Every other task has a failing episode while steps are taken: no error is lost between two steps or
    # counted twice.
    tasks = [{"id": i, "reward": [0.0, None] if i % 2 else [0.0, 1.0]} for i in range(200)]
    run = producer(tasks, examples_per_step=2, max_async_level=2)
    run.start()
    try:
        batches = steps_of(run, 6)
    finally:
        run.stop()
    counted = sum(b.metrics("fake")["rollouts/errors"] for b in batches)
    # After stop() the loop's thread is gone: what it counted since the last step is still in the producer.
    assert counted > 0 and counted + sum(run.errors_by_env.values()) == run.num_errors


def test_each_kind_of_rollout_error_is_printed_once_and_the_run_ends_naming_the_cause(fake_env, monkeypatch):
    # Every episode's prompt is too long for the server, each by its own number of tokens: one line, not
    # one per rollout, and the last sentence says what to change.
    episodes = []

    async def too_long(env, task, context):
        episodes.append(task)
        raise RuntimeError(f"Prompt length ({120 + len(episodes) % 9}) exceeds maximum context length (64).")

    monkeypatch.setattr(lib.orchestrator.producer.envs, "run_episode", too_long)
    monkeypatch.setattr(lib.orchestrator.producer, "FAILURE_PATIENCE_S", 1.0)
    run = producer([{"id": i} for i in range(4)])
    printed = []
    run.start()
    try:
        with pytest.raises(ValueError) as failure:
            run.take(0, report=printed.append)
    finally:
        run.stop()
    assert len(episodes) >= 8 and len(printed) == 1
    assert printed[0].startswith("RuntimeError: Prompt length (12") and "printed once" in printed[0]
    message = str(failure.value)
    assert f"errors: {run.num_errors} x RuntimeError: Prompt length" in message
    assert message.endswith(
        "raise --seq-len (a server of your own also needs a larger --max-model-len) or "
        "lower --sampling.max-tokens"
    )
    assert lib.orchestrator.producer.failure_cause("APIConnectionError: Connection error.").startswith(
        "the inference server stopped answering"
    )
