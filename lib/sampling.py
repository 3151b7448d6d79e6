"""Sampling settings shared by rollouts, evaluation and the engine's defaults."""

import dataclasses
from typing import Annotated

import tyro

from lib.config import UserError


@dataclasses.dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Softmax temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = -1
    """Keep only the k most likely tokens (-1 = off)."""
    max_tokens: Annotated[int, tyro.conf.arg(aliases=("--max-tokens",))] = 128
    """Most new tokens per model turn."""
    seed: int | None = None
    """Sampling seed sent with each request (None = random)."""

    def __post_init__(self):
        if self.temperature < 0:
            raise UserError(f"sampling.temperature must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise UserError(f"sampling.top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k == 0 or self.top_k < -1:
            raise UserError(f"sampling.top_k must be -1 (off) or positive, got {self.top_k}.")
        if self.max_tokens < 1:
            raise UserError(f"sampling.max_tokens must be at least 1, got {self.max_tokens}.")
