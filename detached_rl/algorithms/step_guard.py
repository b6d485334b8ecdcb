"""Optimizer steps that never write non-finite numbers into the weights.

A step whose loss (any micro-batch's) or gradient norm (any stepped model's) is NaN or inf is skipped on
every rank alike: the gradients are zeroed, no optimizer step is taken, so weights and optimizer state
(Adam's moments, step count) stay as they were, and the caller leaves its schedule alone. The reason is
reported (`SKIP_REASONS`) so the trainer can count it. Gradients a strategy keeps out of `param.grad`
(ColossalAI's sharded plugins) cannot be checked here; there only the loss is.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from detached_rl.algorithms.metrics import SKIPPED_STEPS, skipped_steps_key
from detached_rl.strategies.base import Strategy

#: The loss of a micro-batch was NaN or inf.
NONFINITE_LOSS = "nonfinite_loss"
#: The gradient norm was NaN or inf (a finite loss whose gradients overflowed, or a NaN gradient).
NONFINITE_GRAD_NORM = "nonfinite_grad_norm"
#: Another data-parallel rank found one of the above; every rank skips together.
OTHER_RANK = "other_rank"
SKIP_REASONS = (NONFINITE_LOSS, NONFINITE_GRAD_NORM, OTHER_RANK)

#: (optimizer, the model it steps, its max_grad_norm) for one optimizer of a step.
OptimizerStep = tuple[torch.optim.Optimizer, nn.Module, float | None]


def grad_norm(model: nn.Module) -> torch.Tensor | None:
    """The L2 norm of the gradients held in `model`'s parameters (None when none holds one)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


def step_unless_nonfinite(
    strategy: Strategy, steps: Sequence[OptimizerStep], losses: Sequence[torch.Tensor]
) -> tuple[list[float], str | None]:
    """Take every optimizer step of `steps`, or none of them when a loss or gradient norm is not finite.

    Returns the gradient norm of each model (before clipping) and the reason the step was skipped (None:
    it was taken). Every rank must call this once per step: the ranks agree before stepping.
    """
    device = strategy.device
    no_grads = torch.zeros((), device=device)
    losses_finite = (torch.stack([loss.detach().reshape(()).float().to(device)
                                  for loss in losses]).isfinite().all()
                     if losses else torch.ones((), dtype=torch.bool, device=device))
    norms = [grad_norm(model) for _, model, _ in steps]
    checked = torch.stack([losses_finite.float(), *(no_grads if norm is None else norm.float().to(device)
                                                    for norm in norms)])
    loss_ok, *norm_values = checked.tolist()  # one device-to-host transfer for all of them
    if not loss_ok:
        reason = NONFINITE_LOSS
    elif not all(math.isfinite(norm) for norm in norm_values):
        reason = NONFINITE_GRAD_NORM
    else:
        reason = None
    if strategy.all_true(reason is None):
        return [strategy.optimizer_step(optimizer, model, max_norm)
                for optimizer, model, max_norm in steps], None
    for optimizer, _, _ in steps:
        strategy.skip_step(optimizer)
    return norm_values, reason or OTHER_RANK


def skip_metrics(skipped: Counter[str]) -> dict[str, float]:
    """A training step's skip counts: the total and one per reason, every key always
    present (ranks reduce alike)."""
    return {SKIPPED_STEPS: float(sum(skipped.values())),
            **{skipped_steps_key(reason): float(skipped[reason]) for reason in SKIP_REASONS}}
