"""The rollout producer: a background thread whose asyncio loop keeps groups of episodes in flight."""

import asyncio
import contextlib
import dataclasses
import itertools
import re
import threading
import time

from lib.config import UserError
from lib.endpoint import HEALTH_EVERY_S
from lib.orchestrator import envs, patches
from lib.orchestrator.rollouts import AdvantageConfig, Buffer, Rollout, StepBatch, is_flat
from lib.orchestrator.tasks import task_id

# A run stops when no group has succeeded for this long (and many have failed): nothing works.
FAILURE_PATIENCE_S = 60.0
# With the filter, flat groups replaced between two steps, in units of examples_per_step.
RESAMPLE_LIMIT = 4


class Producer:
    """Samples groups of `rollouts_per_example` episodes per example, tags each rollout with the policy
    version that sampled it, and hands finished groups to a Buffer.

    It never runs further ahead than max_async_level allows (0: it waits for each step's weights). A group
    the buffer drops as stale, a failed one and one too long for seq_len give their slot back for a
    replacement; so does a flat group with `filter_flat_groups`. Tasks come from a Mixture
    (lib/orchestrator/mixture.py), whose counters a checkpoint saves: a resumed run skips the groups that were in
    flight at the kill, never replays them. Each rule is explained where it is applied.
    """

    def __init__(
        self,
        mixture,
        contexts: list,
        rollouts_per_example: int,
        examples_per_step: int,
        max_async_level: int,
        max_concurrent: int,
        advantage: AdvantageConfig | None,
        start_version: int = 0,
        seq_len: int | None = None,
        filter_flat_groups: bool = False,
        served_kept_sets: bool = False,
        teacher=None,
    ):
        assert contexts, "the producer needs at least one server"
        if seq_len is not None:
            # Every generate request asks for at most what is left of seq_len after its prompt; a group with
            # a rollout still longer (a later prompt of a multi-turn episode fills the row) is dropped whole.
            contexts = [
                dataclasses.replace(c, sampling=c.sampling.model_copy(update={patches.SEQ_LEN_KEY: seq_len}))
                for c in contexts
            ]
        self.mixture, self.contexts, self.seq_len = mixture, contexts, seq_len
        self.group_size, self.examples_per_step = rollouts_per_example, examples_per_step
        self.max_async_level, self.filter_flat_groups = max_async_level, filter_flat_groups
        self.served_kept_sets = served_kept_sets  # every rollout must carry the server's kept sets
        self.teacher = (
            teacher  # lib/orchestrator/teacher.py's Teacher: every group is scored before the buffer
        )
        self.version = start_version
        self.started = start_version * examples_per_step  # groups started, counted in step units
        # Counts since the last take(), kept and reset by the loop's thread alone (_take): each error, flat
        # group replaced and too-long rollout lands in exactly one step's batch.
        self.replaced: list[list[Rollout]] = []  # flat groups replaced (filter_flat_groups)
        self.errors_by_env: dict[str, int] = {}
        self.num_too_long = 0  # rollouts in groups dropped for a rollout longer than seq_len
        self.num_errors = 0  # in the whole run
        self.errors: list[str] = []
        # Each kind of error (its message, numbers aside) is printed once: its first message and its count.
        self.error_kinds: dict[str, list] = {}
        self.failed_in_a_row = 0  # groups that gave nothing to train on, since the last one that did
        self.last_success = time.monotonic()
        self.last_error = ""
        self.loop = asyncio.new_event_loop()
        self.buffer = Buffer(
            examples_per_step,
            max_async_level,
            advantage,
            self._give_slot_back,
            train_flat=teacher is not None,
        )
        self.teacher_busy = 0.0  # the teacher's busy seconds at the previous take()
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
        the failing rollouts alone would take FAILURE_PATIENCE_S), as the teacher's check does."""
        future = asyncio.run_coroutine_threadsafe(self._take(step), self.loop)
        checked = time.monotonic()
        while True:
            if time.monotonic() - checked >= HEALTH_EVERY_S:
                for checking in (check, self.teacher and self.teacher.check):  # a dead teacher ends it too
                    if checking:
                        checking()
                checked = time.monotonic()
            for message in self.pop_errors():
                report(message)
            if isinstance(self.failure, UserError):  # every episode fails: one sentence, no traceback
                raise self.failure
            if self.failure is not None:
                raise RuntimeError("the rollout producer failed") from self.failure
            try:
                return future.result(timeout=0.5)
            except TimeoutError:
                continue

    async def _take(self, step: int) -> StepBatch:
        """The buffer's batch for `step` with the counts since the previous one, read and reset here, in the
        loop's thread, where they are counted."""
        busy_before = self.teacher.busy() if self.teacher else 0.0
        batch = await self.buffer.take(step)
        counts = {
            "num_too_long": self.num_too_long,
            "replaced_groups": self.replaced,
            "errors_by_env": self.errors_by_env,
        }
        if self.teacher is not None:
            # Busy since the previous take (beside sampling and training), and while this one waited.
            busy = self.teacher.busy()
            counts["teacher_seconds"], counts["teacher_wait_seconds"] = (
                busy - self.teacher_busy,
                busy - busy_before,
            )
            self.teacher_busy = busy
        self.num_too_long, self.replaced, self.errors_by_env = 0, [], {}
        return dataclasses.replace(batch, **counts)

    def pop_errors(self) -> list[str]:
        """Error messages since the last call: the first of each kind."""
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
            async with contextlib.AsyncExitStack() as sessions:
                for env in {id(s.env): s.env for s in self.mixture.sources}.values():
                    await sessions.enter_async_context(envs.serving(env))
                servers = itertools.cycle(self.contexts)
                in_flight: set[asyncio.Task] = set()
                while True:
                    # Groups started before version v is published serve steps up to v + max_async_level.
                    limit = (self.version + self.max_async_level + 1) * self.examples_per_step
                    if self.started >= limit:
                        self.wakeup.clear()
                        await self.wakeup.wait()
                        continue
                    # TaskStreams: drawn lazily, cycling finite tasksets. The mixture's counters count tasks
                    # started, in flight ones included, so they work for endless streams too.
                    source, task = self.mixture.draw()
                    self.started += 1
                    job = asyncio.create_task(self._group(source, task, next(servers)))
                    in_flight.add(job)
                    job.add_done_callback(in_flight.discard)
                    await asyncio.sleep(0)
        except asyncio.CancelledError:  # stop()
            raise
        except BaseException as error:  # surfaced to the trainer by take()
            self.failure = error
            raise

    async def _group(self, source, task, context) -> None:
        """Plays one group; an exception outside the episodes (a bug in turning them into rollouts) ends
        the run through take(), with its traceback, rather than losing the group's slot in silence."""
        try:
            await self._play_group(source, task, context)
        except asyncio.CancelledError:  # stop()
            raise
        except BaseException as error:
            self.failure = error

    async def _play_group(self, source, task, context) -> None:
        async def one():
            async with self.semaphore:
                # The weights live now serve the episode's first request: a group queued behind others
                # may start on newer weights than were live when it was queued. A group is as old as its
                # oldest episode, and a multi-turn episode that straddles a reload keeps the older version
                # (its staleness is over-, never under-stated).
                version = self.version
                return version, await envs.run_episode(source.env, task, context)

        try:
            episodes = await envs.gather_or_cancel(one() for _ in range(self.group_size))
        except Exception as error:  # a failing episode must not stop the run; it is counted and logged
            self._error(f"{type(error).__name__}: {error}", source.name)
            self._replace_failed_group()
            return
        group, num_episodes = [], 0
        for version, episode in episodes:
            rollouts, error = envs.training_samples(
                episode, version, source.name, task_id(task.data), episode_index=num_episodes + 1
            )
            if error:
                self._error(error, source.name)
            num_episodes += bool(rollouts)
            group += rollouts
        longest = max((len(r.token_ids) for r in group), default=0)
        if self.seq_len is not None and longest > self.seq_len:
            # Dropping only the long rollouts would leave the rest of the group's advantages not summing to 0.
            self.num_too_long += len(group)
            self.last_error = f"a rollout of {longest} tokens is longer than seq_len {self.seq_len}"
            self._replace_failed_group()
            return
        # verifiers drops a turn's kept sets whose counts do not match the turn's tokens (lib/orchestrator/envs.py kept_sets),
        # though the servers send them (the run checked at its start): such a rollout cannot be scored over the
        # sets it was sampled from. Its whole group goes, as a group too long does: dropping only its episode
        # would move the group's baseline toward the episodes that kept theirs.
        without = {r.episode: r for r in group if r.kept_counts is None} if self.served_kept_sets else {}
        for rollout in without.values():  # one error per episode
            self._error(
                "a rollout came back without kept sets for some of its tokens (verifiers drops a turn's "
                "sampling_mask whose counts do not match the turn's tokens; the episode's turns ended: "
                f"{', '.join(rollout.finish_reasons) or 'unknown'}): its group is left out of training",
                source.name,
            )
        if without:
            self._replace_failed_group()
            return
        if num_episodes < 2:  # a group of one episode (however many branches) has no advantage
            self._replace_failed_group()
            return
        self.failed_in_a_row, self.last_success = 0, time.monotonic()
        # The filter: a flat group teaches nothing, so it gives its slot back, within the same async budget
        # (its rewards still reach the step's metrics; the buffer drops flat groups that reach it from
        # training). At most RESAMPLE_LIMIT * examples_per_step between two take()s, then flat groups pass.
        # The cost: each replaced group's sampling time; the mix leans to tasks of middling difficulty; the
        # draws depend on rewards, so a resume continues from the saved counters, not the same sequence.
        limit = RESAMPLE_LIMIT * self.examples_per_step
        if self.filter_flat_groups and is_flat([r.reward for r in group]) and len(self.replaced) < limit:
            self.replaced.append(group)
            self._give_slot_back()
            return
        if self.teacher is not None:  # a teacher that fails ends the run (_group): no rollout trains unscored
            group = await self.teacher.score_group(group)
        self.buffer.put(group)

    def _replace_failed_group(self) -> None:
        """Samples a replacement so the step still gets its groups (after a pause once failures pile
        up, as in an outage), unless nothing has worked for FAILURE_PATIENCE_S: then the run stops
        with the last error rather than retrying forever in silence."""
        self.failed_in_a_row += 1
        quiet = time.monotonic() - self.last_success
        if self.failed_in_a_row >= 4 * self.examples_per_step and quiet >= FAILURE_PATIENCE_S:
            last = self.last_error or "no episode gave two rollouts"
            kinds = sorted(self.error_kinds.values(), key=lambda kind: -kind[1])[:3]
            counts = "; ".join(f"{count} x {message}" for message, count in kinds) or last
            self.failure = UserError(
                f"no group of rollouts succeeded for {quiet:.0f} s ({self.failed_in_a_row} failed in a row; "
                f"errors: {counts}): {failure_cause(last)}"
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

    def _error(self, message: str, env: str = "") -> None:
        self.num_errors += 1
        self.errors_by_env[env] = self.errors_by_env.get(env, 0) + 1
        self.last_error = message
        kind = self.error_kinds.setdefault(re.sub(r"\d+", "N", message), [message, 0])
        kind[1] += 1
        if kind[1] == 1:
            self.errors.append(f"{message} (printed once: the step lines count them all)")


def failure_cause(error: str) -> str:
    """What a run whose rollouts all fail with `error` should look at, in words."""
    if "maximum context length" in error or "longer than seq_len" in error:
        return (
            "the prompts and replies do not fit: raise --seq-len (a server of your own also needs a larger "
            "--max-model-len) or lower --sampling.max-tokens"
        )
    if "Connection error" in error or "ConnectError" in error:
        return "the inference server stopped answering: is it still running? (its log says why it stopped)"
    return "check the servers (model name, URL, API key) and the environment's args"


def start_producer(
    cfg, servers, *, run_dir, progress: dict, start: int, served_kept_sets: bool, teacher=None
):
    """rl.py's rollouts (cfg: its Config; servers: its sync.Servers): its environments (resumed from
    `progress`), the evaluator or None, and a started Producer against every server: (mixture, evaluator,
    producer). With served kept sets, a group with a rollout without them is left out; with a `teacher`
    (lib/orchestrator/teacher.py), every group is scored by it."""
    from lib import rundir
    from lib.orchestrator.mixture import load_mixture
    from lib.sampling import bounded

    # The prompts are rendered here, as for any run, with model.name's tokenizer and renderer.
    renderer = envs.renderer_name(cfg.model.name)
    contexts = [
        envs.model_context(
            url, name, bounded(cfg.sampling), train=True, tokenizer=cfg.model.name, renderer=renderer
        )
        for url, name in zip(servers.urls, servers.names)
    ]
    mixture, evaluator = load_mixture(
        cfg, url=servers.urls[0], model=servers.names[0], api_key=servers.api_key,
        out=run_dir / rundir.EVAL, progress=progress,
    )  # fmt: skip
    producer = Producer(
        mixture, contexts, rollouts_per_example=cfg.rollouts_per_example,
        examples_per_step=cfg.examples_per_step, max_async_level=cfg.max_async_level,
        max_concurrent=cfg.inference.max_concurrent, advantage=cfg.advantage, start_version=start,
        seq_len=cfg.seq_len, filter_flat_groups=cfg.filter_flat_groups, served_kept_sets=served_kept_sets,
        teacher=teacher,
    )  # fmt: skip
    producer.start()
    return mixture, evaluator, producer
