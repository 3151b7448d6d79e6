"""Model loading: Hugging Face causal LMs by hub id or local directory, with device and dtype picked sensibly."""

import contextlib
import dataclasses
import re
from pathlib import Path
from typing import Annotated, Literal

import tyro

from lib.config import UserError


@dataclasses.dataclass
class ModelConfig:
    name: Annotated[str, tyro.conf.arg(aliases=("-m",))] = "outputs/models/tiny"
    """Hugging Face hub id (e.g. Qwen/Qwen3-0.6B) or a local Hugging Face directory (`make tiny` writes one)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and compute dtype; auto = bfloat16 on CUDA, float32 on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to run; auto = CUDA when available."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers."""

    def __post_init__(self):
        if not self.name:
            raise UserError("model.name must not be empty.")


def resolve_device(config: ModelConfig) -> str:
    import torch

    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device == "cuda" and not torch.cuda.is_available():
        raise UserError("model.device is cuda but no CUDA device is visible.")
    return config.device


def resolve_dtype(config: ModelConfig, device: str):
    import torch

    if config.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, config.dtype)


def check_model_name(name: str) -> None:
    """A path-looking name that does not exist is a typo, not a hub id: say so before any heavy work."""
    looks_local = name.startswith((".", "/", "~")) or name.startswith("outputs") or Path(name).exists()
    if looks_local and not (Path(name).expanduser() / "config.json").is_file():
        sft_run = re.search(r"(?:^|/)outputs/([^/]+)/sft/weights/step_\d+/?$", name)
        if sft_run:  # a preset's SFT stage that has not run yet
            hint = f" (run `make sft ENV={sft_run.group(1)}` to create it)"
        else:
            hint = " (run `make tiny` to create it)" if "tiny" in name else ""
        raise UserError(f"model.name {name} is not a Hugging Face model directory{hint}.")


@contextlib.contextmanager
def loading(name: str):
    """Turns transformers' OSError (hub unreachable, no such repo, files missing) into one sentence."""
    try:
        yield
    except OSError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"could not load {name}: {reason.rstrip('.')}") from None


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    with loading(name):
        tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(config: ModelConfig, device: str | None = None):
    """Loads the causal LM in the configured dtype on the configured device, in eval mode; sdpa on a CPU as
    grouped_sdpa."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    check_model_name(config.name)
    device = device or resolve_device(config)
    with loading(config.name):
        model = AutoModelForCausalLM.from_pretrained(
            config.name, dtype=resolve_dtype(config, device), attn_implementation=config.attn_implementation
        )
    if config.attn_implementation == "sdpa" and device == "cpu":
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register("plainrl_grouped_sdpa", grouped_sdpa)
        AttentionMaskInterface.register("plainrl_grouped_sdpa", sdpa_mask)  # without it: no mask at all
        model.set_attn_implementation("plainrl_grouped_sdpa")  # the saved config still says sdpa
    return model.to(device).eval()


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, but with a mask on a grouped-query model SDPA groups the key/value heads
    itself (enable_gqa) instead of getting copies of them: transformers copies them whenever a mask is given,
    since CUDA's fast kernels take no mask with grouped heads, while on a CPU the copy was 15% of the
    builtin engine's decode and the attention 3-4x slower. Same results (tests/test_engine.py)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or key.shape[1] == query.shape[1] or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (B, heads, T, D)
    return out.transpose(1, 2).contiguous(), None  # (B, T, heads, D)


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

    Returns (model, save_dtype, autocast): the weights are saved in the dtype the model is meant to run
    in (bf16 on CUDA by default) and `autocast()` runs the forward in bf16 on CUDA (unless model.dtype
    is float32), a no-op on CPU.
    """
    import contextlib

    import torch

    from lib import dist
    from lib.head import use_chunked_head
    from lib.packing import use_packed_attention

    # bf16 compute on CUDA over float32 master weights, unless float32 was asked for explicitly.
    bf16_compute = device.startswith("cuda") and model_config.dtype != "float32"
    train_config = dataclasses.replace(
        model_config, dtype="float32" if model_config.dtype == "auto" else model_config.dtype
    )
    model = load_model(train_config, device)
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
    use_chunked_head(model)  # training scores tokens without (tokens, vocabulary) logits (lib/head.py)
    model.train()
    if world_size > 1:
        dist.shard(model, bf16=bf16_compute)

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if bf16_compute else contextlib.nullcontext()

    return model, resolve_dtype(model_config, device.split(":")[0]), autocast
