"""The rollout producer: a background thread whose asyncio loop keeps groups of episodes in flight."""

import asyncio
import contextlib
import dataclasses
import itertools
import json
import threading
import time
from pathlib import Path

from lib import envs, patches
from lib.buffer import Buffer, Rollout, StepBatch
from lib.config import UserError
from lib.inference import HEALTH_EVERY_S
from lib.tasks import task_id

# A run stops when no group has succeeded for this long (and many have failed): nothing works.
FAILURE_PATIENCE_S = 60.0


class Producer:
    """Samples groups of `rollouts_per_example` episodes per example, tags each rollout with the policy
    version that sampled it, and hands finished groups to a Buffer.

    It never runs further ahead than the trainer allows: groups started before version v is published
    serve steps up to v + max_async_level, so at most (version + max_async_level + 1) * examples_per_step
    groups are ever started. With max_async_level = 0 it waits for each step's weights (on-policy).
    Each episode is tagged with the version live when it gets its slot and sends its first request (not
    when its group was queued behind others); a group is as old as its oldest episode. A multi-turn
    episode that straddles a reload keeps the older version (its staleness is over-, never under-stated).
    A group the buffer drops as stale, like a failed one, gives its slot back for a replacement.

    With `seq_len`, every generate request asks for at most what is left of seq_len after its prompt,
    and a group with a rollout still longer (a multi-turn episode whose later prompt fills the row) is
    dropped whole before its advantages, counted as too long, and replaced like a failed one.

    Tasks are drawn in order; `task_index` counts those started. A checkpoint saves it and a resumed run
    starts there: the groups in flight at the kill (at most (max_async_level + 1) * examples_per_step)
    are skipped, never replayed, and the counter works as well for an endless stream of tasks.
    """

    def __init__(
        self,
        env,
        tasks,
        contexts: list,
        rollouts_per_example: int,
        examples_per_step: int,
        max_async_level: int,
        max_concurrent: int,
        normalize_advantage: bool,
        env_name: str,
        start_version: int = 0,
        start_index: int = 0,
        seq_len: int | None = None,
    ):
        assert tasks and contexts, "the producer needs examples and at least one server"
        if seq_len is not None:
            contexts = [
                dataclasses.replace(c, sampling=c.sampling.model_copy(update={patches.SEQ_LEN_KEY: seq_len}))
                for c in contexts
            ]
        self.env, self.tasks, self.contexts, self.seq_len = env, tasks, contexts, seq_len
        self.group_size, self.examples_per_step = rollouts_per_example, examples_per_step
        self.max_async_level, self.env_name = max_async_level, env_name
        self.version, self.task_index = start_version, start_index
        self.started = start_version * examples_per_step  # groups started, counted in step units
        self.num_errors = 0
        self.num_too_long = 0  # rollouts in groups dropped for a rollout longer than seq_len
        self.too_long_reported = 0  # of those, the ones a batch from take() already counted
        self.errors: list[str] = []
        self.failed_in_a_row = 0  # groups that gave nothing to train on, since the last one that did
        self.last_success = time.monotonic()
        self.last_error = ""
        self.loop = asyncio.new_event_loop()
        self.buffer = Buffer(examples_per_step, max_async_level, normalize_advantage, self._give_slot_back)
        self.semaphore = asyncio.Semaphore(max_concurrent)
        self.wakeup: asyncio.Event | None = None
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    # ---------------------------------------------------------------- called from the training loop

    def start(self) -> None:
        self.thread.start()

    def take(self, step: int, report=print, check=None) -> StepBatch:
        """Blocks until the step's groups are ready (re-raising a failure of the producer); on the way,
        `report(message)` gets each rollout error since the last call, as it comes, and `check()` runs
        every HEALTH_EVERY_S seconds (rl.py's: a server that died or froze ends the run in seconds, where
        the failing rollouts alone would take FAILURE_PATIENCE_S)."""
        future = asyncio.run_coroutine_threadsafe(self.buffer.take(step), self.loop)
        checked = time.monotonic()
        while True:
            if check is not None and time.monotonic() - checked >= HEALTH_EVERY_S:
                check()
                checked = time.monotonic()
            for message in self.pop_errors():
                report(message)
            if isinstance(self.failure, UserError):  # every episode fails: one sentence, no traceback
                raise self.failure
            if self.failure is not None:
                raise RuntimeError("the rollout producer failed") from self.failure
            try:
                batch = future.result(timeout=0.5)
            except TimeoutError:
                continue
            batch.num_too_long, self.too_long_reported = (
                self.num_too_long - self.too_long_reported,
                self.num_too_long,
            )
            return batch

    def pop_errors(self) -> list[str]:
        """Error messages since the last call (at most 20 are kept between calls)."""
        errors, self.errors = self.errors, []
        return errors

    def set_version(self, version: int) -> None:
        """New weights are live on every server: later groups are tagged with `version`."""

        def update():
            self.version = version
            self.wakeup.set()

        self.loop.call_soon_threadsafe(update)

    def stop(self) -> None:
        """Cancels the episodes in flight and the producer, which then leaves the env's serving session
        (closing its servers and connections), and stops and closes the loop."""
        if not self.thread.is_alive():
            self.loop.close()  # never started, or already stopped (closing twice does nothing)
            return

        async def shutdown():
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(TimeoutError):
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    # ---------------------------------------------------------------- the background loop

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.wakeup = asyncio.Event()
        self.loop.create_task(self._produce())
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    async def _produce(self) -> None:
        try:
            async with envs.serving(self.env):
                servers = itertools.cycle(self.contexts)
                in_flight: set[asyncio.Task] = set()
                while True:
                    limit = (self.version + self.max_async_level + 1) * self.examples_per_step
                    if self.started >= limit:
                        self.wakeup.clear()
                        await self.wakeup.wait()
                        continue
                    task = self.tasks[self.task_index]  # a TaskStream: drawn lazily, cycling a finite taskset
                    self.task_index += 1
                    self.started += 1
                    job = asyncio.create_task(self._group(task, next(servers)))
                    in_flight.add(job)
                    job.add_done_callback(in_flight.discard)
                    await asyncio.sleep(0)
        except asyncio.CancelledError:  # stop()
            raise
        except BaseException as error:  # surfaced to the trainer by take()
            self.failure = error
            raise

    async def _group(self, task, context) -> None:
        """Plays one group; an exception outside the episodes (a bug in turning them into rollouts) ends
        the run through take(), with its traceback, rather than losing the group's slot in silence."""
        try:
            await self._play_group(task, context)
        except asyncio.CancelledError:  # stop()
            raise
        except BaseException as error:
            self.failure = error

    async def _play_group(self, task, context) -> None:
        async def one():
            async with self.semaphore:
                # The weights live now serve the episode's first request: a group queued behind others
                # may start on newer weights than were live when it was queued.
                version = self.version
                return version, await envs.run_episode(self.env, task, context)

        try:
            episodes = await envs.gather_or_cancel(one() for _ in range(self.group_size))
        except Exception as error:  # a failing episode must not stop the run; it is counted and logged
            self._error(f"{type(error).__name__}: {error}")
            self._replace_failed_group()
            return
        group, num_episodes = [], 0
        for version, episode in episodes:
            rollouts, error = envs.training_samples(
                episode, version, self.env_name, task_id(task.data), episode_index=num_episodes + 1
            )
            if error:
                self._error(error)
            num_episodes += bool(rollouts)
            group += rollouts
        longest = max((len(r.token_ids) for r in group), default=0)
        if self.seq_len is not None and longest > self.seq_len:
            # Dropping only the long rollouts would leave the rest of the group's advantages not summing to 0.
            self.num_too_long += len(group)
            self.last_error = f"a rollout of {longest} tokens is longer than seq_len {self.seq_len}"
            self._replace_failed_group()
            return
        if num_episodes < 2:  # a group of one episode (however many branches) has no advantage
            self._replace_failed_group()
            return
        self.failed_in_a_row, self.last_success = 0, time.monotonic()
        self.buffer.put(group)

    def _replace_failed_group(self) -> None:
        """Samples a replacement so the step still gets its groups (after a pause once failures pile
        up, as in an outage), unless nothing has worked for FAILURE_PATIENCE_S: then the run stops
        with the last error rather than retrying forever in silence."""
        self.failed_in_a_row += 1
        quiet = time.monotonic() - self.last_success
        if self.failed_in_a_row >= 4 * self.examples_per_step and quiet >= FAILURE_PATIENCE_S:
            last = self.last_error or "no episode gave two rollouts"
            self.failure = UserError(
                f"no group of rollouts succeeded for {quiet:.0f} s ({self.failed_in_a_row} failed in a row; "
                f"last error: {last}); check the servers (model name, URL, API key) and the environment's args"
            )
            return

        def replace():
            self.started -= 1
            self.wakeup.set()

        self.loop.call_later(1.0 if self.failed_in_a_row >= self.examples_per_step else 0.0, replace)

    def _give_slot_back(self) -> None:
        """The buffer dropped a stale group: sample a replacement, or the run would fall one group
        further behind with each drop and end up synchronous without saying so."""
        self.started -= 1
        self.wakeup.set()

    def _error(self, message: str) -> None:
        self.num_errors += 1
        self.last_error = message
        if len(self.errors) < 20:
            self.errors.append(message)


def write_records(path: Path, groups: list[list[Rollout]]) -> None:
    """One JSON line per rollout of the step: task id, prompt, completion, reward, advantage, policy version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = ("task_id", "prompt", "completion", "reward", "advantage", "policy_version")
    with path.open("w") as out:
        for group in groups:
            for r in group:
                out.write(json.dumps({name: getattr(r, name) for name in fields}) + "\n")
