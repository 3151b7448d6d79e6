"""A pipeline of stages that a rerun goes on with: each stage is skipped when it is done and was made from the
same inputs (the sha256 of each file, and its settings) as now, recorded in a JSON file once it finished."""

import dataclasses
import functools
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lib.config import parse, to_dict, write_atomically
from lib.venv import ROOT

STARTED = "started"  # the record's entry for what each training stage last started from, finished or not
MINUTES = (
    "minutes"  # the record's entry for the minutes each stage's last run took (a resumed one: its last part)
)


@dataclasses.dataclass
class Stage:
    """A step of a pipeline: `run` makes what `done` looks for from `inputs` (files or directories the stages
    before it made); a rerun skips a stage that is done and was made from the same inputs as now."""

    name: str
    done: Callable[[], bool]
    run: Callable[[], object]
    inputs: tuple[Path, ...] = ()
    run_dir: Path | None = None
    """A training stage's: its run there is set aside (lib/trainer/checkpoint.py) when its inputs changed."""
    settings: object = None
    """What else it is made from, as JSON-ready data (scripts/demo.py: its commands' resolved configs)."""


@functools.cache
def sha256(path: Path, size: int, mtime_ns: int) -> str:
    """A file's sha256, computed once a run for the same file, size and time (SmolLM2's weights are 540 MB)."""
    from lib.provenance import file_sha256

    return file_sha256(path)


def contents(paths: tuple[Path, ...]) -> list[dict[str, str]]:
    """What a stage starts from: for each path, the sha256 of each file (under a directory, by relative name;
    Python's __pycache__ left out, which importing a taskset writes)."""
    found = []
    for path in paths:
        files = sorted(path.rglob("*")) if path.is_dir() else [path]
        files = [
            file for file in files if file.is_file() and "__pycache__" not in file.relative_to(path).parts
        ]
        found.append(
            {str(f.relative_to(path)): sha256(f, f.stat().st_size, f.stat().st_mtime_ns) for f in files}
        )
    return found


def resolved_command(args: list[str], out: Path) -> dict:
    """What a command (`scripts/x.py ...`) runs with from scratch, as its script resolves it (its defaults < the
    presets < the flags; not --resume, which reads the run's own config), as a stage's settings: a preset
    changed since redoes the stage. Paths in `out` are named from it, so that a moved pipeline goes on."""
    name = f"plainrl_script_{Path(args[0]).stem}"
    if name not in sys.modules:  # scripts are not a package; tyro reads the Config's docstrings in its module
        spec = importlib.util.spec_from_file_location(name, ROOT / args[0])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    config = parse(sys.modules[name].Config, [arg for arg in args[1:] if arg != "--resume"])
    return json.loads(json.dumps(to_dict(config)).replace(json.dumps(str(out))[1:-1], "<out>"))


def made_of(stage: Stage) -> list:
    """A stage's inputs' contents, then its settings (as JSON gives them back from the record)."""
    settings = [] if stage.settings is None else [json.loads(json.dumps(stage.settings))]
    return contents(stage.inputs) + settings


def run_stages(every: list[Stage], record: Path, label: str) -> list[Stage]:
    """Runs the stages of `every` that are not done, or were made from other inputs than now, in order; returns
    those it ran. `record` keeps {stage: its inputs' contents}; `label` names the pipeline in what it prints."""
    made_from = json.loads(record.read_text()) if record.is_file() else {}

    def is_done(stage: Stage) -> bool:
        """Done, and made from what its inputs hold now (a stage an older run made, unrecorded, is trusted)."""
        return stage.done() and made_from.setdefault(stage.name, made_of(stage)) == made_of(stage)

    # A stage is judged when its turn comes, after the stages before it ran: they may change its inputs.
    first = next((index for index, stage in enumerate(every) if not is_done(stage)), len(every))
    if first == len(every):
        print(f"{label} is finished: nothing to do, its results are below")
    elif first:
        print(f"going on with {label}: {', '.join(s.name for s in every[:first])} done already")

    # A stage's inputs are recorded once it finished: one killed while redoing itself from new inputs still has
    # the old inputs on record, and is redone next time (its old output is not trusted). A training stage also
    # records what it started from, so that a rerun from other inputs does not resume a run made from the old.
    started = made_from.setdefault(STARTED, {})

    def remember(where: dict, name: str, inputs: list) -> None:
        if where.get(name) != inputs:
            where[name] = inputs
            write_atomically(record, json.dumps(made_from, indent=1) + "\n")

    ran = []
    for stage in every[first:]:
        if is_done(stage):
            continue
        inputs = made_of(stage)
        if stage.run_dir is not None:
            if started.get(stage.name, made_from.get(stage.name, inputs)) != inputs:
                from lib.rundir import set_aside
                from lib.runlock import hold, release

                took = hold(stage.run_dir)  # nothing moves under a run that is writing there
                moved = set_aside(stage.run_dir)
                if took:
                    release(stage.run_dir)
                print(
                    f"{stage.name}: its inputs changed since it ran, so it starts over (the old run: {moved})"
                )
            remember(started, stage.name, inputs)
        start = time.perf_counter()
        stage.run()
        made_from.setdefault(MINUTES, {})[stage.name] = round((time.perf_counter() - start) / 60, 2)
        made_from[stage.name] = inputs
        write_atomically(record, json.dumps(made_from, indent=1) + "\n")
        ran.append(stage)
    return ran


def minutes(record: Path) -> dict[str, float]:
    """{stage: the minutes its last run took} from a pipeline's record (none for a stage an older run made)."""
    return json.loads(record.read_text()).get(MINUTES, {}) if record.is_file() else {}
