"""The GPU check's sections on the trainer alone (benchmarks/gpu/gpu_check.py runs them and writes their
figures): what every section runs at each shape (PLANS), what they share (Setup), the model, and one function
a section returning its figures; run_sections.py has those that run sft.py and rl.py.

Standard library only at the top: gpu_check.py imports it before the carried wheels are installed.
"""

import contextlib
import dataclasses
import gc
import json
import time
from pathlib import Path

from benchmarks.common import rl_loss, sft_loss

GIB = 2**30

# fmt: off
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
