"""Tasksets: their config and arguments, ids resolved to a module, tasks drawn lazily by index, and SFT conversations."""

import dataclasses
import functools
import importlib.util
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Annotated

import tyro

from lib.config import UserError
from lib.models.load import hub_reachable

# plainrl's own tasksets live under names of their own; the public environments' ids find them too.
OWN_TASKSETS = {"reverse_text": "plainrl_reverse_text", "alphabet_sort": "plainrl_alphabet_sort"}


# sft.py's local data files (lib/orchestrator/data.py reads them).
DATA_FILES = (".jsonl", ".json", ".parquet")
# `--env.id path/to/my_env.py`: the file's examples and reward, played by this taskset (lib/orchestrator/tasksets/plainrl_file).
FILE_TASKSET = "plainrl_file"


def is_env_file(env_id: str) -> bool:
    return env_id.endswith(".py")


@functools.cache
def env_file(path: str):
    """The module of an environment file, imported once a process; a one-sentence UserError when the file is
    missing or lacks examples() or reward(completion, example)."""
    import inspect

    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"environment file {path} does not exist.")
    spec = importlib.util.spec_from_file_location(f"plainrl_env_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except (
        Exception
    ) as error:  # the file's own bug (a module it imports is missing, say), told with its message
        raise UserError(f"environment file {path} failed to import: {told(error)}") from None
    for name, arguments in (("examples", ()), ("reward", ("completion", "example"))):
        function = getattr(module, name, None)
        try:
            inspect.signature(function).bind(*arguments)
        except (TypeError, ValueError):  # missing, not callable, or other arguments
            raise UserError(
                f"environment file {path} must define examples() and reward(completion, example) "
                f"(docs/environments.md), and its {name} is {'missing' if function is None else 'not that'}."
            ) from None
    return module


def told(error: Exception) -> str:
    """An exception as one line: its type, then its message."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def file_examples(path: str):
    """An environment file's examples() as it gives them; one it raises while giving them (its own bug) ends
    the run in one sentence that names the file and the error."""
    module = env_file(path)
    try:
        yield from module.examples()
    except Exception as error:
        raise UserError(f"environment file {path}: its examples() raised {told(error)}") from None


def module_name(env_id: str) -> str:
    """The module verifiers imports for `env_id` (a hub id `owner/name@version` imports `name`)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def resolve_id(env_id: str) -> str:
    """The taskset id to load: `reverse_text` and `alphabet_sort` name plainrl's own tasksets unless an
    installed module of that name exists, which then wins; either way, when both exist, says which
    was loaded and how to choose the other."""
    if is_env_file(env_id):
        return FILE_TASKSET
    name = module_name(env_id)
    if name not in OWN_TASKSETS:
        return env_id
    own = OWN_TASKSETS[name]
    if importlib.util.find_spec(name) is None:
        return own
    say_once(
        f"environment {env_id}: loading the installed {name} module, not plainrl's own "
        f"(environment id {own} loads plainrl's)"
    )
    return env_id


@functools.cache
def say_once(message: str) -> None:
    """Prints `message` to stderr the first time only (a run resolves its environment id more than once)."""
    print(message, file=sys.stderr)


def task_id(data) -> str | None:
    """A task's id for results: its `id`, else its position in the taskset (`idx`, upstream tasksets)."""
    if data.id is not None:
        return str(data.id)
    return None if data.idx is None else str(data.idx)


def json_object(text: str, name: str) -> dict:
    """`text` parsed as a JSON object; otherwise a one-sentence ValueError that names the setting."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{name} is not valid JSON ({error.msg}): {text}") from None
    if not isinstance(parsed, dict):
        raise UserError(f"{name} must be a JSON object, got {text}.")
    return parsed


@dataclasses.dataclass
class EnvConfig:
    id: str = "reverse_text"
    """Taskset id: reverse_text, alphabet_sort, plainrl_calculator, plainrl_reasoning_gym (any reasoning-gym task by
    name), any installed verifiers taskset, or a Python file of yours that defines examples() and
    reward(completion, example) (docs/environments.md)."""
    # --env-args too, as eval.py spells it, in every script (sft.py: for --data.args).
    args: Annotated[str, tyro.conf.arg(aliases=("--env-args",))] = "{}"
    """JSON object of taskset arguments, e.g. '{"min_turns": 3}'."""
    num_examples: int = -1
    """How many dataset examples to use (-1 = all the taskset provides; an endless one is drawn as needed)."""
    seed: int = 0
    """Seed of the dataset order and of synthetic data."""
    ratio: float = 1.0
    """This environment's share of the draws in a mixture, relative to the others' ratios."""
    mix: tuple[str, ...] = ()
    """More environments for a mixture (rl.py, sft.py): one JSON object each with keys id, args (an object),
    num_examples, seed, ratio, e.g. '{"id": "alphabet_sort", "ratio": 2}' (lib/orchestrator/mixture.py)."""

    def __post_init__(self):
        json_object(self.args, "env.args")
        if self.ratio <= 0:
            raise UserError(f"environment {self.id}: ratio must be positive.")
        if self.mix:
            env_configs(self)  # a bad entry fails here, before any heavy work
        if self.num_examples == 0 or self.num_examples < -1:
            raise UserError("env.num_examples must be -1 (all) or positive.")

    @property
    def kwargs(self) -> dict:
        return json_object(self.args, "env.args")


def env_configs(env: EnvConfig) -> list[EnvConfig]:
    """The run's environments: `env` itself, then one per env.mix entry; ids must differ (metrics go by id)."""
    configs = [dataclasses.replace(env, mix=())]
    for text in env.mix:
        entry = json_object(text, "each env.mix entry")
        args = entry.pop("args", {})
        if not isinstance(args, dict):
            raise UserError(f"env.mix entry {text}: args must be a JSON object.")
        unknown = set(entry) - {"id", "num_examples", "seed", "ratio"}
        if unknown or "id" not in entry:
            raise UserError(
                f"env.mix entry {text} needs an id and takes only id, args, num_examples, seed, ratio."
            )
        types = {"id": str, "num_examples": int, "seed": int, "ratio": (int, float)}
        wrong = [key for key, value in entry.items() if not isinstance(value, types[key]) or value is True]
        if wrong:
            raise UserError(
                f"env.mix entry {text}: id must be a string, num_examples and seed integers, ratio a number."
            )
        configs.append(EnvConfig(**entry, args=json.dumps(args)))
    ids = [config.id for config in configs]
    if len(set(ids)) < len(ids):
        raise UserError(f"the environments of a mixture need different ids, got {', '.join(ids)}.")
    return configs


def check_env_ids(env: EnvConfig, data: bool = False, examples_per_step: int = 1) -> None:
    """A one-sentence UserError for an environment id (env.mix's too) that names no installed module, found
    without importing verifiers or the taskset (seconds), so a typo ends a run before servers start or a
    run directory is made. An environment file (.py) is imported and checked, its examples too (check_examples:
    at least `examples_per_step`, rl.py's). With `data` (sft.py), a local data file (.jsonl, .json, .parquet)
    or a dataset id (with `/`) passes."""
    import difflib

    verifiers = importlib.util.find_spec("verifiers")
    # verifiers' own tasksets live in verifiers.v1.tasksets; looking there by path imports nothing.
    builtin = [Path(p) / "v1" / "tasksets" for p in verifiers.submodule_search_locations] if verifiers else []
    configs = env_configs(env)
    for config in configs:
        if is_env_file(config.id):
            check_examples(config, examples_per_step, share=config.ratio / sum(c.ratio for c in configs))
            continue
        if data and (
            config.id.endswith(DATA_FILES) or "/" in config.id
        ):  # lib.orchestrator.data.check_data reads files
            continue
        name = module_name(resolve_id(config.id))
        if name == "reasoning_gym":  # the library itself, installed beside the taskset that plays it
            raise UserError(
                f"environment {config.id} is the reasoning-gym library, not a taskset: --env.id plainrl_reasoning_gym "
                """--env.args '{"task": "NAME"}' plays its tasks (docs/environments.md)."""
            )
        if any((d / name).is_dir() or (d / f"{name}.py").is_file() for d in builtin) or module_found(name):
            continue
        known = [*OWN_TASKSETS, "plainrl_calculator", "plainrl_arithmetic", "plainrl_reasoning_gym"]
        close = difflib.get_close_matches(config.id, known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        if config.id in known:  # plainrl's own, run from a source tree that was never installed
            own = Path(__file__).parent / "tasksets"
            hint = f": it is plainrl's own, which make setup installs (or put {own} on PYTHONPATH)"
        raise UserError(f"environment {config.id} is not an installed verifiers taskset{hint}.")


def check_examples(env: EnvConfig, examples_per_step: int, share: float = 1.0) -> None:
    """A one-sentence UserError for an environment file whose examples() gives none, or fewer than one step takes
    from it (a step's groups would play one example twice): in a mixture, its `share` of a step's draws, rounded
    up. Reads no more than that many of them."""
    file = f"environment file {env.id}"
    takes = max(1, math.ceil(round(examples_per_step * share, 9)))
    step = (
        f"one step takes {takes} (examples_per_step)"
        if share == 1
        else f"its share of a step takes {takes} ({share:.0%} of examples_per_step {examples_per_step})"
    )
    count = sum(1 for _ in itertools.islice(file_examples(env.id), takes))
    if count == 0:
        raise UserError(f"{file}: its examples() gave no examples.")
    if count < takes:
        raise UserError(
            f"{file}: its examples() gave {count} example{'s' * (count > 1)}, and {step}: give more "
            "examples or lower --examples-per-step."
        )
    if 0 < env.num_examples < takes:
        raise UserError(
            f"{file}: env.num_examples takes {env.num_examples}, and {step}: raise --env.num-examples or lower "
            "--examples-per-step."
        )


def module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a dotted name whose parent package is missing
        return False


def hf_rows(taskset: str, dataset: str, split: str, source: str) -> list[dict] | None:
    """The rows of a HF dataset, or None where a taskset should make synthetic data; says which on stderr.

    source "hf" must load (errors propagate; with HF_HUB_OFFLINE=1 from the local cache), "synthetic"
    never tries, "auto" tries only when the hub answers within 2 s and falls back to synthetic data on
    any failure, naming the cause.
    """
    if source == "synthetic":
        print(f"{taskset}: synthetic data (source=synthetic)", file=sys.stderr)
        return None
    if source == "auto" and not hub_reachable():
        print(
            f"{taskset}: synthetic data instead of {dataset}\n"
            "  (the Hugging Face hub is unreachable or HF_HUB_OFFLINE is set; source=hf loads a cached copy)",
            file=sys.stderr,
        )
        return None
    import datasets

    try:
        rows = list(datasets.load_dataset(dataset, split=split))
    except Exception as error:  # any loading failure in auto mode means: fall back, and say why
        if source == "hf":
            raise
        print(f"{taskset}: could not load {dataset} ({error}); synthetic data instead", file=sys.stderr)
        return None
    print(f"{taskset}: {len(rows)} rows of {dataset} ({split})", file=sys.stderr)
    return rows


def bad_arguments(env_id: str, error) -> UserError:
    """A taskset config's pydantic ValidationError as one sentence: each field and what is wrong with it."""
    problems = "; ".join(
        ".".join(map(str, e["loc"][1:] or ["args"]))
        + ": "
        + e["msg"].removeprefix("Value error, ").rstrip(".")
        for e in error.errors()
    )
    return UserError(f"bad arguments for environment {env_id}: {problems}.")


def taskset_args(env: EnvConfig) -> dict:
    """The taskset's arguments: env.args, plus env.seed and env.num_examples where the taskset has such fields.

    A flat argument the taskset does not have but its task config does (upstream alphabet_sort keeps
    `similarity_power` there) moves under "task", so both shapes reach the same field.
    """
    import verifiers.v1 as vf

    config_type = vf.taskset_config_type(resolve_id(env.id))
    fields = config_type.model_fields
    args = env.kwargs
    task_type = fields["task"].annotation if "task" in fields else None
    task_fields = getattr(task_type, "model_fields", {})
    for key in [key for key in args if key not in fields and key in task_fields]:
        args.setdefault("task", {})[key] = args.pop(key)
    if is_env_file(env.id):
        args.setdefault("path", str(Path(env.id).expanduser().resolve()))
    if "seed" in fields:
        args.setdefault("seed", env.seed)
    if "num_examples" in fields and env.num_examples > 0:
        args.setdefault("num_examples", env.num_examples)
    return args


class TaskStream:
    """The tasks of a taskset by a plain integer index, drawn lazily as a run asks for them.

    Index i is the taskset's task i mod its length: a finite taskset is read once and its tasks are
    kept for the later passes (as a list of them would be); an endless one is never listed, and
    nothing is kept (memory stays flat however many tasks are drawn). Indices are asked for in
    increasing order; a resume starts at its own index, and the tasks before it are skipped unread.
    """

    def __init__(self, taskset, env_id: str):
        self.taskset, self.env_id = taskset, env_id
        self.endless = not getattr(taskset, "bounded", True)  # a list of tasks is finite
        self.tasks: list = []  # a finite taskset's tasks, once read
        self.length: int | None = None  # known once a finite taskset has been read to its end
        self.iterator = iter(taskset)
        self.position = 0  # index of the next task the iterator yields

    def __getitem__(self, index: int):
        if self.length is not None:
            return self.tasks[index % self.length]
        assert index >= self.position or not self.endless, "an endless taskset is read forwards only"
        if index < self.position:
            return self.tasks[index]
        for task in self.iterator:
            self.position += 1
            if not self.endless:
                self.tasks.append(task)
            if self.position > index:
                return task
        if not self.tasks:
            raise UserError(f"environment {self.env_id} gave no tasks.")
        self.length = len(self.tasks)
        return self.tasks[index % self.length]

    def __iter__(self):
        """One pass over the tasks (without it, Python would iterate by index, cycling forever)."""
        assert not self.endless, "an endless taskset is drawn by index, never iterated whole"
        return iter(self.taskset)

    def describe(self) -> str:
        """How many tasks, for the log."""
        if self.endless:
            return "endless taskset, tasks drawn as needed"
        return "finite taskset, read as needed" if self.length is None else f"{self.length} examples"


def reference_answer(data) -> str | None:
    """A task's reference answer, where its data carries one (upstream tasksets: `answer`)."""
    answer = getattr(data, "answer", None)
    return answer if isinstance(answer, str) and answer else None


def prompt_messages(data) -> list[dict]:
    """The chat an episode shows the model first: the task's system prompt and prompt."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [message.model_dump(exclude_none=True) for message in data.prompt]
    return messages


def answer_conversation(data) -> list[dict]:
    """The chat an episode shows the model (system prompt, prompt), answered with the task's answer."""
    return prompt_messages(data) + [{"role": "assistant", "content": reference_answer(data)}]


def sft_conversations(env: EnvConfig) -> list:
    """Conversations that end with the ideal assistant answers, from a taskset that knows them.

    A taskset module may provide `reference_conversation(task_data) -> list[dict]` (plainrl's do), and
    `reference_tools() -> list[dict]` for the tools its episodes offer; otherwise tasks whose data has
    an `answer` give the prompt answered with it. An endless taskset needs env.num_examples.
    """
    import pydantic
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import import_taskset

    env_id = resolve_id(env.id)
    try:
        module = import_taskset(env_id)
    except ModuleNotFoundError:
        raise UserError(f"environment {env.id} is not an installed verifiers taskset.") from None
    try:
        config = vf.taskset_config_type(env_id).model_validate({"id": env_id, **taskset_args(env)})
    except pydantic.ValidationError as error:
        raise bad_arguments(env.id, error) from None
    taskset = vf.load_taskset(config)
    if env.num_examples > 0:
        taskset = taskset.take(env.num_examples)
    elif not taskset.bounded:
        raise UserError(
            f"environment {env.id} is endless: give the number of examples with --data.num-examples."
        )
    tools = module.reference_tools() if hasattr(module, "reference_tools") else None
    conversations = []
    for task in taskset:
        if hasattr(module, "reference_conversation"):
            messages = module.reference_conversation(task.data)
        elif reference_answer(task.data) is not None:
            messages = answer_conversation(task.data)
        else:
            raise UserError(f"environment {env.id} has no reference answers to build SFT data from.")
        conversations.append({"messages": messages, "tools": tools} if tools else messages)
    return conversations
