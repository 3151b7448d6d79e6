"""The policy loss: importance-sampled, token-level, normalised over the whole step."""

import dataclasses
from typing import Literal


@dataclasses.dataclass
class LossConfig:
    variant: Literal["dppo", "ppo", "reinforce"] = "dppo"
    """dppo: mask tokens whose probability moved too far (default); ppo: clipped ratio; reinforce: on-policy."""
    mask_threshold: float = 0.2
    """dppo: mask a token when its probability moved more than this from the inference policy toward adv."""
    log_ratio_coef: float = 1e-3
    """dppo: weight of the (log ratio)^2 penalty."""
    clip_low: float = 0.2
    """ppo: lower clip, ratio >= 1 - clip_low."""
    clip_high: float = 0.28
    """ppo: upper clip, ratio <= 1 + clip_high."""

    def __post_init__(self):
        if not 0 < self.mask_threshold <= 1:
            raise ValueError("loss.mask_threshold must be in (0, 1].")
        if self.log_ratio_coef < 0 or self.clip_low <= 0 or self.clip_high <= 0:
            raise ValueError("loss.log_ratio_coef must be >= 0 and loss.clip_low/clip_high > 0.")
