"""Shared fixtures: the tiny model is built once per test session (it takes well under a second)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
