"""Optimizer and learning-rate schedule settings (nothing hard-coded in the trainers)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class OptimizerConfig:
    """AdamW settings and a warm-up + decay schedule for one model."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    eps: float = 1e-8
    schedule: str = "constant"
    warmup_steps: int = 0
    # Optimizer steps the linear / cosine decay spans (after warm-up it stays at min_lr_ratio); None in a
    # RunConfig: its run.steps (one optimizer step per training step, the main job's).
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig.lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0:
            raise ValueError(f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"OptimizerConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"OptimizerConfig.total_steps must be >= 1 or None, got {self.total_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"OptimizerConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"OptimizerConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of `lr` at optimizer step `step` (0-based): linear warm-up, then the decay."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        if self.total_steps is None:
            raise ValueError(f"OptimizerConfig.total_steps is required by the {self.schedule!r} schedule "
                             "(a RunConfig sets it to run.steps)")
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        decay = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


def build_optimizer(
    parameters: list[torch.nn.Parameter], config: OptimizerConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `parameters` and its schedule (call `scheduler.step()` after each optimizer step)."""
    import torch  # here, not at the top: `OptimizerConfig` is part of the run config, which loads no torch

    if not parameters:
        raise ValueError("build_optimizer: no trainable parameters")
    config.lr_factor(config.warmup_steps)  # a decaying schedule without its length is refused here
    optimizer = torch.optim.AdamW(
        parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, eps=config.eps
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, config.lr_factor)
