"""What the benchmarks share: the checkout's root, and the folders they may write into."""

import fnmatch
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def record_name(script: str) -> str:
    """The record a benchmark writes in its output folder: its own name, so no one else's file passes for it."""
    return f"{Path(script).stem}.json"


def claim_out(out: Path, script: str, writes: tuple[str, ...], record: dict) -> None:
    """Makes `out` the output folder of `script`, or ends in one sentence (exit 2) when it is anyone else's.

    A folder is the benchmark's own when it holds its record and nothing but what the benchmark writes
    (`writes`: names or glob patterns of entries); a new or empty folder becomes its own. Only then may
    the benchmark replace what it finds there. The record (`record`, with the script's name) is written at
    once, so that a run cut short leaves a folder a rerun recognises."""
    from lib.config import fail

    if out.exists() and not out.is_dir():
        fail(f"--out {out} is a file: give a new or empty directory.")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    name = record_name(script)
    others = [h for h in held if h != name and not any(fnmatch.fnmatch(h, w) for w in writes)]
    if held and (others or name not in held or not own_record(out / name, script)):
        shown = ", ".join((others or held)[:3]) + (", ..." if len(others or held) > 3 else "")
        fail(
            f"--out {out} holds files {Path(script).name} did not write ({shown}), which its run would "
            "replace: give a new or empty directory, or one of its earlier outputs."
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps({"written_by": Path(script).name, **record}, indent=1) + "\n")


def own_record(path: Path, script: str) -> bool:
    """Whether `path` is a record `script` wrote."""
    try:
        return json.loads(path.read_text()).get("written_by") == Path(script).name
    except (OSError, ValueError, AttributeError):
        return False
