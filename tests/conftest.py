"""Shared fixtures: the tiny model (built once per test session, well under a second), a briefly trained
one, and one real vLLM server (its CPU build) that every test against vLLM shares."""

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Why the vLLM tests could not run, when they could not (printed once at the end of the session).
VLLM_MISSING = "vLLM's CPU build is not installed (make setup-vllm installs it on x86-64 and aarch64 Linux)"


def load_script(name: str):
    """Imports scripts/<name>.py as a module (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"plainrl_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from lib.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def trained_tiny(tiny_dir) -> Path:
    """The tiny model after 300 SFT steps on reverse_text (~2 minutes on 2 cores): greedy decoding of a
    random model is degenerate (one token over and over), this one answers in the task's format.

    Kept in outputs/test-cache/ under a hash of what makes it (the model's and the SFT stage's code and
    preset), so later runs on the same checkout reuse it; a fresh clone trains it once."""
    import hashlib

    from lib.config import parse

    made_by = [
        "lib/tiny.py",
        "lib/data.py",
        "lib/model.py",
        "lib/optim.py",
        "scripts/sft.py",
        "configs/tiny/sft.toml",
    ]
    digest = hashlib.sha256(b"".join((ROOT / name).read_bytes() for name in made_by)).hexdigest()[:16]
    out = ROOT / "outputs" / "test-cache" / f"trained-tiny-{digest}"
    weights = out / "weights" / "step_300"
    if not (weights / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        sft = load_script("sft")
        args = [
            "@",
            str(ROOT / "configs/tiny/sft.toml"),
            "--model.name",
            str(tiny_dir),
            "--output-dir",
            str(out),
        ]
        args += [
            "--steps",
            "300",
            "--checkpoint-every",
            "300",
            "--log-every",
            "100",
            "--data.num-examples",
            "2000",
        ]
        sft.main(parse(sft.Config, args))
    return weights


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skips a test when vLLM's CPU build is missing; under CI (CI=true) that is a failure instead."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{VLLM_MISSING}: CI must run the tests against real vLLM.")
        pytest.skip(VLLM_MISSING)


@pytest.fixture(scope="session")
def vllm_server(vllm_installed, trained_tiny, tmp_path_factory):
    """One real vLLM server (fp32, the trained tiny model, 1 GiB of KV cache) for every test that can share
    it: a start costs 1-3 minutes here. It serves the model as "policy"; tests that load other weights
    load trained_tiny back after."""
    from lib import client

    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    extra = ["--model.dtype", "float32", "--max-logprobs", "128", "--vllm.cpu-kv-cache-gib", "1"]
    extra += ["--served-model-name", "policy"]
    extra += ["--max-model-len", "2048"]
    with client.running_server(str(trained_tiny), engine="vllm", log_path=log, extra_args=extra) as server:
        yield server


def pytest_terminal_summary(terminalreporter):
    """One line saying that the real-vLLM tests were skipped, and why, when they were."""
    skipped = terminalreporter.stats.get("skipped", [])
    if any(VLLM_MISSING in str(report.longrepr) for report in skipped):
        terminalreporter.write_line(f"vLLM tests skipped: {VLLM_MISSING}.")
