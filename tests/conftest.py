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


def wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar an offline wandb run under run_dir/wandb logged, as {key: {step: value}}.

    wandb >= 0.2x has no Python reader for its run-*.wandb transaction log: this reads the framing
    (":W&B" + magic 0xBEE1 + version 0, then LevelDB-log records in 32 KiB blocks, each with a
    crc32, length and type FULL/FIRST/MIDDLE/LAST) and decodes each record with wandb's own protobuf."""
    import json
    import struct

    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", "not a wandb transaction log (or a new version of it)"
    history: dict[str, dict[int, float]] = {}
    position, pending = 7, b""
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        payload, position = data[position + 7 : position + 7 + length], position + 7 + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind not in (1, 4):  # FULL or LAST completes a record
            continue
        record = Record()
        record.ParseFromString(pending)
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            # "a/b" keys arrive split into nested keys; so do the fields of media (an Html's "_type", "size").
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            media = {key.rsplit("/", 1)[0] for key in items if key.endswith("/_type")}
            for key, value in items.items():
                if (
                    isinstance(value, int | float)
                    and not key.startswith("_")
                    and key.rsplit("/", 1)[0] not in media
                ):
                    history.setdefault(key, {})[step] = value
    return history


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every tensorboard scalar under run_dir/tb, as {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
