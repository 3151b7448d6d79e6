"""Supervised warm-up: next-token loss on assistant tokens only, with packing, LoRA and FSDP2.

Data comes from a plainrl taskset (the ideal answers), a local JSONL file (`messages`, or `prompt` +
`completion`), or a Hugging Face dataset id. Writes weights/step_N (Hugging Face format, servable)
and checkpoints/step_N (exact resume) under output_dir.

Usage:
    python scripts/sft.py @ configs/tiny/sft.toml                                  # CPU
    python scripts/sft.py @ configs/reverse_text/sft.toml                          # one GPU
    torchrun --nproc-per-node 8 scripts/sft.py @ configs/reverse_text/sft.toml     # FSDP2 on 8 GPUs
"""

import dataclasses
from pathlib import Path

from lib.config import parse
from lib.envs import EnvConfig
from lib.model import LoraConfig, ModelConfig
from lib.optim import OptimConfig


@dataclasses.dataclass
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The model to fine-tune."""
    data: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """Training data: env.id is a taskset id, a .jsonl path, or a Hugging Face dataset id."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    """LoRA adapters (rank 0 = full fine-tuning); merged into the saved weights."""
    steps: int = 100
    """Optimizer steps."""
    batch_size: int = 32
    """Samples per optimizer step (all ranks together)."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one rank; batch_size / (micro_batch_size * ranks) accumulations."""
    seq_len: int = 4096
    """Tokens per packed row; longer samples are truncated."""
    packing: bool = True
    """Pack several samples per row (no attention across samples)."""
    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    output_dir: Path = Path("outputs/sft")
    """Run directory: config.toml, tb/, weights/, checkpoints/."""
    checkpoint_every: int = 50
    """Write weights and a resumable checkpoint every N steps (and at the end)."""
    keep_checkpoints: int = 2
    """Resumable checkpoints kept (older ones are deleted)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in output_dir."""
    log_every: int = 1
    """Log scalars every N steps."""
    seed: int = 0
    """Seed of initialisation-time randomness and data order."""

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.micro_batch_size < 1 or self.seq_len < 2:
            raise ValueError("steps, batch_size and micro_batch_size must be >= 1 and seq_len >= 2.")
        if self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} is not divisible by micro_batch_size {self.micro_batch_size}."
            )
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise ValueError("checkpoint_every and keep_checkpoints must be at least 1.")


def main(cfg: Config) -> None:
    raise SystemExit("sft.py: training is not built yet.")


if __name__ == "__main__":
    main(parse(Config, description=__doc__))
