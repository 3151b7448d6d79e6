"""What the benchmarks share: the checkout's root and its scripts, the tiny model trained once, the machine's
measured limits, the trainer's losses on a packed row, and the output folders a benchmark may write into.

Every benchmark opens with the same two lines, which put the checkout first on the path:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: lib/ and benchmarks/
    from benchmarks.common import ROOT  # noqa: E402

Standard library only at the top: gpu/gpu_check.py imports it before the wheels it carries are installed.
"""

import contextlib
import fnmatch
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "outputs" / "models" / "smollm2-135m-instruct"  # `make smollm2` writes it
MATMUL_SECONDS = 0.4  # how long matmul_gflops times one shape


# ---------------------------------------------------------------- the scripts and the tiny model


def load_script(name: str):
    """Imports scripts/<name>.py as a module (scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"plainrl_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def cached_sft(name: str, tiny_dir: Path, made_by: list[str], args: list[str], steps: int) -> Path:
    """weights/step_<steps> of `sft.py args` run on the tiny model, kept in outputs/test-cache/ under a hash
    of what makes it (the model's and the SFT stage's code, `made_by`, the arguments), so later runs on
    the same checkout reuse it; a fresh clone trains it once."""
    import fcntl
    import hashlib

    from lib.config import parse

    made_by = [
        "lib/models/tiny.py",
        "lib/orchestrator/data.py",
        "lib/trainer/packing.py",
        "lib/models/attention.py",
        "lib/models/load.py",
        "lib/trainer/optim.py",
        "scripts/sft.py",
        *made_by,
    ]
    content = b"".join((ROOT / name).read_bytes() for name in made_by) + " ".join(args).encode()
    out = ROOT / "outputs" / "test-cache" / f"{name}-{hashlib.sha256(content).hexdigest()[:16]}"
    weights = out / "weights" / f"step_{steps}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two runs on one checkout: one trains it, the other waits
        if not (weights / "config.json").is_file():
            shutil.rmtree(out, ignore_errors=True)  # this cache entry's own, cut short
            sft = load_script("sft")
            common = ["--model.name", str(tiny_dir), "--output-dir", str(out), "--steps", str(steps)]
            common += ["--checkpoint-every", str(steps), "--log-every", "100"]
            sft.main(parse(sft.Config, [*args, *common]))
    return weights


def trained_tiny(tiny_dir: Path) -> Path:
    """The tiny model after 300 SFT steps on reverse_text (~2 minutes on 2 cores, once per checkout): greedy
    decoding of a random model is degenerate (one token over and over), this one answers in the task's
    format. The tests' `trained_tiny` fixture and the benchmarks share the one cache entry."""
    preset = "configs/tiny/sft.toml"
    return cached_sft(
        "trained-tiny", tiny_dir, [preset], ["@", str(ROOT / preset), "--data.num-examples", "2000"], 300
    )


# ---------------------------------------------------------------- the machine's limits


@contextlib.contextmanager
def threads(count: int):
    """torch's intra-op threads set to `count` inside the block."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Clock:
    """Wall and CPU seconds (every thread of the process) since it started: on a shared machine CPU time
    still counts what the work itself took, where the wall clock counts the neighbours too."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def seconds(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def matmul_gflops(m: int, k: int, n: int, dtype) -> tuple[float, float]:
    """GFLOP per wall second and per CPU second of `(m, k) @ (k, n)` in `dtype`."""
    import torch

    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(2):
        a @ b
    calls, clock = 0, Clock()
    while clock.seconds()[0] < MATMUL_SECONDS:
        a @ b
        calls += 1
    wall, cpu = clock.seconds()
    return 2 * m * k * n * calls / wall / 1e9, 2 * m * k * n * calls / cpu / 1e9


def bandwidth_gbs() -> dict:
    """GB per wall second moved by a copy (read + write) and a sum (read) of 1 GiB of float32."""
    import torch

    source = torch.ones(2**28)
    target = torch.empty_like(source).copy_(source)  # the pages exist before the clock starts
    clock = Clock()
    for _ in range(3):
        target.copy_(source)
    copy = 3 * 2 * source.numel() * 4 / clock.seconds()[0] / 1e9
    clock = Clock()
    for _ in range(3):
        source.sum()
    read = 3 * source.numel() * 4 / clock.seconds()[0] / 1e9
    return {"copy_gbs": copy, "sum_gbs": read}


# ---------------------------------------------------------------- the trainer's losses on a packed row


def sft_loss(model, autocast, ids, positions):
    """sft.py's loss on a row: every next token of a sample (not across samples) carries loss."""
    import torch.nn.functional as F

    from lib.trainer.head import token_scores

    keep = F.pad(positions[:, 1:] > 0, (0, 1))  # position t predicts t + 1 within the same sample
    with autocast():
        logp, _ = token_scores(model, ids, positions, F.pad(ids[:, 1:], (0, 1)), keep)
    return -logp.sum() / keep.sum()


def rl_loss(model, autocast, ids, positions, mask):
    """rl.py's default policy loss on a row, against inference logprobs a little off the trainer's."""
    import torch

    from lib.trainer.head import next_token_scores
    from lib.trainer.loss import LossConfig, policy_loss

    with autocast():
        logp, _ = next_token_scores(model, ids, positions, mask)
    advantages = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)).to(ids.device)  # (1, T)
    inference_logp = (logp.detach() - 0.01) * mask
    loss, _ = policy_loss(logp, inference_logp, advantages, mask, int(mask.sum()), LossConfig())
    return loss


# ---------------------------------------------------------------- stages of scripts/demo.py's kind


def command_stage(demo, name: str, done, commands: list[list[str]], inputs: tuple, out: Path, run_dir=None):
    """A lib/stages.py Stage that runs scripts' `commands` one after another through scripts/demo.py's run
    (an evaluation whose episodes failed stops it), made from `inputs` and the commands' configs as they
    resolve (paths under `out` written relative to it); `run_dir` as Stage's."""
    from lib.stages import Stage, resolved_command

    def running() -> None:
        for command in commands:
            demo.run(*command)
            if command[0] == "scripts/eval.py":  # eval_commands' last arguments: --output-dir DIR --name NAME
                demo.check_scored(Path(command[-3]) / command[-1])

    settings = [resolved_command(command, out) for command in commands]
    return Stage(name, done, running, inputs, run_dir, settings)


def evaluated(demo, run_dir: Path) -> bool:
    """Whether an evaluation of scripts/demo.py's eval_commands finished, sampled and greedy both."""
    return demo.evaluated(run_dir) and demo.evaluated(demo.greedy(run_dir))


# ---------------------------------------------------------------- output folders


def fail(message: str):
    """Ends the benchmark for a user mistake: one sentence, exit code 2 (lib/config.py's rule)."""
    from lib.config import fail

    fail(message)


def check_model(name: str) -> None:
    """Ends the benchmark in one sentence where `name` is a local model directory not made yet (or a typo),
    saying which target makes it, as rl.py does (lib/models/load.py check_model_name)."""
    from lib.config import UserError
    from lib.models.load import check_model_name

    try:
        check_model_name(name)
    except UserError as error:
        fail(str(error))


def record_name(script: str) -> str:
    """The record a benchmark writes in its output folder: its own name, so no one else's file passes for it."""
    return f"{Path(script).stem}.json"


def claim_out(out: Path, script: str, writes: tuple[str, ...], record: dict) -> None:
    """Makes `out` the output folder of `script`, or ends in one sentence (exit 2) when it is anyone else's.

    A folder is the benchmark's own when it holds its record and nothing but what the benchmark writes
    (`writes`: names or glob patterns of entries); a new or empty folder becomes its own. Only then may
    the benchmark replace what it finds there. The record (`record`, with the script's name) is written at
    once, so that a run cut short leaves a folder a rerun recognises."""
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
