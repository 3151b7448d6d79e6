"""Optimizer and learning-rate schedule: AdamW with constant, linear or cosine decay after a linear warm-up."""

import dataclasses
import math
from typing import Literal

from lib.config import UserError


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.999
    """AdamW second-moment decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, down to min_lr_ratio * lr at the last step."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to lr; one as long as the run or longer is cut to a tenth of the run."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of lr (linear and cosine)."""

    def __post_init__(self):
        if self.lr <= 0:
            raise UserError(f"optim.lr must be positive, got {self.lr}.")
        if self.warmup_steps < 0 or self.max_grad_norm < 0 or self.weight_decay < 0:
            raise UserError("optim.warmup_steps, optim.max_grad_norm and optim.weight_decay must be >= 0.")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserError("optim.min_lr_ratio must be in [0, 1].")


def warmup_steps(config: OptimConfig, total_steps: int) -> int:
    """The warm-up the run takes: config.warmup_steps, or a tenth of the run when that is not shorter than the
    run (a preset's warm-up kept by a shortened run would never reach the peak, nor decay)."""
    return config.warmup_steps if config.warmup_steps < total_steps else total_steps // 10


def lr_factor(config: OptimConfig, step: int, total_steps: int) -> float:
    """Multiplier of config.lr at `step` (0-based)."""
    warmup = warmup_steps(config, total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if config.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup - 1))
    if config.schedule == "linear":
        decay = 1.0 - progress
    elif config.schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise UserError(f"unknown schedule {config.schedule}")
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def build_optimizer(params, config: OptimConfig, total_steps: int):
    """AdamW plus a LambdaLR scheduler stepping once per optimizer step (a warm-up cut to fit says so)."""
    import torch

    from lib.log import say

    if warmup_steps(config, total_steps) != config.warmup_steps:
        say(
            f"optim.warmup_steps {config.warmup_steps} is not shorter than the run ({total_steps} steps): "
            f"warming up over {warmup_steps(config, total_steps)} steps instead"
        )

    trainable = [p for p in params if p.requires_grad]
    # On a CPU torch's default AdamW loops over tensors in several passes each: the fused kernel takes one,
    # 0.15 against 0.99 CPU seconds a step for SmolLM2-135M's weights on one thread (docs/benchmarks.md).
    fused = bool(trainable) and all(p.device.type == "cpu" for p in trainable)
    optimizer = torch.optim.AdamW(
        trainable,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        weight_decay=config.weight_decay,
        fused=fused or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(config, step, total_steps)
    )
    return optimizer, scheduler


def optimizer_step(optimizer, scheduler, max_grad_norm: float) -> tuple[float, float]:
    """Clips the global norm of the optimizer's gradients to max_grad_norm (0 = no clipping), steps the
    optimizer and the schedule and clears the gradients; returns the norm before clipping and the step's
    learning rate."""
    import torch

    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    # FSDP2 returns a DTensor sharded over the ranks; its full value is the global norm on every rank.
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    lr = scheduler.get_last_lr()[0]
    optimizer.step()  # parameters without a gradient (a step with no signal) are left as they are
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), lr
