"""Serves a model over vLLM's HTTP dialect, and takes new weights while it runs.

Two engines behind the same routes: vLLM on GPUs, and plainrl's builtin PyTorch engine for CPUs,
laptops and tests (the package lib/inference/server/: engine.py, decode.py, protocol.py, routes.py). `--engine
auto` picks vLLM when it is installed and a GPU is visible, else the builtin engine, and logs which.
With vLLM this process becomes `vllm serve` (lib/inference/vllm.py lists its flags); the builtin engine is
served by uvicorn.

Both bind 127.0.0.1 unless --host says otherwise, and take $PLAINRL_API_KEY (or `--api-key`). New weights:
    curl -X POST $URL/pause?mode=wait
    curl -X POST $URL/collective_rpc -d '{"method": "reload_weights", "kwargs": {"weights_path": "outputs/run/weights/step_3"}}'
    curl -X POST $URL/resume

A LoRA adapter (started with --max-lora-rank R; requests then name "policy-adapter" as their model):
    curl -X POST $URL/v1/load_lora_adapter -d '{"lora_name": "policy-adapter", "lora_path": "outputs/run/weights/step_3", "load_inplace": true}'

The builtin engine loads only directories under --weights-root (default outputs/) and reports the
weights' label (POST /update_weight_version) in every /inference/v1/generate choice (`weight_versions`).

Usage:
    python scripts/serve.py --model.name outputs/models/tiny --port 8000              # CPU, builtin engine
    python scripts/serve.py --model.name Qwen/Qwen3-0.6B --engine vllm --port 8000    # one GPU
    python scripts/serve.py --model.name Qwen/Qwen3-4B --engine vllm --vllm.tensor-parallel-size 2 --vllm.data-parallel-size 4
    # two nodes with 4 GPUs each, 8 replicas behind node 1's endpoint: node 1, then node 2
    export PLAINRL_API_KEY=$(cat ~/.plainrl_key)        # a key from a file, never on the command line
    python scripts/serve.py --model.name Qwen/Qwen3-4B --engine vllm --host 0.0.0.0 --vllm.data-parallel-size 8 --vllm.data-parallel-size-local 4 --vllm.data-parallel-address 10.0.0.1 --vllm.data-parallel-rpc-port 13345
    python scripts/serve.py --model.name Qwen/Qwen3-4B --engine vllm --vllm.data-parallel-size 8 --vllm.data-parallel-size-local 4 --vllm.data-parallel-address 10.0.0.1 --vllm.data-parallel-rpc-port 13345 --vllm.headless --vllm.data-parallel-start-rank 4
"""

import dataclasses
import sys
from pathlib import Path
from typing import Literal

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)
from lib.config import UserError, given_api_key, parse, run_main
from lib.inference.vllm import VllmConfig
from lib.models.load import ModelConfig


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model to serve."""
    engine: Literal["auto", "torch", "vllm"] = "auto"
    """vllm, the builtin torch engine, or auto (vLLM if importable and CUDA present)."""
    host: str = "127.0.0.1"
    """Interface to bind; the default keeps the (unauthenticated unless --api-key) server private."""
    port: int = 8000
    """TCP port."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on every route, admin routes included (default: $PLAINRL_API_KEY,
    which keeps the key out of the process list; vLLM gets it in its environment either way)."""
    served_model_name: str | None = None
    """Name clients use in `model` (default: model.name)."""
    weights_root: Path = Path("outputs")
    """reload_weights only accepts directories under this root."""
    max_batch_size: int = 64
    """Most sequences decoded together: the builtin engine, and vLLM's CPU build (--max-num-seqs), whose KV
    cache is sized to hold that many sequences of max_model_len tokens (--vllm.cpu-kv-cache-gib)."""
    max_model_len: int | None = None
    """Longest prompt + completion a request may ask for, both engines (None = the model's own limit)."""
    seed: int = 0
    """Default sampling seed of the engine."""
    max_logprobs: int = 20
    """Most logprobs one request may ask for per token (top_logprobs, logprobs; vLLM: prompt_logprobs too), both engines."""
    max_lora_rank: int = 0
    """Take LoRA adapters of up to this rank at run time (POST /v1/load_lora_adapter, which rl.py's adapter
    sync uses); 0 = off. vLLM: --enable-lora --max-lora-rank (rounded up to a rank vLLM takes) --max-loras 1."""
    return_sampling_mask: bool = False
    """/inference/v1/generate returns each sampled token's kept ids (`sampling_mask`, the ids top-k/top-p
    left), and every request must then sample with temperature > 0 and top_k > 0, both engines. vLLM:
    --return-sampling-mask (Model Runner V2, GPUs only in 0.32)."""
    vllm: VllmConfig = dataclasses.field(default_factory=VllmConfig)
    """vLLM-only settings."""

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise UserError(f"port must be in 1..65535, got {self.port}.")
        if self.max_lora_rank < 0:
            raise UserError("max_lora_rank must be 0 (off) or positive.")
        if self.max_batch_size < 1 or self.max_logprobs < 0:
            raise UserError("max_batch_size must be at least 1 and max_logprobs at least 0.")


def choose_engine(requested: str) -> tuple[str, str]:
    """The engine to run, and why (auto: vLLM when it is installed and a GPU is visible)."""
    if requested != "auto":
        return requested, "--engine " + requested
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        return "torch", "auto: vLLM is not installed"
    if not torch.cuda.is_available():
        return "torch", "auto: no CUDA device is visible"
    return "vllm", "auto: vLLM is installed and CUDA is visible"


# The --vllm.* settings that shape what vLLM serves (replicas, GPUs each, the nodes), which the builtin engine has
# nothing for: it would serve one engine without a word. The memory and weight-transfer ones are not here: rl.py
# passes them to either engine, and the builtin engine sizes its KV cache and takes weights in memory by itself.
VLLM_ONLY = [
    "tensor_parallel_size", "data_parallel_size", "data_parallel_size_local", "data_parallel_address",
    "data_parallel_rpc_port", "data_parallel_start_rank", "headless", "extra_args",
]  # fmt: skip


def vllm_only_flags(vllm: VllmConfig) -> list[str]:
    """The flags of VLLM_ONLY given a value other than their default."""
    default = VllmConfig()
    changed = [name for name in VLLM_ONLY if getattr(vllm, name) != getattr(default, name)]
    return [f"--vllm.{name.replace('_', '-')}" for name in changed]


def serving_dtype(model: ModelConfig) -> str:
    """model.dtype, with auto resolved as the trainer resolves it (lib/models/load.py runs_in_dtype)."""
    from transformers import AutoConfig

    from lib.models.load import resolve_device, runs_in_dtype

    device = resolve_device(model)
    if model.dtype != "auto" or device.startswith("cuda"):
        return runs_in_dtype(model, device, hidden_size=0)
    hidden_size = AutoConfig.from_pretrained(model.name).get_text_config().hidden_size
    return runs_in_dtype(model, device, hidden_size)


def key_warnings(host: str, port: int, api_key: str | None) -> list[str]:
    """What the log says about who can reach the server: the network (a public host), and without a key
    anyone who reaches it, every local user included."""
    warnings = []
    if host not in ("127.0.0.1", "localhost", "::1"):
        warnings.append(f"binding {host}: the admin routes (pause, reload) are reachable from the network.")
    if api_key is None:
        who = f"anyone who can reach {host}:{port}" if warnings else "every local user"
        warnings.append(
            f"no API key ($PLAINRL_API_KEY unset): {who} can use and reload it (README: ~/.plainrl_key)"
        )
    return warnings


def main(cfg: Config) -> None:
    import logging
    import shlex

    from lib.models.load import check_model_name

    # ------------------------------------------------------------ config
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    log = logging.getLogger("serve")
    check_model_name(cfg.model.name)
    api_key = given_api_key(cfg.api_key)
    served_model_name = cfg.served_model_name or cfg.model.name
    engine, reason = choose_engine(cfg.engine)
    if engine == "torch" and (ignored := vllm_only_flags(cfg.vllm)):
        raise UserError(
            f"{', '.join(ignored)} apply to vLLM only, and the builtin engine would serve here ({reason}) "
            "without them: serve with --engine vllm where vLLM and a GPU are, or leave them out."
        )
    for warning in key_warnings(cfg.host, cfg.port, api_key):
        log.warning(warning)
    log.info("engine: %s (%s)", engine, reason)
    # One rule for both engines and the trainer (lib/models/load.py runs_in_dtype): vLLM's own auto would pick
    # for itself, and the two must compare in one dtype.
    dtype = serving_dtype(cfg.model)
    log.info("dtype: %s (--model.dtype %s)", dtype, cfg.model.dtype)

    # ------------------------------------------------------------ vLLM: hand the process over
    if engine == "vllm":
        import torch

        from lib.inference.vllm import exec_vllm, vllm_command, vllm_environment

        if cfg.return_sampling_mask and not torch.cuda.is_available():
            raise UserError(
                "vLLM's CPU build cannot return sampling masks (its Model Runner V2 needs Triton's CPU "
                "backend): serve with --engine torch, or leave --return-sampling-mask off and recompute."
            )

        kv_cache_bytes = max_num_seqs = None
        if not torch.cuda.is_available():  # the CPU build: memory for this model, not 90% of RAM
            import psutil

            from lib.inference.vllm import cpu_kv_cache

            free = psutil.virtual_memory().available
            kv_cache_bytes, plan = cpu_kv_cache(
                cfg.model.name, dtype, cfg.max_model_len, cfg.max_batch_size, cfg.vllm, free
            )
            max_num_seqs = cfg.max_batch_size
            log.info("KV cache: %s", plan)
        command = vllm_command(
            cfg.model.name,
            served_model_name,
            cfg.host,
            cfg.port,
            dtype,
            cfg.seed,
            cfg.vllm,
            cfg.max_logprobs,
            cfg.max_model_len,
            cfg.max_lora_rank,
            cfg.return_sampling_mask,
            cpu_kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs,
        )
        env = vllm_environment(api_key, cfg.vllm, lora=cfg.max_lora_rank > 0, host=cfg.host)
        shown = {k: v for k, v in env.items() if k.startswith(("VLLM_", "GLOO_")) and k != "VLLM_API_KEY"}
        log.info("%s %s", " ".join(f"{k}={v}" for k, v in shown.items()), shlex.join(command))
        exec_vllm(command, env)
        return

    # ------------------------------------------------------------ builtin engine
    import uvicorn

    from lib.inference.server.engine import Engine
    from lib.inference.server.routes import build_app

    served = dataclasses.replace(cfg.model, dtype=dtype)
    engine = Engine(served, cfg.max_batch_size, cfg.max_model_len, cfg.seed)
    app = build_app(
        engine,
        served_model_name,
        api_key,
        cfg.weights_root,
        cfg.max_logprobs,
        cfg.max_lora_rank,
        return_sampling_mask=cfg.return_sampling_mask,
    )
    log.info(
        "serving %s on http://%s:%d/v1 (builtin engine on %s, weights root %s)",
        served_model_name,
        cfg.host,
        cfg.port,
        engine.device,
        cfg.weights_root,
    )
    # On SIGTERM or Ctrl-C, requests still waiting (on a paused engine, say) get 3 s, then their connections
    # close: the clients see an error, not silence, and the server exits.
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=3)


if __name__ == "__main__":
    config = parse(Config, description=__doc__)
    run_main(main, config)
