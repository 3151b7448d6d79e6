"""The GPU check: plainrl's SFT and RL at the Qwen3-0.6B shape on one CUDA GPU, in one command, with throughput,
MFU and memory beside prime-rl's published figures.

Made for a bare CUDA machine without network, which has torch and transformers but not the rest (make
gpu-wheels gathers it: benchmarks/gather_gpu_wheels.py). With --wheels the folder is installed into a
temporary target (pip --no-index --no-deps) and the script runs again with PYTHONPATH=target:repo, so
plainrl runs from the source tree on the machine's own torch (never `pip install .`: pyproject pins torch
2.13). It stops at once, in one sentence, if that torch lacks an API plainrl calls (TORCH_APIS), and
records any requirement the machine's packages do not meet. Then, on a Qwen3 shape with random weights
and Qwen's tokenizer (lib/models/qwen.py, what scripts/qwen.py writes), in this order:

- trainer_sft, trainer_rl: trainer only, fake data, at prime-rl's shapes: one row of 8k tokens with the
  SFT loss, one of 16k with rl.py's policy loss; float32 master weights under bf16 autocast, AdamW, no
  activation checkpointing (prime-rl's 0.6B rows recompute). Tokens/s, peak memory and MFU: torchtitan's
  FLOPs (prime-rl's), 6 x parameters + 12 x layers x heads x head_dim x sequence length per token, over
  the GPU's bf16 dense peak (989 TFLOP/s for an H100 SXM; PEAK_TFLOPS, or --peak-tflops);
- varlen: lib/models/attention.py's packed attention under bf16 autocast takes the variable-length kernel (its
  calls are counted, in the trainer rows too) and matches the per-sample SDPA loop within bf16 tolerance;
- head: the chunked output layer (lib/trainer/head.py) against full logits: extra peak memory of one forward and
  backward at 4k and 16k loss tokens, and the largest logprob difference between the two;
- sft: scripts/sft.py's main() for 20 steps at configs/reverse_text/sft.toml's shape (batch 32, micro 4,
  rows of 4096, packing) on the reverse_text taskset's offline samples: median tokens/s after step 1, MFU;
- fsdp2: lib/dist.py's FSDP2 at world size 1 (NCCL; gloo on CPU): one step, then the full state gathered;
- lora: one step with LoRA rank 16;
- rl: scripts/rl.py's main() for 3 steps on tests/fixtures' letter_taskset with the builtin engine on the
  same GPU (colocated), on-policy (the rollout wait is then the sampling time): sampled tokens/s, train
  tokens/s and sync seconds as rl.py logs them, every weight check (the server reports the new weights'
  label) and probe difference (bf16 on GPU), the trainer's and the whole device's peak memory.

Every figure goes to OUT/gpu_check.json and a markdown table, OUT/gpu_check.md (rewritten after each
section, so a run cut short keeps what it measured), and is printed. A section that fails is recorded
under "errors" with its figures null, the others still run, and the exit status is 1. With --device cpu
--shape test the same script runs on 2 CPU cores in under a minute, in make test (tests/test_gpu_check.py),
on lib/models/qwen.py's 2-layer test shape narrowed to hidden 64 (PLANS; still Qwen's whole vocabulary and
tokenizer) with small batches: there the CUDA-only figures (CUDA_ONLY) are null.

Usage:
    python3 benchmarks/gpu_check.py --wheels gpu-wheels --out outputs/gpu_check    # the GPU machine
    python3 benchmarks/gpu_check.py --wheels gpu-wheels --sections rl               # one section again
    python benchmarks/gpu_check.py --device cpu --shape test                        # CPU, 2-layer shape
"""

import argparse
import atexit
import contextlib
import dataclasses
import gc
import importlib
import inspect
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# plainrl from the source tree: lib, and its tasksets and chat harness as the installed package maps them
# (pyproject's package-dir), plus the benchmarks' and tests' helpers and letter_taskset.
SOURCE_PATHS = [str(ROOT), str(ROOT / "lib" / "tasksets")]
sys.path[:0] = [
    *SOURCE_PATHS,
    str(ROOT / "benchmarks"),
    str(ROOT / "tests"),
    str(ROOT / "tests" / "fixtures"),
]
GIB = 2**30
SITE_VARIABLE = "PLAINRL_GPU_CHECK_SITE"  # set in the run on top of the installed wheels

# fmt: off
# What plainrl calls in torch that releases before the lock's 2.13 may lack: (module, name, keywords, caller).
TORCH_APIS = [
    ("torch.nn.attention.varlen", "varlen_attn", ("scale", "window_size"), "lib/models/attention.py"),
    ("torch.distributed.fsdp", "fully_shard", ("mp_policy",), "lib/dist.py"),
    ("torch.distributed.fsdp", "MixedPrecisionPolicy", ("param_dtype", "reduce_dtype"), "lib/dist.py"),
    ("torch.distributed.checkpoint.state_dict", "StateDictOptions",
     ("full_state_dict", "cpu_offload", "ignore_frozen_params", "broadcast_from_rank0", "strict"), "lib/dist.py"),
    ("torch", "get_autocast_dtype", (), "lib/trainer/head.py, lib/models/attention.py"),
]
# bf16 dense peak TFLOP/s by device name, first match (torchtitan's and prime-rl's table).
PEAK_TFLOPS = [("H100 NVL", 835), ("H100 PCIe", 756), ("H100", 989), ("H200", 989), ("H800", 989), ("A100", 312)]
# prime-rl BENCHMARKS.md, Qwen3-0.6B, trainer only, fake data, one H100: (tokens/s, MFU).
PRIME_RL = {"trainer_sft": (26_000, 0.168), "trainer_rl": (11_900, 0.111)}

# What each section runs, by shape; the flags of "sft" and "rl" go to those scripts as they are.
PLANS = {
    "0.6B": {
        "trainer_sft_tokens": 8192, "trainer_rl_tokens": 16384, "warmup_steps": 2, "timed_steps": 5,
        "varlen": (16, 1024),  # samples x tokens in one packed row
        "head_tokens": [4096, 16384],
        "step_tokens": 4096,  # fsdp2 and lora
        "sft": {"steps": 20, "batch-size": 32, "micro-batch-size": 4, "seq-len": 4096},
        "rl": {"examples-per-step": 8, "rollouts-per-example": 16, "sampling.max-tokens": 128, "seq-len": 4096},
    },
    "test": {
        "overrides": '{"hidden_size": 64, "intermediate_size": 192}',  # lib/models/qwen.py's "test", narrowed
        "trainer_sft_tokens": 64, "trainer_rl_tokens": 128, "warmup_steps": 0, "timed_steps": 1,
        "varlen": (4, 32),
        "head_tokens": [32, 64],
        "step_tokens": 64,
        "sft": {"steps": 1, "batch-size": 4, "micro-batch-size": 2, "seq-len": 512},
        "rl": {"examples-per-step": 2, "rollouts-per-example": 2, "sampling.max-tokens": 8, "seq-len": 512},
    },
}

# Every figure the check writes, by section (the JSON's keys), and those only a CUDA run measures (null on CPU).
FIGURES = {
    "run": ("device", "device_name", "shape", "python", "packages", "requirement_problems", "peak_bf16_tflops",
            "seconds"),
    "model": ("parameters", "layers", "write_seconds"),
    "trainer_sft": ("tokens", "step_seconds", "tokens_per_second", "mfu", "peak_memory_gib"),
    "trainer_rl": ("tokens", "step_seconds", "tokens_per_second", "mfu", "peak_memory_gib"),
    "varlen": ("kernel", "calls_in_training", "max_abs_difference", "within_bf16_tolerance", "varlen_ms",
               "sdpa_loop_ms"),
    "head": ("tokens", "logp_max_difference", "chunked_peak_gib", "full_peak_gib"),
    "sft": ("steps", "tokens_per_second", "mfu", "peak_memory_gib", "final_loss"),
    "fsdp2": ("backend", "sharded_parameters", "loss", "step_seconds", "full_state_tensors", "peak_memory_gib"),
    "lora": ("rank", "trained_parameters", "loss", "step_seconds", "tokens_per_second", "peak_memory_gib"),
    "rl": ("steps", "rollout_tokens_per_second", "train_tokens_per_second", "sync_seconds", "weight_checks",
           "probe_differences", "probe_tolerance", "reward_mean", "trainer_peak_memory_gib", "device_peak_memory_gib"),
}
CUDA_ONLY = {
    "run": ("peak_bf16_tflops",),
    "trainer_sft": ("mfu", "peak_memory_gib"),
    "trainer_rl": ("mfu", "peak_memory_gib"),
    "varlen": ("kernel", "calls_in_training", "max_abs_difference", "within_bf16_tolerance", "varlen_ms"),
    "head": ("chunked_peak_gib", "full_peak_gib"),
    "sft": ("mfu", "peak_memory_gib"),
    "fsdp2": ("peak_memory_gib",),
    "lora": ("peak_memory_gib",),
    "rl": ("trainer_peak_memory_gib", "device_peak_memory_gib"),
}
# fmt: on


@dataclasses.dataclass
class Setup:
    """What every section needs: where and at which shape it runs, and the model written for it."""

    device: str
    shape: str
    work: Path
    peak_tflops: float | None
    parameters: int = 0
    config: dict = dataclasses.field(default_factory=dict)
    varlen_calls: int = 0
    """Variable-length kernel calls counted in the trainer rows."""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def plan(self) -> dict:
        return PLANS[self.shape]

    @property
    def model_dir(self) -> Path:
        return self.work / "model"


# ---------------------------------------------------------------- the machine


def bootstrap(wheels: Path) -> None:
    """Installs the wheel folder into a temporary target and runs this script again on top of it."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        sys.exit(
            f"{wheels} holds no wheels: run `make gpu-wheels` where pip reaches PyPI and bring the folder."
        )
    site = tempfile.mkdtemp(prefix="plainrl-gpu-check-")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    subprocess.run([*command, "--disable-pip-version-check", "--target", site, *map(str, found)], check=True)
    path = os.pathsep.join(p for p in (site, *SOURCE_PATHS, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, SITE_VARIABLE: site, "PYTHONPATH": path}
    os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]], env)


def missing_torch_apis() -> list[str]:
    """The entries of TORCH_APIS this torch lacks, each as `module.name(keyword=) (caller)`."""
    missing = []
    for module_name, name, keywords, caller in TORCH_APIS:
        try:
            api = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{name} ({caller})")
            continue
        lacking = [k for k in keywords if k not in inspect.signature(api).parameters]
        if lacking:
            missing.append(f"{module_name}.{name}({', '.join(k + '=' for k in lacking)}) ({caller})")
    return missing


def torch_problem() -> str | None:
    """The one sentence to stop with when this torch lacks an API plainrl calls, else None."""
    import torch

    missing = missing_torch_apis()
    if not missing:
        return None
    return (
        f"torch {torch.__version__} lacks what plainrl calls: {'; '.join(missing)} (plainrl's lock pins torch "
        "2.13.0): nothing was measured."
    )


def requirement_problems() -> list[str]:
    """plainrl's requirements (torch's and numpy's relaxed, as for the wheels) and the carried wheels'
    that the packages found here do not meet: the machine's versions nobody had read are checked here."""
    from importlib import metadata

    from gather_gpu_wheels import plainrl_requirements
    from packaging.requirements import Requirement

    requirements = [(r, "plainrl") for r in plainrl_requirements()]
    if os.environ.get(SITE_VARIABLE):
        for dist in metadata.distributions(path=[os.environ[SITE_VARIABLE]]):
            requirements += [(Requirement(line), dist.metadata["Name"]) for line in dist.requires or []]
    problems = set()
    for requirement, by in requirements:
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            version = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.add(f"{by} needs {requirement}, which is missing")
            continue
        if not requirement.specifier.contains(version, prereleases=True):
            problems.add(f"{by} needs {requirement}, found {version}")
    return sorted(problems)


def run_figures(setup: Setup) -> dict:
    from importlib import metadata

    import torch

    names = ["torch", "transformers", "peft", "numpy", "tokenizers", "safetensors", "huggingface-hub"]
    names += ["accelerate", "verifiers", "datasets", "fsspec", "pyarrow", "tensorboard", "aiohttp", "httpx"]
    packages = {}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            packages[name] = metadata.version(name)
    return {
        "device": setup.device,
        "device_name": torch.cuda.get_device_name() if setup.cuda else platform.processor() or "cpu",
        "shape": setup.shape,
        "python": platform.python_version(),
        "packages": packages,
        "requirement_problems": requirement_problems(),
        "peak_bf16_tflops": setup.peak_tflops,
    }


# ---------------------------------------------------------------- helpers


def reset_peak(setup: Setup) -> None:
    import torch

    if setup.cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(setup: Setup) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / GIB if setup.cuda else None


def synchronize(setup: Setup) -> None:
    import torch

    if setup.cuda:
        torch.cuda.synchronize()


def seconds_per_call(setup: Setup, function, repeats: int, warmup: int = 1) -> float:
    """Mean seconds of `function()` over `repeats` calls, after `warmup` calls."""
    for _ in range(warmup):
        function()
    synchronize(setup)
    began = time.perf_counter()
    for _ in range(repeats):
        function()
    synchronize(setup)
    return (time.perf_counter() - began) / repeats


def flops_per_token(setup: Setup, sequence_length: float) -> float:
    """Training FLOPs per token, torchtitan's convention: 6 x parameters + 12 x layers x heads x head_dim x
    the sequence's length (causal attention not halved; the tied output layer counted once)."""
    c = setup.config
    return (
        6 * setup.parameters
        + 12 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] * sequence_length
    )


def mfu(setup: Setup, flops_per_second: float) -> float | None:
    return flops_per_second / (setup.peak_tflops * 1e12) if setup.cuda and setup.peak_tflops else None


def trainable(setup: Setup, lora_rank: int = 0):
    """(model, autocast) as sft.py and rl.py train it: float32 master weights, bf16 autocast on CUDA,
    packed attention, chunked output layer."""
    from lib.models.load import ModelConfig
    from lib.trainer.trainable import LoraConfig, load_trainable

    model_config = ModelConfig(name=str(setup.model_dir), device=setup.device)
    model, _, autocast = load_trainable(
        model_config, LoraConfig(rank=lora_rank), setup.device, 1, packing=True
    )
    return model, autocast


def fake_row(setup: Setup, tokens: int, samples: int, seed: int = 0):
    """One packed row of `samples` random sequences, `tokens` in all: (1, T) ids, positions restarting at
    each sample, and a mask on the second half of each sample (an RL completion)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, setup.config["vocab_size"], (1, tokens), generator=generator)
    positions = (torch.arange(tokens) % (tokens // samples))[None]  # (1, T)
    mask = positions >= tokens // samples // 2  # (1, T)
    return ids.to(setup.device), positions.to(setup.device), mask.to(setup.device)


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


def train_steps(setup: Setup, model, loss_function, steps: int) -> tuple[float, float]:
    """Mean seconds of an optimizer step (loss, backward, AdamW) after the plan's warm-up steps, and the
    last loss."""
    from lib.trainer.optim import OptimConfig, build_optimizer, optimizer_step

    optimizer, scheduler = build_optimizer(model.parameters(), OptimConfig(lr=1e-6), 1000)
    losses = []

    def step():
        loss = loss_function()
        loss.backward()
        optimizer_step(optimizer, scheduler, 1.0)
        losses.append(loss.item())

    return seconds_per_call(setup, step, steps, setup.plan["warmup_steps"]), losses[-1]


@contextlib.contextmanager
def counted_varlen_kernel():
    """Counts lib.models.attention's calls for the variable-length kernel (one per attention layer it serves)."""
    from lib.models import attention

    original, calls = attention.varlen_kernel, []

    def counted():
        kernel = original()
        calls.append(kernel[0])
        return kernel

    attention.varlen_kernel = counted
    try:
        yield calls
    finally:
        attention.varlen_kernel = original


# ---------------------------------------------------------------- sections


def section_model(setup: Setup) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lib.models.qwen import QwenConfig, write_qwen

    began = time.perf_counter()
    write_qwen(setup.model_dir, QwenConfig(shape=setup.shape, overrides=setup.plan.get("overrides", "{}")))
    written = time.perf_counter() - began
    setup.config = json.loads((setup.model_dir / "config.json").read_text())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(setup.model_dir))
    setup.parameters = sum(p.numel() for p in model.parameters())  # tied weights once
    return {
        "parameters": setup.parameters,
        "layers": setup.config["num_hidden_layers"],
        "write_seconds": written,
    }


def trainer_row(setup: Setup, kind: str) -> dict:
    tokens = setup.plan[f"trainer_{kind}_tokens"]
    model, autocast = trainable(setup)
    ids, positions, mask = fake_row(setup, tokens, samples=1)
    if kind == "sft":
        loss_function = lambda: sft_loss(model, autocast, ids, positions)  # noqa: E731
    else:
        loss_function = lambda: rl_loss(model, autocast, ids, positions, mask)  # noqa: E731
    reset_peak(setup)
    with counted_varlen_kernel() as calls:
        step_seconds, _ = train_steps(setup, model, loss_function, setup.plan["timed_steps"])
    setup.varlen_calls += len(calls)
    speed = tokens / step_seconds
    return {
        "tokens": tokens,
        "step_seconds": step_seconds,
        "tokens_per_second": speed,
        "mfu": mfu(setup, speed * flops_per_token(setup, tokens)),
        "peak_memory_gib": peak_gib(setup),
    }


def section_varlen(setup: Setup) -> dict:
    import torch

    from lib.models import attention

    samples, length = setup.plan["varlen"]
    c = setup.config
    heads, kv_heads, dim, tokens = (
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
        samples * length,
    )
    generator = torch.Generator().manual_seed(0)
    # Qwen3's q/k norms leave q and k in float32 under autocast while v comes out of a bf16 projection.
    query = torch.randn(1, heads, tokens, dim, generator=generator).to(setup.device)  # (1, H, T, D)
    key = torch.randn(1, kv_heads, tokens, dim, generator=generator).to(setup.device)  # (1, KV, T, D)
    value = torch.randn(1, kv_heads, tokens, dim, generator=generator).to(setup.device)
    value = value.to(torch.bfloat16) if setup.cuda else value
    positions = (torch.arange(tokens, device=setup.device) % length)[None]  # (1, T)
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if setup.cuda else contextlib.nullcontext
    )

    def attend():
        with autocast():
            out, _ = attention.packed_attention(
                None, query, key, value, None, scaling=dim**-0.5, position_ids=positions
            )
        return out  # (1, T, H, D)

    devices, attention.VARLEN_DEVICES = attention.VARLEN_DEVICES, ()  # the per-sample SDPA loop
    try:
        looped = attend()
        loop_seconds = seconds_per_call(setup, attend, 5)
    finally:
        attention.VARLEN_DEVICES = devices
    figures = {"sdpa_loop_ms": loop_seconds * 1e3, "calls_in_training": None}
    if setup.cuda:
        with counted_varlen_kernel() as calls:
            fused = attend()
        assert calls, "packed attention under bf16 autocast on CUDA did not take the variable-length kernel"
        difference = (fused.float() - looped.float()).abs()
        figures |= {
            "kernel": calls[0],
            "calls_in_training": setup.varlen_calls,
            "max_abs_difference": difference.max().item(),
            "within_bf16_tolerance": torch.allclose(fused.float(), looped.float(), atol=1e-2, rtol=1.6e-2),
            "varlen_ms": seconds_per_call(setup, attend, 5) * 1e3,
        }
    return figures


def section_head(setup: Setup) -> dict:
    import torch

    from lib.trainer.head import next_token_scores
    from lib.trainer.loss import LossConfig, policy_loss, token_logp

    model, autocast = trainable(setup)
    tokens = setup.plan["head_tokens"]
    ids, positions, _ = fake_row(setup, tokens[0] + 1, samples=1)
    mask = positions > 0  # every token after the first is a loss token
    with torch.no_grad(), autocast():
        chunked, _ = next_token_scores(model, ids, positions, mask)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        full = token_logp(logits, ids, 1.0, mask)
    figures = {"tokens": tokens, "logp_max_difference": (chunked - full)[mask].abs().max().item()}
    del logits
    if not setup.cuda:
        return figures

    def extra_peak(count: int, in_chunks: bool) -> float | None:
        """GiB over the model's own memory at the peak of one forward and backward on `count` loss tokens."""
        ids, positions, _ = fake_row(setup, count + 1, samples=1, seed=count)
        mask = positions > 0
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        reset_peak(setup)
        before = torch.cuda.memory_allocated()
        try:
            with autocast():
                if in_chunks:
                    logp, _ = next_token_scores(model, ids, positions, mask)
                else:
                    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
                    logp = token_logp(logits, ids, 1.0, mask)
            loss, _ = policy_loss(
                logp, logp.detach() - 0.01, torch.ones_like(logp), mask, count, LossConfig()
            )
            loss.backward()
        except torch.OutOfMemoryError:
            return None  # the full logits do not fit at all
        return (torch.cuda.max_memory_allocated() - before) / GIB

    figures["chunked_peak_gib"] = [extra_peak(count, in_chunks=True) for count in tokens]
    figures["full_peak_gib"] = [extra_peak(count, in_chunks=False) for count in tokens]
    return figures


def section_sft(setup: Setup) -> dict:
    from conftest import load_script

    from lib.config import parse
    from lib.models.load import load_tokenizer
    from lib.orchestrator.data import load_conversations, tokenize_all

    sft = load_script("sft")
    plan = setup.plan["sft"]
    args = ["@", str(ROOT / "configs/reverse_text/sft.toml"), "--model.name", str(setup.model_dir)]
    args += ["--model.device", setup.device, "--output-dir", str(setup.work / "sft"), "--log-every", "5"]
    args += ["--data.id", "reverse_text", "--data.num-examples", str(plan["steps"] * plan["batch-size"])]
    args += [token for name, value in plan.items() for token in (f"--{name}", str(value))]
    cfg = parse(sft.Config, args)
    reset_peak(setup)
    history = sft.main(cfg)["history"]
    peak = peak_gib(setup)
    speed = statistics.median(m["perf/tokens_per_second"] for m in history[1:] or history)
    utilisation = None
    if setup.cuda:  # the attention term needs the samples' lengths: tokenized again, as sft.py did
        samples, _ = tokenize_all(load_tokenizer(cfg.model.name), load_conversations(cfg.data), cfg.seq_len)
        lengths = [len(ids) for ids, _ in samples]
        attended = sum(n * n for n in lengths) / sum(lengths)  # the per-token mean of each sample's length
        utilisation = mfu(setup, speed * flops_per_token(setup, attended))
    return {
        "steps": len(history),
        "tokens_per_second": speed,
        "mfu": utilisation,
        "peak_memory_gib": peak,
        "final_loss": history[-1]["train/loss"],
    }


def section_fsdp2(setup: Setup) -> dict:
    import torch.distributed as torch_dist
    from torch.distributed.tensor import DTensor

    from lib import dist
    from lib.inference.launch import free_port

    backend = "nccl" if setup.cuda else "gloo"
    torch_dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model, autocast = trainable(setup)
        dist.shard(model, bf16=setup.cuda)
        ids, positions, mask = fake_row(setup, setup.plan["step_tokens"], samples=4)
        reset_peak(setup)
        step_seconds, loss = train_steps(
            setup, model, lambda: rl_loss(model, autocast, ids, positions, mask), 1
        )
        state = dist.full_model_state(model)
        return {
            "backend": backend,
            "sharded_parameters": sum(isinstance(p, DTensor) for p in model.parameters()),
            "loss": loss,
            "step_seconds": step_seconds,
            "full_state_tensors": len(state),
            "peak_memory_gib": peak_gib(setup),
        }
    finally:
        torch_dist.destroy_process_group()


def section_lora(setup: Setup) -> dict:
    rank, tokens = 16, setup.plan["step_tokens"]
    model, autocast = trainable(setup, lora_rank=rank)
    ids, positions, mask = fake_row(setup, tokens, samples=4)
    reset_peak(setup)
    step_seconds, loss = train_steps(setup, model, lambda: rl_loss(model, autocast, ids, positions, mask), 1)
    return {
        "rank": rank,
        "trained_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "loss": loss,
        "step_seconds": step_seconds,
        "tokens_per_second": tokens / step_seconds,
        "peak_memory_gib": peak_gib(setup),
    }


def section_rl(setup: Setup) -> dict:
    import torch
    from conftest import load_script

    from lib.config import parse
    from lib.inference.weights import probing
    from lib.trainer import packing

    rl = load_script("rl")
    args = ["@", str(ROOT / "configs/reverse_text/rl.toml"), "--model.name", str(setup.model_dir)]
    args += ["--model.device", setup.device, "--output-dir", str(setup.work / "rl")]
    args += "--env.id letter_taskset --steps 3 --max-async-level 0 --inference.engine torch".split()
    args += ["--checkpoint-every", "1000"]
    args += [token for name, value in setup.plan["rl"].items() for token in (f"--{name}", str(value))]
    cfg = parse(rl.Config, args)

    # rl.py's own functions, wrapped: what each step sampled, and what every weight check found.
    sampled_tokens, checks = [], []
    micro_batches, compare = packing.rl_micro_batches, probing.compare

    def counting(rollouts, *args, **kwargs):
        sampled_tokens.append(sum(sum(r.loss_mask) for r in rollouts))
        return micro_batches(rollouts, *args, **kwargs)

    def checking(probe, trainer_logprobs, label, tolerance, when):
        difference = compare(probe, trainer_logprobs, label, tolerance, when)
        checks.append((probe.label == label, difference, tolerance))
        return difference

    device_peak, stop = [0], threading.Event()

    def sample_device_memory():
        while not stop.wait(0.2):
            free, total = torch.cuda.mem_get_info()
            device_peak[0] = max(device_peak[0], total - free)

    if setup.cuda:
        threading.Thread(target=sample_device_memory, daemon=True).start()
    packing.rl_micro_batches, probing.compare = counting, checking
    reset_peak(setup)
    try:
        history = rl.main(cfg)["history"]
    finally:
        packing.rl_micro_batches, probing.compare = micro_batches, compare
        stop.set()
    waited = sum(m["time/wait_rollouts"] for m in history)
    return {
        "steps": len(history),
        "rollout_tokens_per_second": sum(sampled_tokens) / waited,
        "train_tokens_per_second": statistics.median(m["perf/tokens_per_second"] for m in history),
        "sync_seconds": [m["time/sync_weights"] for m in history],
        "weight_checks": f"{sum(reported for reported, _, _ in checks)}/{len(checks)} reported the new weights",
        "probe_differences": [difference for _, difference, _ in checks],
        "probe_tolerance": checks[0][2],
        "reward_mean": [m["reward/mean"] for m in history],
        "trainer_peak_memory_gib": peak_gib(setup),
        "device_peak_memory_gib": device_peak[0] / GIB if setup.cuda else None,
    }


SECTIONS = {
    "trainer_sft": lambda setup: trainer_row(setup, "sft"),
    "trainer_rl": lambda setup: trainer_row(setup, "rl"),
    "varlen": section_varlen,
    "head": section_head,
    "sft": section_sft,
    "fsdp2": section_fsdp2,
    "lora": section_lora,
    "rl": section_rl,
}


# ---------------------------------------------------------------- output


def check_figures(results: dict) -> None:
    for section, figures in FIGURES.items():
        assert set(results[section]) == set(figures), f"{section}: {sorted(results[section])} != FIGURES"


def show(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(show(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def markdown(results: dict) -> str:
    lines = ["| section | figure | this run | prime-rl, one H100 |", "| --- | --- | --- | --- |"]
    for section in (s for s in FIGURES if s in results):
        for figure, value in results[section].items():
            if figure == "mfu" and value is not None:
                shown = f"{value:.1%}"
            else:
                shown = show(value)
            reference = ""
            if section in PRIME_RL and figure in ("tokens_per_second", "mfu"):
                speed, utilisation = PRIME_RL[section]
                reference = f"{speed / 1000:.1f}k" if figure == "tokens_per_second" else f"{utilisation:.1%}"
            lines.append(f"| {section} | {figure} | {shown} | {reference} |")
    for section, error in results["errors"].items():
        lines.append(f"| {section} | error | {error} | |")
    return "\n".join(lines) + "\n"


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "gpu_check.md").write_text(markdown(results))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--shape", default="0.6B", choices=sorted(PLANS))
    parser.add_argument("--wheels", type=Path, help="wheel folder to install first (make gpu-wheels)")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "outputs" / "gpu_check", help="where the JSON and table go"
    )
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--peak-tflops", type=float, help="the GPU's bf16 dense peak (default: by its name)")
    args = parser.parse_args()
    if args.wheels and SITE_VARIABLE not in os.environ:
        bootstrap(args.wheels)
    if os.environ.get(SITE_VARIABLE):
        atexit.register(shutil.rmtree, os.environ[SITE_VARIABLE], ignore_errors=True)
    began = time.perf_counter()
    os.environ.setdefault(
        "HF_HUB_OFFLINE", "1"
    )  # local directories only: no hub look-ups on a machine without network
    # serve.py, which rl.py starts, finds lib (and the carried wheels) the same way.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (*SOURCE_PATHS, os.environ.get("PYTHONPATH")) if p)

    import torch

    problem = torch_problem()
    if problem:
        sys.exit(problem)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device is visible: on a machine without one, run with --device cpu --shape test.")
    peak = args.peak_tflops
    if args.device == "cuda" and peak is None:
        name = torch.cuda.get_device_name()
        peak = next((tflops for key, tflops in PEAK_TFLOPS if key in name), None)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        setup = Setup(device=args.device, shape=args.shape, work=Path(work), peak_tflops=peak)
        results = {"run": run_figures(setup), "model": section_model(setup), "errors": {}}
        print(f"{results['run']['device_name']}, Qwen3 {args.shape} shape: {json.dumps(results['model'])}")
        for problem in results["run"]["requirement_problems"]:
            print(f"WARNING: {problem}")
        for name, section in SECTIONS.items():
            values, section_began = {}, time.perf_counter()
            if name in args.sections:
                print(f"--- {name}", flush=True)
                try:
                    values = section(setup)
                except Exception as error:  # recorded: one failing section leaves the others' figures
                    traceback.print_exc()
                    results["errors"][name] = (
                        f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}"
                    )
                gc.collect()
                if setup.cuda:
                    torch.cuda.empty_cache()
            assert set(values) <= set(FIGURES[name]), (
                f"{name} wrote figures FIGURES does not list: {set(values)}"
            )
            results[name] = {figure: values.get(figure) for figure in FIGURES[name]}
            print(
                f"{name} ({time.perf_counter() - section_began:.1f} s): {json.dumps(results[name])}",
                flush=True,
            )
            results["run"]["seconds"] = time.perf_counter() - began
            write(results, args.out)
    check_figures(results)
    write(results, args.out)
    print(markdown(results))
    print(f"figures: {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}")
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    main()
