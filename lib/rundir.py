"""The run directory: the name of everything a run writes there (its writers take them from here)."""

import dataclasses
import json
import os
import shutil
import tomllib
from pathlib import Path

CONFIG = "config.toml"  # the resolved config the run started with (lib/trainer/checkpoint.py open_run)
# The first line of every config.toml plainrl writes (lib/config.py write_config): anyone's folder may hold one.
CONFIG_HEADER = "# plainrl's resolved config: `@` this file, with a new --output-dir, to repeat the run\n"
RESUMES = "resumes.jsonl"  # a line per resume that changed the config: the changes, the config it took
PROVENANCE = "provenance.json"  # lib/provenance.py
BASE = "base.json"  # the base model's path, weights' and config's sha256 (lib/provenance.py), at step 0
TENSORBOARD = "tb"  # lib/log.py
METRICS = "metrics.jsonl"  # lib/log.py
WANDB = "wandb"  # wandb's own files: wandb.init(dir=run_dir) names the folder
WANDB_ID = "wandb_id"  # lib/log.py: the wandb run a resume continues
WEIGHTS = "weights"  # lib/trainer/servable.py
CHECKPOINTS = "checkpoints"  # lib/trainer/checkpoint.py
ROLLOUTS = "rollouts"  # rl.py
EVAL = "eval"  # rl.py's evaluations during the run (lib/orchestrator/evaluation.py)
SERVER_LOG = "server.log"  # the server rl.py started (lib/inference/launch.py)
TEACHER_LOG = "teacher.log"  # the distillation teacher's server rl.py started (lib/inference/launch.py)
LOSS_CURVE = "loss_curve.png"  # sft.py
REWARD_CURVE = "reward_curve.png"  # rl.py
SLURM = "slurm"  # a SLURM job's script and logs (lib/slurm.py), written before the run starts
EXPORTED = "exported"  # checkpoints written as Hugging Face directories by scripts/export.py
# In each directory scripts/export.py writes (the checkpoint it came from): the only non-empty directory an
# export may replace is an earlier export.
EXPORT_RECORD = "export.json"
# The pid and host of the process that holds the directory (lib/runlock.py): one run in it at a time. It stays
# after the run and holds no one then: the lock is an flock, which the kernel drops when its process ends.
LOCK = "run.lock"
RESTARTED = "restarted"  # earlier runs' outputs, set aside by a restart (lib/trainer/checkpoint.py set_aside)

# What a restart moves to restarted/<time>/, and nothing else the directory holds: the job that runs the
# restart (slurm/) and earlier restarts stay; config.toml and base.json are copied there, then rewritten.
OUTPUTS = (
    RESUMES,
    PROVENANCE,
    TENSORBOARD,
    METRICS,
    WANDB,
    WANDB_ID,
    WEIGHTS,
    CHECKPOINTS,
    ROLLOUTS,
    EVAL,
    SERVER_LOG,
    TEACHER_LOG,
    LOSS_CURVE,
    REWARD_CURVE,
    EXPORTED,  # made from the run's checkpoints: a restart's would be other weights under the same step_N
)
# What a directory may hold before its first run: a SLURM job writes its script there first, and a run refused
# after taking the lock (or killed before it wrote anything) leaves the lock's file.
BEFORE_RUN = (SLURM, LOCK)
# A field of one script's config alone: which script's run a config.toml is (tests/test_rundir.py keeps it so).
SCRIPT_FIELDS = {"batch_size": "sft.py", "max_async_level": "rl.py", "base_url": "eval.py"}


def script_of(fields) -> str | None:
    """The script whose config has the fields named `fields`, by SCRIPT_FIELDS (None: none of them)."""
    return next((script for field, script in SCRIPT_FIELDS.items() if field in fields), None)


def other_script(path: Path, config_class: type) -> str | None:
    """The one sentence to end on when `path` holds another plainrl script's run (its config.toml, as plainrl
    wrote it, is that script's), else None: rl.py given an SFT run's directory must not advise --resume."""
    try:
        text = (path / CONFIG).read_text()
        theirs = script_of({key.replace("-", "_") for key in tomllib.loads(text)})
    except (OSError, ValueError):  # none, or not TOML: is_run_dir's to judge
        return None
    ours = script_of({field.name for field in dataclasses.fields(config_class)})
    if not text.startswith(CONFIG_HEADER) or theirs is None or theirs == ours:
        return None
    hint = ""
    if (theirs, ours) == ("sft.py", "rl.py"):
        steps = sorted(path.glob(f"{WEIGHTS}/step_*"), key=lambda p: int(p.name.rpartition("_")[2]))
        newest = steps[-1] if steps else path / WEIGHTS / "step_N"
        hint = f" (it starts from the SFT run's weights with --model.name {newest})"
    return f"{path} holds an {theirs} run, not one of {ours}'s: give {ours} another --output-dir{hint}"


def is_run_dir(path: Path, config_class: type) -> bool:
    """Whether a run of the script configured by config_class wrote in `path`, judged only by what plainrl
    alone writes first: a provenance.json naming plainrl's revision, or a config.toml that opens with
    CONFIG_HEADER and whose keys are config_class's fields. Anyone else's file of either name is no run."""
    try:
        provenance = json.loads((path / PROVENANCE).read_text())
        if isinstance(provenance, dict) and "plainrl_revision" in provenance:
            return True
    except (OSError, ValueError):
        pass
    try:
        text = (path / CONFIG).read_text()
        table = tomllib.loads(text)
    except (OSError, ValueError):  # tomllib.TOMLDecodeError and UnicodeDecodeError are ValueErrors
        return False
    fields = {field.name for field in dataclasses.fields(config_class)}
    return text.startswith(CONFIG_HEADER) and {key.replace("-", "_") for key in table} <= fields


def set_aside(run_dir: Path) -> Path | None:
    """Moves what an earlier run wrote in run_dir (lib/py OUTPUTS), and copies of its config.toml and
    base.json, to run_dir/restarted/<UTC time>; returns that directory, or None when there was nothing to move.
    Nothing else in run_dir moves."""
    import datetime

    entries = [run_dir / name for name in OUTPUTS if os.path.lexists(run_dir / name)]
    if not entries:
        return None
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    target = run_dir / RESTARTED / stamp
    target.mkdir(parents=True)
    for name in (CONFIG, BASE):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, target / name)
    for entry in entries:
        entry.rename(target / entry.name)
    return target
