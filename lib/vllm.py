"""vLLM serving: the `vllm serve` command line (vllm==0.32.0) that speaks the same HTTP dialect as the builtin engine.

What each flag is for:
- `--logprobs-mode processed_logprobs`: logprobs of the distribution actually sampled from (after
  temperature, top-k, top-p), the ones the importance ratio needs.
- `--generation-config vllm`: vLLM's own sampling defaults, not the model's generation_config.json,
  so a request that leaves temperature out means the same on both engines.
- `VLLM_SERVER_DEV_MODE=1` (environment): mounts /pause, /resume, /collective_rpc, /reset_prefix_cache.
- `--enable-scale-out`: mounts /inference/v1/generate (tokens in, tokens out), which the train client
  calls; without it vLLM 0.32 answers 403 there.
- `--max-logprobs`: the same limit as the builtin engine's (vLLM's default is 20).
- `--enable-auto-tool-choice --tool-call-parser hermes`: chat answers to requests that offer tools
  carry the model's `<tool_call>` blocks as OpenAI `tool_calls` (the eval client needs them; the train
  client parses completions itself), as the builtin engine's do.
- LoRA adapters loaded at run time (`max_lora_rank` > 0): `--enable-lora --max-lora-rank R --max-loras 1`
  and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (environment), which mounts /v1/load_lora_adapter. vLLM takes
  only some ranks (LORA_RANKS): R is rounded up to one.
- CPU build: `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache; vLLM's own default is 4), from `cpu_kv_cache_gib`.
- The API key goes in the environment (`VLLM_API_KEY`), which vLLM reads like `--api-key`, so it does
  not show in the process list. vLLM checks it on /v1 and /inference only: its dev routes are open,
  so keep the server on 127.0.0.1 or a private network (the host defaults to 127.0.0.1).
- Multi-node data parallel: the head runs the API server and `--data-parallel-size-local` engines;
  every other node runs `--headless` with its `--data-parallel-start-rank`, all pointing at the head's
  `--data-parallel-address` and `--data-parallel-rpc-port`. The head's API servers send /pause,
  /collective_rpc, /update_weight_version, /reset_prefix_cache and /resume to every engine
  (vllm/v1/engine/core_client.py, `DPLBAsyncMPClient.call_utility_async`), so a reload through the head
  reaches the headless nodes' engines too; `/collective_rpc` answers with the first engine's result only.
  A request's `X-data-parallel-rank: N` header runs it on engine N.
"""

import dataclasses
import importlib.util
import os
import sys

from lib.config import UserError

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks


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
    """CPU build only: GiB of memory for the KV cache (None = vLLM's default, 4)."""
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
) -> list[str]:
    """The `vllm serve` argument list (the API key travels in the environment, see `vllm_environment`)."""
    command = ["vllm", "serve", model]
    if not config.headless:  # a headless node runs engines only: no API server to name, bind or guard
        command += ["--served-model-name", served_model_name, "--host", host, "--port", str(port)]
    command += ["--dtype", dtype, "--seed", str(seed)]
    command += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
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
    command += ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-scale-out"]
    command += ["--max-logprobs", str(max_logprobs), "--worker-extension-cls", "lib.vllm.TiedOutputLayer"]
    if max_lora_rank:
        if max_lora_rank > LORA_RANKS[-1]:
            raise UserError(
                f"vLLM serves LoRA adapters of rank {LORA_RANKS[-1]} at most, not {max_lora_rank}."
            )
        rank = min(r for r in LORA_RANKS if r >= max_lora_rank)
        command += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1"]
    if config.tool_call_parser and not config.headless:  # the API server parses chat answers
        command += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    return command + list(config.extra_args)


class TiedOutputLayer:
    """vLLM worker extension: `/collective_rpc` method `refresh_tied_output_layer`, which sync.py calls after
    every reload of a model whose output layer is its embedding (Qwen3 up to 4B).

    vLLM 0.32's CPU build computes the output layer from a packed copy of its weight, made once the weights
    are loaded; an in-place reload repacks the layers it loaded weights into, and the tied output layer gets
    none (its weight comes with the embedding), so it kept scoring with the first weights. On GPUs the
    output layer reads the embedding's tensor itself and there is nothing to refresh."""

    def refresh_tied_output_layer(self) -> bool:
        model = self.get_model()
        head, embedding = (
            getattr(model, "lm_head", None),
            getattr(getattr(model, "model", None), "embed_tokens", None),
        )
        if head is None or embedding is None or not hasattr(head, "cpu_linear"):
            return False
        head.weight = embedding.weight
        head.quant_method.process_weights_after_loading(head)
        return True


def vllm_environment(
    api_key: str | None,
    config: VllmConfig | None = None,
    base: dict[str, str] | None = None,
    lora: bool = False,
) -> dict[str, str]:
    """The environment `vllm serve` runs in: dev-mode routes on, runtime LoRA loading if `lora`, the API
    key if any, the CPU build's KV cache."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if config is not None and config.cpu_kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu_kv_cache_gib)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def exec_vllm(command: list[str], env: dict[str, str]) -> None:
    """Replaces this process with `vllm serve`, so signals (Ctrl-C, the controller's SIGTERM) reach it directly.

    It runs `python -m lib.vllm serve ...` (this module's `__main__` below) rather than the `vllm`
    command: the same CLI, on the GPU wheel and on the CPU build alike.
    """
    if importlib.util.find_spec("vllm") is None:
        raise UserError(
            "vllm is not installed: pip install -r requirements-vllm.lock (GPU) or run "
            "`make setup-vllm` (CPU build), or use --engine torch."
        )
    os.execve(sys.executable, [sys.executable, "-m", "lib.vllm", *command[1:]], env)


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

    sys.argv[0] = "vllm"
    main()


if __name__ == "__main__":
    run_vllm_cli()
