"""The single controller: async GRPO-style RL against verifiers environments, with live weight sync.

Starts (or attaches to) inference servers, keeps groups of rollouts in flight, computes
group-relative advantages, trains with an importance-sampled policy loss, pushes new weights to every
server each step, logs to tensorboard and checkpoints for exact resume (DESIGN §3, §4.4).

Usage:
    python scripts/rl.py @ configs/tiny/rl.toml                                     # CPU
    python scripts/rl.py @ configs/reverse_text/rl.toml                             # one GPU, shared
    python scripts/rl.py @ configs/reverse_text/rl.toml --inference.urls http://h:8000/v1
    torchrun --nproc-per-node 4 scripts/rl.py @ configs/alphabet_sort/rl.toml      # FSDP2 trainer
"""

import dataclasses
from pathlib import Path

from lib.config import parse
from lib.envs import EnvConfig
from lib.loss import LossConfig
from lib.model import LoraConfig, ModelConfig
from lib.optim import OptimConfig
from lib.sampling import SamplingConfig


@dataclasses.dataclass
class InferenceConfig:
    urls: list[str] = dataclasses.field(default_factory=list)
    """Attach to these servers (base URLs ending in /v1); empty = start one with serve.py."""
    api_key: str | None = None
    """Bearer key of the servers (default: $PLAINRL_API_KEY if set)."""
    engine: str = "auto"
    """Engine of the server rl.py starts: auto, torch or vllm."""
    port: int = 8000
    """Port of the server rl.py starts."""
    gpu_memory_utilization: float = 0.3
    """vLLM's share of the GPU when it shares one with the trainer."""
    max_concurrent: int = 64
    """Most episodes in flight at once."""


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy to train (usually an SFT run's weights/step_N)."""
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """The environment."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """Rollout sampling."""
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    """Policy loss."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and schedule."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA (rank 0 = full); servers get merged weights."""
    inference: InferenceConfig = dataclasses.field(default_factory=InferenceConfig)
    """Inference servers."""
    steps: int = 20
    """Optimizer steps."""
    examples_per_step: int = 8
    """Prompts per step; each gets rollouts_per_example episodes."""
    rollouts_per_example: int = 16
    """Group size for the group-relative advantage."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank."""
    max_async_level: int = 1
    """Rollouts may come from a policy at most this many steps old (0 = fully on-policy)."""
    normalize_advantage: bool = False
    """Divide advantages by the group's reward std."""
    output_dir: Path = Path("outputs/rl")
    """Run directory: config.toml, tb/, weights/, checkpoints/, rollouts/."""
    checkpoint_every: int = 10
    """Resumable checkpoint every N steps (and at the end)."""
    keep_weights: int = 3
    """weights/step_N directories kept."""
    sample_every: int = 5
    """Log sample completions to tensorboard every N steps."""
    resume: bool = False
    """Continue from the newest complete checkpoint in output_dir."""
    seed: int = 0
    """Seed of data order and initialisation-time randomness."""

    def __post_init__(self):
        if min(self.steps, self.examples_per_step, self.rollouts_per_example, self.micro_batch_size) < 1:
            raise ValueError(
                "steps, examples_per_step, rollouts_per_example and micro_batch_size must be >= 1."
            )
        if self.rollouts_per_example < 2:
            raise ValueError("rollouts_per_example must be at least 2: a group of one has no advantage.")
        if self.max_async_level < 0:
            raise ValueError("max_async_level must be >= 0.")


def main(cfg: Config) -> None:
    raise SystemExit("rl.py: the RL loop is not built yet.")


if __name__ == "__main__":
    main(parse(Config, description=__doc__))
