"""Serves a model over vLLM's HTTP dialect, and takes new weights while it runs.

Two engines behind the same routes (DESIGN §4.1): vLLM on GPUs, and plainrl's builtin PyTorch engine
(lib/engine.py) for CPUs, laptops and tests. `--engine auto` picks vLLM when it is installed and a
GPU is visible, else the builtin engine, and says which.

Usage:
    python scripts/serve.py --model.name outputs/models/tiny --port 8000              # CPU, builtin engine
    python scripts/serve.py --model.name Qwen/Qwen3-0.6B --engine vllm --port 8000    # one GPU
    python scripts/serve.py --model.name Qwen/Qwen3-4B --engine vllm --vllm.data-parallel-size 8
"""

import dataclasses
from pathlib import Path
from typing import Literal

from lib.config import parse
from lib.model import ModelConfig


@dataclasses.dataclass
class VllmConfig:
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may take (lower it when the trainer shares the GPU)."""
    max_model_len: int | None = None
    """Longest sequence vLLM schedules (None = the model's own limit)."""
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
    extra_args: list[str] = dataclasses.field(default_factory=list)
    """Further `vllm serve` flags, passed through unchanged."""


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
    """Require `Authorization: Bearer KEY` on every route, admin routes included."""
    served_model_name: str | None = None
    """Name clients use in `model` (default: model.name)."""
    weights_root: Path = Path("outputs")
    """reload_weights only accepts directories under this root."""
    max_batch_size: int = 64
    """Builtin engine: most sequences decoded together."""
    max_model_len: int | None = None
    """Builtin engine: longest prompt + completion (None = the model's max_position_embeddings)."""
    seed: int = 0
    """Default sampling seed of the engine."""
    vllm: VllmConfig = dataclasses.field(default_factory=VllmConfig)
    """vLLM-only settings."""

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}.")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1.")


def main(cfg: Config) -> None:
    raise SystemExit("serve.py: the server is not built yet.")


if __name__ == "__main__":
    main(parse(Config, description=__doc__))
