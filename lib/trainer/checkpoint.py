"""Run outputs written atomically: checkpoints/step_N (exact resume) here, weights/step_N in lib/trainer/servable.py.

Rank 0 writes each directory under a temporary name, fsyncs it and renames it into place, so a reader (a
server reloading weights, a resuming run) never sees a half-written step_N, even after a power loss. Every
rank must call the save and load functions: gathering the sharded state is collective. open_run claims
the run directory at the start: what it refuses, what a restart sets aside, what a resume continues.
"""

import contextlib
import json
import os
import random
import re
import shutil
from pathlib import Path

from lib import dist, rundir, runlock
from lib.config import UserError
from lib.provenance import check_base, file_sha256, write_base

STEP_DIR = re.compile(r"step_(\d+)")
MANIFEST = "manifest.json"


# ---------------------------------------------------------------- directories


def step_dirs(parent: Path) -> list[Path]:
    """Complete step_N directories under `parent`, oldest first (temporary ones are not listed)."""
    if not parent.is_dir():
        return []
    found = [p for p in parent.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=step_of)


def step_of(path: Path) -> int:
    return int(STEP_DIR.fullmatch(path.name).group(1))


def latest(parent: Path, say=print) -> Path | None:
    """The newest checkpoint under `parent` whose files match its manifest; each damaged newer one is
    skipped with one line through `say`.

    The check reads every byte (sha256, ~1.5 GB/s on one core) but loads no tensor: a power loss can leave
    a zero-filled hole of the right size anywhere in a file, which sizes, or a hash of a header and a tail,
    would miss. It runs only at a run's start, newest first, and the resume reads the same bytes next."""
    for path in reversed(step_dirs(parent)):
        problem = damage(path)
        if problem is None:
            return path
        say(f"checkpoint {path} is damaged ({problem}): skipping it")
    return None


# What a resume refuses to change: the checkpoint holds weights and optimizer state for this model and adapter.
EXACT = ("model.name", "lora.rank", "lora.alpha", "lora.target_modules")


def open_run(cfg, say) -> Path | None:
    """Claims cfg.output_dir for a run and returns the checkpoint to resume from, or None. Every rank calls it,
    after dist.init: rank 0 alone looks at the directory and changes it (claim), the others wait for its
    answer, so none reads what rank 0 is moving, and all end with the same sentence when it refuses. The run
    directory is the first line said, once the run has it: a refused directory is no run's."""
    answer, said = None, []
    if dist.world()[0] == 0:
        try:
            answer = claim(cfg, lambda *lines: said.extend(lines))
        except UserError as error:
            answer = error
    answer = dist.all_gather(answer)[0]
    if not isinstance(answer, UserError):
        said.insert(0, f"run dir: {cfg.output_dir}")
    for line in said:
        say(line)
    if isinstance(answer, UserError):
        raise answer
    return answer


def claim(cfg, say) -> Path | None:
    """open_run's work, on rank 0. Refuses a non-empty directory that is no run's (rundir.is_run_dir), one
    another process holds (lib/runlock.py), checkpoints without cfg.resume, and checkpoints none of which is
    usable. Without a checkpoint the run starts over: what an earlier run wrote moves to restarted/<time>/
    (set_aside), config.toml and base.json are written. A resume keeps them, refuses LoRA adapters a base model
    that changed since (check_base) and records what its config changes (record_changes)."""
    run_dir = cfg.output_dir
    if other := rundir.other_script(
        run_dir, type(cfg)
    ):  # another script's run (provenance.json passes below)
        raise UserError(other)
    if run_dir.is_dir() and not rundir.is_run_dir(run_dir, type(cfg)):
        if foreign := sorted(p.name for p in run_dir.iterdir() if p.name not in rundir.BEFORE_RUN):
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise UserError(
                f"{run_dir} holds other files ({shown}) and no run of this script (no config.toml or "
                "provenance.json that plainrl wrote for it): give --output-dir a new or empty directory."
            )
    # One run at a time from here on, before anything is read that a live run may be writing, or moved.
    created = not os.path.lexists(run_dir / rundir.LOCK)
    took = runlock.hold(run_dir)
    try:
        return start_or_resume(cfg, say)
    except UserError:  # a refused run leaves the directory as it found it
        if took:
            runlock.release(run_dir, remove=created)
        raise


def start_or_resume(cfg, say) -> Path | None:
    """claim's work once the directory is this process's: the checkpoint to resume from, or a start at step 0."""
    from lib.config import write_config

    run_dir = cfg.output_dir
    found = step_dirs(run_dir / rundir.CHECKPOINTS)
    if found and not cfg.resume:
        raise UserError(
            f"{run_dir} already holds checkpoints: pass --resume to continue, or another --output-dir."
        )
    resume_from = latest(run_dir / rundir.CHECKPOINTS, say) if found else None
    if found and resume_from is None:
        # Never a silent start from step 0 over a run's damaged steps: where to start over is the user's call.
        names = ", ".join(p.name for p in found)
        raise UserError(
            f"no checkpoint in {run_dir / rundir.CHECKPOINTS} can be resumed, every one is damaged ({names}): "
            "move or delete them to start over in this directory, or give another --output-dir."
        )
    if resume_from is None:
        moved = rundir.set_aside(run_dir)
        if moved or cfg.resume:
            where = f"; the earlier run's outputs are in {moved}" if moved else ""
            say(f"no checkpoint in {run_dir}: starting at step 0{where}")
        write_config(cfg, run_dir / rundir.CONFIG)
        write_base(run_dir, cfg.model.name)
    elif step_of(resume_from) < cfg.steps:  # a finished run has nothing to do, nor a change to record
        if cfg.lora.rank:  # the checkpoint holds adapters only: they continue on the base they trained on
            check_base(run_dir, cfg.model.name, "--resume")
        record_changes(cfg, run_dir, step_of(resume_from), say)
    return resume_from


def record_changes(cfg, run_dir: Path, step: int, say) -> None:
    """What a resume changes in the run's config (lib/config.py run_config): refused in EXACT, else said and
    added to resumes.jsonl (the next resume starts from it); config.toml stays the config the run began with."""
    import datetime

    from lib.config import flat, run_config, to_dict, write_atomically, write_config

    saved = run_config(run_dir)
    if saved is None:  # checkpoints without a config: the run's record starts here
        write_config(cfg, run_dir / rundir.CONFIG)
        return
    before, now = flat(saved), flat(to_dict(cfg))
    changes = {
        key: [before.get(key), now.get(key)]
        for key in sorted(before.keys() | now.keys())
        if key not in ("output_dir", "resume") and before.get(key) != now.get(key)
    }
    for key in EXACT:
        if key in changes:
            raise UserError(
                f"--resume continues {run_dir} as it was trained, with {key} {changes[key][0]!r}, not "
                f"{changes[key][1]!r}: its checkpoints hold weights and optimizer state for that; start a "
                "new run in another --output-dir."
            )
    if not changes:
        return
    path = run_dir / rundir.RESUMES
    shown = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changes.items())
    say(f"resuming from step {step} with changes to the run's config: {shown} (recorded in {path})")
    time = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    record = {"step": step, "time": time, "changed": changes, "config": to_dict(cfg)}
    earlier = path.read_text() if path.exists() else ""
    # A run killed meanwhile leaves the earlier records whole.
    write_atomically(path, earlier + json.dumps(record) + "\n")


def sync(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: the names it holds, a rename into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(directory: Path) -> None:
    """fsync every file under `directory`, then each directory, deepest first, `directory` last."""
    for root, _, files in os.walk(directory, topdown=False):
        for name in files:
            sync(Path(root) / name)
        sync(Path(root))


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yields an empty temporary directory next to `final` and renames it to `final` once the body is done.

    ext4 and xfs may persist a rename before the data it names: without the fsyncs, a power loss or a
    kernel panic (not a kill -9, the page cache survives that) could leave step_N with truncated files."""
    tmp = final.parent / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run that was killed while writing
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync_tree(tmp)
    sync(final.parent)  # the temporary directory's own entry
    if final.exists():  # the same step written again after a resume: swap, then drop the old one
        old = final.parent / f".old-{final.name}"
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    sync(final.parent)  # the rename itself


def prune(parent: Path, keep: int, written: int | None = None) -> None:
    """Deletes all but the newest `keep` step_N directories; with `written` (the step just saved), the newest
    `keep` up to that one: higher steps, a dead run's leftovers, stay for the caller to drop (drop_newer),
    and never push out what was just written."""
    dirs = [p for p in step_dirs(parent) if written is None or step_of(p) <= written]
    for path in dirs[:-keep]:
        shutil.rmtree(path)


def drop_newer(parent: Path, step: int) -> None:
    """Deletes step_N directories with N > step: what a stopped run wrote after the checkpoint it resumes
    from, which the resumed run writes again (and which would make `prune` drop the resumed step's own)."""
    for path in step_dirs(parent):
        if step_of(path) > step:
            shutil.rmtree(path)


def write_manifest(directory: Path) -> None:
    """manifest.json: the size and sha256 of every file in `directory`, which `latest` checks."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in files
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))


def damage(directory: Path) -> str | None:
    """What is wrong with a checkpoint's files against its manifest, or None when they match. A checkpoint
    written before manifests existed has none and is taken as it is."""
    if not (directory / MANIFEST).exists():
        return None
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return f"{MANIFEST} is unreadable"
    for name, entry in manifest.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} has {path.stat().st_size} bytes, its manifest says {entry['size']}"
        if file_sha256(path) != entry["sha256"]:
            return f"{name} does not match the sha256 in its manifest"
    return None


# ---------------------------------------------------------------- training state


def rng_state() -> dict:
    import torch

    # This rank's device only: a resume may see fewer GPUs (CUDA_VISIBLE_DEVICES) than the run had.
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    # Checkpoints from before kept a list (one state per device): their CUDA RNG is not restored.
    if isinstance(state["cuda"], torch.Tensor) and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate(state["python"])


def save_checkpoint(run_dir: Path, step: int, model, optimizer, scheduler, progress: dict, keep: int) -> Path:
    """checkpoints/step_N: trainable weights, optimizer, scheduler, every rank's RNG, and `progress`
    (the data position and anything else the loop needs to continue), as unsharded tensors so a run
    can resume on another number of ranks; manifest.json lists their sizes and hashes (`latest` checks)."""
    import torch

    model_state = dist.full_model_state(model, trainable_only=True)
    optimizer_state = dist.full_optimizer_state(model, optimizer)
    rng = dist.all_gather(rng_state())
    path = Path(run_dir) / rundir.CHECKPOINTS / f"step_{step}"
    if dist.world()[0] == 0:
        with atomic_dir(path) as tmp:
            torch.save(model_state, tmp / "model.pt")
            torch.save(optimizer_state, tmp / "optimizer.pt")
            torch.save({"scheduler": scheduler.state_dict(), "rng": rng}, tmp / "state.pt")
            (tmp / "progress.json").write_text(json.dumps({"step": step, **progress}, indent=2))
            write_manifest(tmp)
        prune(path.parent, keep, written=step)
    dist.barrier()
    return path


def load_checkpoint(path: Path, model, optimizer, scheduler) -> dict:
    """Restores what save_checkpoint wrote and returns its `progress`. Rank 0 reads the weights and
    optimizer and broadcasts them; every rank reads the small state (multi-node needs a shared path)."""
    import torch

    rank, _, world_size = dist.world()
    main = rank == 0
    model_state = torch.load(path / "model.pt", map_location="cpu") if main else {}
    optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu") if main else {}
    dist.load_full_state(model, optimizer, model_state, optimizer_state)
    state = torch.load(path / "state.pt")
    scheduler.load_state_dict(state["scheduler"])
    if len(state["rng"]) == world_size:
        set_rng_state(state["rng"][rank])
    else:  # another number of ranks: the weights continue exactly, the random streams cannot
        set_rng_state(state["rng"][0])
    return json.loads((path / "progress.json").read_text())


def resume_rl(checkpoint: Path | None, model, optimizer, scheduler, say) -> dict:
    """rl.py's progress from `checkpoint` ({} for a new run), loaded into the model, optimizer and scheduler;
    on rank 0 the run's weights/ newer than it are dropped. Its draw counters count the tasks started before
    it, in flight ones included: skipped, not replayed."""
    if checkpoint is None:
        return {}
    progress = load_checkpoint(checkpoint, model, optimizer, scheduler)
    say(f"resumed from {checkpoint} (step {progress['step']})")
    if dist.world()[0] == 0:
        drop_newer(checkpoint.parent.parent / rundir.WEIGHTS, progress["step"])
    return progress
