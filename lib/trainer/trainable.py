"""The trainable model: LoRA adapters, packed-row attention, the chunked output head, FSDP2, compiled norms and MLPs."""

import dataclasses

from lib.config import UserError
from lib.models.load import (
    CPU_BF16_MIN_HIDDEN_SIZE,
    ModelConfig,
    keep_freed_memory,
    load_model,
    runs_in_dtype,
    trains_in_bf16,
)


def compiles(config: ModelConfig, device: str, bf16_compute: bool, hidden_size: int) -> bool:
    """Whether the trainer compiles its norms and MLPs (model.compile): auto where bf16 autocast pays on a CPU."""
    if config.compile != "auto":
        return config.compile == "on"
    if device.startswith("cuda") or not bf16_compute or hidden_size < CPU_BF16_MIN_HIDDEN_SIZE:
        return False
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()  # inductor's C++ kernels need one
    except InvalidCxxCompiler:
        return False
    return True


def compile_norms_and_mlps(model) -> None:
    """torch.compile each RMSNorm and MLP module of a transformers model in place (dynamic shapes: packed rows
    and micro-batches vary). In eager mode their float32 norms and SiLU-times-up pass over the activations
    op by op (with RoPE, residual adds and the output layer's softmax, 30-36% of a bf16 step on a CPU,
    benchmarks/trainer/bench_limits.py); compiled, each module's elementwise ops make one pass."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # in-process: no pool of compiler workers beside the server
    separate_kernel_cache()
    for module in model.modules():
        if type(module).__name__.endswith(("RMSNorm", "MLP")):
            module.compile(dynamic=True)


def separate_kernel_cache() -> None:
    """Keeps inductor's compiled kernels of a process whose CPU is lowered (ATEN_CPU_CAPABILITY, as
    docs/testing.md lowers it to AVX2) in a cache of their own, beside the default one. In one cache, a
    process that is not lowered loaded the bf16 norms and MLPs a lowered one had compiled and aborted at its
    first step on a corrupted heap ("free(): invalid pointer", torch 2.13; tests/test_sft.py). A
    TORCHINDUCTOR_CACHE_DIR of the user's own is left as it is."""
    import os

    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability, default = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower(), default_cache_dir()
    if capability and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) == default:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}-{capability}"


@dataclasses.dataclass
class LoraConfig:
    rank: int = 0
    """LoRA rank; 0 trains every weight (full fine-tuning)."""
    alpha: float = 16.0
    """LoRA scaling numerator (scale = alpha / rank)."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] = dataclasses.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Module names that get adapters (Qwen3 names by default)."""

    def __post_init__(self):
        if self.rank < 0:
            raise UserError("lora.rank must be 0 (off) or positive.")
        if self.rank and not self.target_modules:
            raise UserError("lora.target_modules must name at least one module when lora.rank > 0.")


def load_trainable(
    model_config: ModelConfig,
    lora: LoraConfig,
    device: str,
    world_size: int,
    packing: bool,
    activation_checkpointing: bool = False,
):
    """The model ready to train: float32 master weights, LoRA if asked, packed-row attention, FSDP2 over ranks.

    Returns (model, save_dtype, autocast): the weights are saved in the dtype the model runs in
    (runs_in_dtype: bf16 where the trainer computes in bf16 by default) and `autocast()` runs the forward in
    bf16 where trains_in_bf16 says so, else is a no-op.
    """
    import contextlib

    import torch

    from lib import dist
    from lib.models.attention import use_packed_attention
    from lib.trainer.head import use_chunked_head

    train_config = dataclasses.replace(
        model_config, dtype="float32" if model_config.dtype == "auto" else model_config.dtype
    )
    model = load_model(train_config, device)
    if device == "cpu":
        keep_freed_memory()  # a step's activations are allocated again every step
    # bf16 compute over float32 master weights: AdamW's small updates survive, which bf16 weights round away.
    hidden_size = model.config.get_text_config().hidden_size
    bf16_compute = trains_in_bf16(model_config, device, hidden_size)
    if packing and model_config.attn_implementation == "sdpa":
        use_packed_attention(model)  # flash_attention_2 reads packed rows natively; eager gets a dense mask
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora.rank:
        import peft

        adapters = peft.LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
        )
        model = peft.get_peft_model(model, adapters)
    use_chunked_head(
        model
    )  # training scores tokens without (tokens, vocabulary) logits (lib/trainer/head.py)
    if compiles(model_config, device, bf16_compute, hidden_size):
        compile_norms_and_mlps(model)
    model.train()
    if world_size > 1:
        # On CPUs the ranks gather float32 (gloo), and autocast casts as on one process.
        dist.shard(model, bf16=bf16_compute and device.startswith("cuda"))
    device_type = device.split(":")[0]

    def autocast():
        return torch.autocast(device_type, dtype=torch.bfloat16) if bf16_compute else contextlib.nullcontext()

    return model, getattr(torch, runs_in_dtype(model_config, device_type, hidden_size)), autocast


def load_policy(cfg, device: str, world_size: int):
    """rl.py's policy (cfg: its Config) ready to train, and loss.kl_coef's reference to its starting weights:
    (model, save_dtype, autocast, reference). The reference is loaded from model.name, never from a
    checkpoint, so a resumed run compares with the same one; under LoRA it is the adapter switched off."""
    import torch

    from lib.trainer.head import Reference

    model, save_dtype, autocast = load_trainable(
        cfg.model,
        cfg.lora,
        device=device,
        world_size=world_size,
        packing=cfg.packing,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    # Tokens are scored as the servers sampled them, so no dropout anywhere (rl.py refuses LoRA's). Not
    # eval mode: transformers runs activation checkpointing in train mode only.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    frozen = None
    if cfg.loss.kl_coef and not cfg.lora.rank:  # memory: the configs' comments
        frozen, _, _ = load_trainable(
            cfg.model, LoraConfig(), device=device, world_size=world_size, packing=cfg.packing
        )
        frozen.requires_grad_(False).eval()
    return model, save_dtype, autocast, Reference(model, frozen, autocast, cfg.sampling.temperature)
