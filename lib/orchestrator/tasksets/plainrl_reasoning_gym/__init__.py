"""plainrl_reasoning_gym: any of reasoning-gym's procedurally generated tasks by name, scored by its own checker.

`--env.args '{"task": "spell_backward", "split": "train"}'` plays one of the datasets reasoning-gym registers
(reasoning_gym.factory.DATASETS), `"config": {...}` passes that dataset's settings through (difficulty, lengths),
and `"tasks": [{"name": ..., "weight": ..., "config": {...}}, ...]` plays a weighted mix of several through
reasoning-gym's composite dataset. The reward is the dataset's own `score_answer(answer, entry)` on the text of
the reply's last <answer> block (reasoning_gym.utils.extract_answer, None without one), against the entry the
question came from; nothing is added for the format, though some checkers give a wrong answer 0.01 or 0.05.

The split: each split draws from seeds of its own, and a question belongs to the test split when a hash of
its normalised text says so (about one in five), to train otherwise, so no test question is ever a training
one, whatever the seeds give. The test split gives each distinct question once and ends when draws stop
giving new ones, so an evaluation's count is of distinct problems, each weighted once.
"""

import dataclasses
import difflib
import functools
import itertools
import json
import zlib
from typing import Any, Literal

import reasoning_gym
import verifiers.v1 as vf
from pydantic import model_validator
from reasoning_gym.composite import DatasetSpec
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import extract_answer

from lib.config import UserError
from lib.orchestrator.tasks import say_once

SYSTEM_PROMPT = (
    "Answer the question. Give only the final answer in <answer></answer> tags, written as the question asks."
)
# Entries made per reasoning-gym dataset object: some precompute a chunk's questions when made, and a few
# refuse an index past their size, so a split walks through chunks of this size, each with a seed of its own.
CHUNK = 500
# Draws in a row that give no new question of the split before it is taken as exhausted (a task whose
# settings allow few distinct questions; the test split gives each once).
EXHAUSTED_AFTER = 10_000
# Set by the split (its seeds, the taskset's num_examples), never by a dataset's config.
SPLIT_KEYS = ("seed", "size")
# Tasks whose questions differ between processes given the same seed (reasoning-gym 0.1.25): three draw from
# sets of letters, whose order follows Python's per-process string hashing, and list_functions's generators
# draw from the global `random`. Held out and scored as the others, but a rerun evaluates other questions.
NOT_REPRODUCIBLE = ("isomorphic_strings", "list_functions", "polynomial_multiplication", "ransom_note")


def task_names() -> list[str]:
    """Every dataset reasoning-gym registers, less its composite (which `tasks` plays)."""
    return sorted(name for name in DATASETS if name != "composite")


def close(name: str, names: list[str]) -> str:
    """`(did you mean a, b?)`, or `(none is close)`, for one-sentence refusals."""
    matches = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
    return f"(did you mean {', '.join(matches)}?)" if matches else "(none is close)"


def check_task(name: Any, config: Any) -> None:
    """A one-sentence UserError for a name reasoning-gym does not know or a config key its dataset does not take."""
    names = task_names()
    if name == "composite":
        raise UserError(
            'reasoning-gym\'s composite is played with "tasks": [{"name": ..., "weight": ...}, ...].'
        )
    if not isinstance(name, str) or name not in names:
        raise UserError(
            f"reasoning-gym has no task {name!r} {close(str(name), names)}; docs/environments.md lists its "
            f"{len(names)}."
        )
    if not isinstance(config, dict):
        raise UserError(f"the config of reasoning-gym's {name} must be a JSON object, got {config!r}.")
    keys = [field.name for field in dataclasses.fields(DATASETS[name][1]) if field.name not in SPLIT_KEYS]
    for key in config:
        if key in SPLIT_KEYS:
            raise UserError(
                f"reasoning-gym's {name}: {key} is set by the split (the taskset's seed and num_examples), not its config."
            )
        if key not in keys:
            raise UserError(
                f"reasoning-gym's {name} takes no config key {key!r} {close(key, keys)}; it takes {', '.join(keys)}."
            )


def mix_specs(tasks: list) -> list[dict]:
    """The mix's entries as {"name", "weight", "config"}, checked; a bare name stands for weight 1, no config."""
    specs = []
    for entry in tasks:
        spec = {"name": entry, "weight": 1.0, "config": {}} if isinstance(entry, str) else entry
        if not isinstance(spec, dict) or set(spec) - {"name", "weight", "config"} or "name" not in spec:
            raise UserError(
                f'each entry of "tasks" is a name or {{"name", "weight", "config"}}, got {entry!r}.'
            )
        spec = {"weight": 1.0, "config": {}, **spec}
        check_task(spec["name"], spec["config"])
        weight = spec["weight"]
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight <= 0:
            raise UserError(
                f'the weight of {spec["name"]} in "tasks" must be a positive number, got {weight!r}.'
            )
        specs.append(spec)
    names = [spec["name"] for spec in specs]
    if len(set(names)) < len(names):
        raise UserError(f'"tasks" names a task twice: {", ".join(names)}.')
    return specs


@functools.lru_cache(maxsize=8)
def generator(source: str, seed: int):
    """The reasoning-gym dataset `source` describes (JSON: one task and its config, or a mix), at `seed`."""
    spec = json.loads(source)
    if "tasks" in spec:
        datasets = [DatasetSpec(s["name"], s["weight"], s["config"]) for s in spec["tasks"]]
        return reasoning_gym.create_dataset("composite", seed=seed, size=CHUNK, datasets=datasets)
    return reasoning_gym.create_dataset(spec["name"], **spec["config"], seed=seed, size=CHUNK)


def normalised(question: str) -> str:
    return " ".join(question.lower().split())


def in_split(question: str, split: str) -> bool:
    """Whether `question` belongs to `split`: a hash of its normalised text, the same on every machine and run."""
    return (zlib.crc32(normalised(question).encode()) % 5 == 0) == (split == "test")


def chunk_seed(split: str, seed: int, chunk: int) -> int:
    """reasoning-gym's seed for a chunk: each split and chunk its own, spread over 32 bits (many datasets seed
    entry i from seed + i, so nearby seeds would repeat each other's entries)."""
    return zlib.crc32(f"{split}/{seed}/{chunk}".encode())


class ReasoningGymConfig(vf.TasksetConfig):
    dataset: str = ""
    """The reasoning-gym task, given as "task" in --env.args (verifiers keeps the field `task` for itself)."""
    config: dict[str, Any] = {}
    """That task's settings, as its config dataclass names them (difficulty, lengths)."""
    tasks: list[Any] = []
    """A weighted mix instead of one task: names, or {"name", "weight", "config"} objects (reasoning-gym's
    composite)."""
    split: Literal["train", "test"] = "train"
    """train, or test: held out, disjoint from train by question text, each distinct question once."""
    seed: int = 0
    """Seed of the split's draws (held-out evaluations use another)."""
    num_examples: int = -1
    """Tasks to generate (-1 = endless, or until the test split runs out of new questions)."""

    @model_validator(mode="before")
    @classmethod
    def _task_by_name(cls, data):
        if isinstance(data, dict) and isinstance(data.get("task"), str):
            data = {key: value for key, value in data.items() if key != "task"} | {"dataset": data["task"]}
        return data

    @model_validator(mode="after")
    def _check(self):
        if self.num_examples == 0 or self.num_examples < -1:
            raise UserError("num_examples must be -1 (endless) or positive.")
        if bool(self.dataset) == bool(self.tasks):
            raise UserError(
                'plainrl_reasoning_gym takes either "task": NAME or "tasks": [...], '
                f"one of reasoning-gym's {len(task_names())} tasks (docs/environments.md)."
            )
        if self.tasks:
            mix_specs(self.tasks)
        else:
            check_task(self.dataset, self.config)
        try:
            generator(self.source, chunk_seed(self.split, self.seed, 0))
        except (AssertionError, TypeError, ValueError) as error:  # the dataset's own checks of its settings
            name = f"{self.dataset}'s config" if self.dataset else "mix"
            raise UserError(
                f"reasoning-gym refused the {name}: {str(error).rstrip('.') or type(error).__name__}."
            ) from None
        return self

    @property
    def source(self) -> str:
        """The dataset as JSON text (a cache key, and what each task's data names)."""
        if self.tasks:
            return json.dumps({"tasks": mix_specs(self.tasks)}, sort_keys=True)
        return json.dumps({"name": self.dataset, "config": self.config}, sort_keys=True)


class ReasoningGymData(vf.TaskData):
    task: str
    """The reasoning-gym dataset the question comes from (in a mix, the one drawn)."""
    answer: str | None
    """Its reference answer (None where the checker accepts many answers and none is given)."""
    source: str
    """The dataset the entry comes from, as JSON (ReasoningGymConfig.source)."""
    seed: int
    """reasoning-gym's seed of the entry's chunk."""
    index: int
    """The entry's index in that chunk."""


class ReasoningGymTask(vf.Task[ReasoningGymData, vf.State, vf.TaskConfig]):
    def __init__(self, data: ReasoningGymData, config=None, entry: dict | None = None) -> None:
        super().__init__(data, config)
        # The entry the question was made from, which the checker reads (some entries are not remade alike:
        # NOT_REPRODUCIBLE); a task rebuilt from its data alone makes it again.
        self.entry = entry if entry is not None else generator(data.source, data.seed)[data.index]

    @vf.reward(weight=1.0)
    async def correct(self, task: ReasoningGymData, trace: vf.Trace) -> float:
        """The dataset's own score of the reply's answer against the entry. A checker that raises on a malformed
        answer (prime_factorization's, on text that is no integer) scores it 0."""
        answer = extract_answer(trace.last_reply or "")
        try:
            return float(generator(task.source, task.seed).score_answer(answer, self.entry))
        except Exception:
            return 0.0

    @vf.metric
    async def tagged(self, task: ReasoningGymData, trace: vf.Trace) -> float:
        return float(extract_answer(trace.last_reply or "") is not None)


def reference_conversation(data: ReasoningGymData) -> list[dict]:
    """The ideal episode (SFT data): the question answered with the entry's own answer in tags."""
    if data.answer is None:
        raise UserError(
            f"reasoning-gym's {data.task} gives no reference answers (its checker accepts many), so no SFT data."
        )
    return [
        {"role": "system", "content": data.system_prompt},
        {"role": "user", "content": data.prompt},
        {"role": "assistant", "content": f"<answer>{data.answer}</answer>"},
    ]


class ReasoningGymTaskset(vf.Taskset[ReasoningGymTask, ReasoningGymConfig]):
    """Seeded reasoning-gym entries of one split, forever unless num_examples bounds them."""

    def __init__(self, config: ReasoningGymConfig) -> None:
        super().__init__(config)
        self.INFINITE = config.num_examples < 0
        names = [config.dataset] if config.dataset else [spec["name"] for spec in mix_specs(config.tasks)]
        for name in sorted(set(names) & set(NOT_REPRODUCIBLE)):
            say_once(
                f"plainrl_reasoning_gym: reasoning-gym's {name} makes other questions from the same seed in each "
                "process, so a rerun evaluates other held-out questions than this run"
            )

    def draws(self):
        """(seed, index, entry) of the split's seeds in order: chunk after chunk."""
        config = self.config
        for chunk in itertools.count():
            seed = chunk_seed(config.split, config.seed, chunk)
            for index in range(CHUNK):
                yield seed, index, generator(config.source, seed)[index]

    def load(self):
        config, source = self.config, self.config.source
        name = config.dataset or "mix"
        draws = self.draws()
        given = set()  # the test split's questions so far, normalised
        numbers = itertools.count() if config.num_examples < 0 else range(config.num_examples)
        for number in numbers:
            for draw in itertools.islice(draws, EXHAUSTED_AFTER):
                question = normalised(draw[2]["question"])
                if in_split(question, config.split) and question not in given:
                    break
            else:
                return  # no new question of the split in EXHAUSTED_AFTER draws
            seed, index, item = draw
            if config.split == "test":
                given.add(question)
            data = ReasoningGymData(
                id=f"{name}-{config.split}-{number}",
                prompt=item["question"],
                system_prompt=SYSTEM_PROMPT,
                task=item["metadata"].get("source_dataset", name),
                answer=item["answer"] if isinstance(item["answer"], str) else None,
                source=source,
                seed=seed,
                index=index,
            )
            yield ReasoningGymTask(data, config.task, entry=item)


__all__ = ["ReasoningGymConfig", "ReasoningGymData", "ReasoningGymTask", "ReasoningGymTaskset"]
