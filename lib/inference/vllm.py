"""vLLM serving: the `vllm serve` command line (vllm==0.32.0) that speaks the same HTTP dialect as the builtin engine.

It sits beside the controller's modules, not in lib/inference/server/ (the builtin server): the controller and
serve.py build vLLM's command line from it; what runs inside vLLM's workers is lib/inference/weights/vllm_worker.py. Each
flag's reason is given where vllm_command adds it.

Multi-node data parallel: the head runs the API server and `--data-parallel-size-local` engines; every
other node runs `--headless` with its `--data-parallel-start-rank`, pointing at the head's address and RPC
port. The head's API servers send /pause, /collective_rpc, /update_weight_version, /reset_prefix_cache
and /resume to every engine (vllm/v1/engine/core_client.py, `DPLBAsyncMPClient.call_utility_async`), so
a reload through the head reaches every node; `/collective_rpc` answers with the first engine's result.
"""

import dataclasses
import importlib.util
import json
import os
import socket
import sys
from pathlib import Path

from lib.config import UserError

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks
GIB = 2**30
# The CPU build's KV cache is never smaller than this: room for the prefix cache and for shorter sequences
# beyond the worst case on a small model (the tiny one needs 128 MiB for 64 sequences of 2048 tokens).
CPU_KV_CACHE_FLOOR = GIB // 2


@dataclasses.dataclass
class VllmConfig:
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may take (lower it when the trainer shares the GPU)."""
    tensor_parallel_size: int = 1
    """GPUs per model replica."""
    data_parallel_size: int = 1
    """Model replicas behind one endpoint (all nodes together)."""
    data_parallel_size_local: int | None = None
    """Replicas on this node (multi-node data parallel)."""
    data_parallel_address: str | None = None
    """Address of the head node (multi-node data parallel)."""
    data_parallel_rpc_port: int | None = None
    """RPC port on the head node (multi-node data parallel)."""
    data_parallel_start_rank: int | None = None
    """First data-parallel rank on this node (multi-node, headless nodes)."""
    headless: bool = False
    """Run engines only, no API server (every node but the head)."""
    tool_call_parser: str | None = "hermes"
    """How chat answers' tool calls are parsed (`<tool_call>` JSON: Qwen, Hermes and plainrl's tiny model);
    None turns vLLM's tool parsing off."""
    cpu_kv_cache_gib: int | None = None
    """CPU build only: GiB of memory for the KV cache (None = sized to max_model_len x max_batch_size sequences
    of the model, at least 0.5 GiB, at most half the memory left beside the weights)."""
    weight_transfer_backend: str | None = None
    """The engine weights sent in memory arrive through (--weight-transfer-config): nccl (vLLM's, GPUs) or
    plainrl_gloo (plainrl's, lib/inference/weights/vllm_transfer.py); None = none (weights come from the disk)."""
    extra_args: list[str] = dataclasses.field(default_factory=list)
    """Further `vllm serve` flags, passed through unchanged."""

    def __post_init__(self):
        if not 0 < self.gpu_memory_utilization <= 1:
            raise UserError(
                f"vllm.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise UserError("vllm.tensor_parallel_size and vllm.data_parallel_size must be at least 1.")
        if (
            self.data_parallel_size_local is not None
            and not 0 < self.data_parallel_size_local <= self.data_parallel_size
        ):
            raise UserError("vllm.data_parallel_size_local must be in 1..vllm.data_parallel_size.")
        if self.headless and (self.data_parallel_address is None or self.data_parallel_start_rank is None):
            raise UserError(
                "vllm.headless needs vllm.data_parallel_address and vllm.data_parallel_start_rank."
            )


def vllm_command(
    model: str,
    served_model_name: str,
    host: str,
    port: int,
    dtype: str,
    seed: int,
    config: VllmConfig,
    max_logprobs: int = 20,
    max_model_len: int | None = None,
    max_lora_rank: int = 0,
    return_sampling_mask: bool = False,
    cpu_kv_cache_bytes: int | None = None,
    max_num_seqs: int | None = None,
) -> list[str]:
    """The `vllm serve` argument list (the API key travels in the environment, see `vllm_environment`);
    `cpu_kv_cache_bytes` and `max_num_seqs` for the CPU build (cpu_kv_cache)."""
    command = ["vllm", "serve", model]
    if not config.headless:  # a headless node runs engines only: no API server to name, bind or guard
        command += ["--served-model-name", served_model_name, "--host", host, "--port", str(port)]
    command += ["--dtype", dtype, "--seed", str(seed)]
    command += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    # Given its KV cache's size, the CPU build takes that, not gpu_memory_utilization x all of RAM, which it
    # refused to start without ("Available memory ... is less than desired CPU memory utilization").
    if cpu_kv_cache_bytes is not None:
        command += ["--kv-cache-memory-bytes", str(cpu_kv_cache_bytes)]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    command += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    command += ["--data-parallel-size", str(config.data_parallel_size)]
    optional = {
        "--data-parallel-size-local": config.data_parallel_size_local,
        "--data-parallel-address": config.data_parallel_address,
        "--data-parallel-rpc-port": config.data_parallel_rpc_port,
        "--data-parallel-start-rank": config.data_parallel_start_rank,
    }
    for flag, value in optional.items():
        if value is not None:
            command += [flag, str(value)]
    if config.headless:
        command.append("--headless")
    # processed_logprobs: logprobs of the distribution actually sampled from (after temperature, top-k,
    # top-p), the ones the importance ratio needs. `--generation-config vllm`: vLLM's own sampling defaults,
    # not the model's generation_config.json, so a request that leaves temperature out means the same on
    # both engines. `--enable-scale-out` mounts /inference/v1/generate (tokens in, tokens out), which the
    # train client calls (403 without it). The dev routes (/pause, /collective_rpc, ...) come from
    # VLLM_SERVER_DEV_MODE in vllm_environment.
    command += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-scale-out"]
    # The same logprobs limit as the builtin engine's (vLLM's default is 20).
    command += ["--max-logprobs", str(max_logprobs)]
    # The /collective_rpc methods lib/inference/weights/reload.py calls after a reload, run in each engine (lib/inference/weights/vllm_worker.py).
    command += ["--worker-extension-cls", "lib.inference.weights.vllm_worker.ServedWeights"]
    # Each sampled token's kept ids (`sampling_mask` on /inference/v1/generate), which the trainer renormalises
    # over. vLLM then refuses any request with top_k <= 0 or temperature <= 0; Model Runner V2 only (GPUs).
    if return_sampling_mask:
        command.append("--return-sampling-mask")
    # The weight-transfer routes' engine (lib/inference/weights/transfer.py); plainrl_gloo is registered in every vLLM process by
    # the vllm.general_plugins entry point, and by the worker extension's import (lib/inference/weights/vllm_worker.py) too.
    if config.weight_transfer_backend:
        command += ["--weight-transfer-config", json.dumps({"backend": config.weight_transfer_backend})]
    # LoRA adapters loaded at run time (/v1/load_lora_adapter, mounted by VLLM_ALLOW_RUNTIME_LORA_UPDATING);
    # vLLM takes only some ranks, so the rank is rounded up to one.
    if max_lora_rank:
        if max_lora_rank > LORA_RANKS[-1]:
            raise UserError(
                f"vLLM serves LoRA adapters of rank {LORA_RANKS[-1]} at most, not {max_lora_rank}."
            )
        rank = min(r for r in LORA_RANKS if r >= max_lora_rank)
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]
    # Chat answers to requests that offer tools carry the model's `<tool_call>` blocks as OpenAI
    # `tool_calls` (the eval client needs them; the train client parses completions itself), as the builtin
    # engine's do. Only the API server parses chat answers.
    if config.tool_call_parser and not config.headless:
        command += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    return command + list(config.extra_args)


def cpu_kv_cache(
    model: str, dtype: str, max_model_len: int | None, max_num_seqs: int, config: VllmConfig, available: int
) -> tuple[int, str]:
    """(bytes, how they were chosen) of the CPU build's KV cache for `model` served in `dtype`, with `available`
    bytes of free memory: config.cpu_kv_cache_gib if set, else max_num_seqs sequences of max_model_len tokens
    (CPU_KV_CACHE_FLOOR at least, half of what the weights leave at most, one sequence always: vLLM needs
    that). A UserError when the weights and that cache do not fit in `available`."""
    local = Path(model) / "config.json"
    if local.is_file():  # read as JSON: importing transformers here costs seconds before vLLM's own import
        model_config = json.loads(local.read_text())
    else:
        from transformers import AutoConfig

        from lib.models.load import loading

        with loading(model):
            model_config = AutoConfig.from_pretrained(model).to_dict()
    text = model_config.get("text_config") or model_config
    max_model_len = max_model_len or text["max_position_embeddings"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    element = 4 if dtype == "float32" else 2
    per_token = 2 * text["num_hidden_layers"] * kv_heads * head_dim * element  # keys and values
    weights = sum(path.stat().st_size for path in Path(model).glob("*.safetensors"))  # 0 for a hub id
    spare = available - weights
    one_sequence = per_token * max_model_len
    if config.cpu_kv_cache_gib is not None:
        size, how = config.cpu_kv_cache_gib * GIB, "--vllm.cpu-kv-cache-gib"
    else:
        wanted = max(CPU_KV_CACHE_FLOOR, per_token * max_model_len * max_num_seqs)
        size = max(one_sequence, min(wanted, spare // 2))
        how = f"{max_num_seqs} sequences of {max_model_len} tokens at {per_token / 1024:.1f} KiB a token"
        if size < wanted:
            how += f", cut to {size // one_sequence} such sequences by the memory free"
    if size > spare or size < one_sequence:
        raise UserError(
            f"vLLM's CPU build cannot start: {model} needs {weights / GIB:.2f} GiB of weights and "
            f"{max(size, one_sequence) / GIB:.2f} GiB of KV cache ({how}; one sequence of {max_model_len} "
            f"tokens takes {one_sequence / GIB:.2f} GiB), but {available / GIB:.2f} GiB of memory is free: lower "
            "--max-model-len, --max-batch-size or --vllm.cpu-kv-cache-gib, or free memory"
        )
    plan = f"{size / GIB:.2f} GiB ({how}) beside {weights / GIB:.2f} GiB of weights, {available / GIB:.2f} GiB free"
    return size, plan


def vllm_environment(
    api_key: str | None,
    config: VllmConfig | None = None,
    base: dict[str, str] | None = None,
    lora: bool = False,
    host: str | None = None,
) -> dict[str, str]:
    """The environment `vllm serve` runs in: dev-mode routes on, runtime LoRA loading if `lora`, the API
    key if any, the CPU build's KV cache, and for a server on `host` with every engine here (all_here), gloo
    on the loopback interface."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if config is not None and config.cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gib)  # CPU build: GiB of KV cache
    if api_key:
        # Read like --api-key, but absent from the process list. vLLM checks it on /v1 and /inference only:
        # its dev routes stay open, so the server binds 127.0.0.1 unless told otherwise.
        env["VLLM_API_KEY"] = api_key
    interface = loopback_interface() if host is not None and all_here(host, config or VllmConfig()) else None
    if interface:
        # gloo's default listener binds the address this machine's name resolves to (torch 2.13), beyond
        # loopback on many machines, and vLLM's CPU build joins every group of its engines over gloo.
        env.setdefault("GLOO_SOCKET_IFNAME", interface)
    return env


def all_here(host: str, config: VllmConfig) -> bool:
    """Whether a server on `host` has every peer its engines could talk to on this machine's loopback: its
    API on loopback (so is the trainer: lib/inference/weights/transfer.py rendezvous_address), its data
    parallel head too, and no nodes of vLLM's own (--nnodes)."""
    from lib.inference.weights.group import is_loopback

    head = config.data_parallel_address
    return is_loopback(host) and (head is None or is_loopback(head)) and "--nnodes" not in config.extra_args


def loopback_interface() -> str | None:
    """The name of this machine's loopback network interface (lo on Linux), None when none is found."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses):
            return name
    return None


def exec_vllm(command: list[str], env: dict[str, str]) -> None:
    """Replaces this process with `vllm serve`, so signals (Ctrl-C, the controller's SIGTERM) reach it directly.

    It runs `python -m lib.inference.vllm serve ...` (this module's `__main__` below) rather than the `vllm`
    command: the same CLI, on the GPU wheel and on the CPU build alike.
    """
    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "vllm is not installed: pip install -r requirements-vllm.lock (GPU) or run "
            "`make setup-vllm` (CPU build), or use --engine torch."
        )
    os.execve(sys.executable, [sys.executable, "-m", "lib.inference.vllm", *command[1:]], env)


def run_vllm_cli() -> None:
    """vLLM's own command line (`vllm serve ...`), whichever distribution installed the package.

    The CPU build installs as `vllm-cpu`, and the `vllm` command's `--version` option looks up the
    distribution `vllm` when it builds its parser, so that command fails there before it starts.
    That lookup is answered as vLLM's platform detection answers it for itself: the CPU build's
    version with a `+cpu` suffix (which is also what makes vLLM pick its CPU platform).
    """
    import importlib.metadata

    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    from lib.inference.weights.vllm_transfer import register

    register()  # as the vllm.general_plugins entry point does, for a checkout that is not installed

    sys.argv[0] = "vllm"
    main()


if __name__ == "__main__":
    run_vllm_cli()
