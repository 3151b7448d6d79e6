"""Every script's first import: under a python without plainrl's dependencies, it says which python to use.

Standard library only, and it must stay so: it runs before anything it checks for is imported.
"""

import importlib.util
import os
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What lib/config.py (every script's next import) needs, and the heaviest dependency.
NEEDED = ("tyro", "tomli_w", "torch")


def shown(path: Path) -> str:
    """`path` as typed from the current directory: relative below it, else absolute."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
if missing:
    python, activate = shown(ROOT / ".venv" / "bin" / "python"), shown(ROOT / ".venv" / "bin" / "activate")
    print(
        f"error: {sys.executable} lacks {', '.join(missing)}, which plainrl installs in its virtualenv: run "
        f"{python} {shlex.join(sys.argv)}, or `source {activate}` first (`make setup` creates it).",
        file=sys.stderr,
    )
    raise SystemExit(2)
