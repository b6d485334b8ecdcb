"""The learner's additions for open-instruct: ratio variance, batch lengths, Polyak update, metric names."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from detached_rl.algorithms import metrics as names
from detached_rl.algorithms.grpo import LOG_RATIO_CLAMP, GRPOLearner
from detached_rl.compat.open_instruct.config import KL_ESTIMATORS
from detached_rl.core.experience import Experience


class SequenceRatioStats:
    """Token-weighted variance over sequences of each one's mean new/old ratio (open-instruct's ratio_var)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget what was added (once per step)."""
        self._sums: list[torch.Tensor] = []  # [tokens, tokens * mean, tokens * mean^2] per call, float64

    def add(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        """Add a micro-batch's sequences [B, T] (the ratio clamped as the policy loss clamps it)."""
        with torch.no_grad():
            valid = mask.bool()
            log_ratio = (log_probs.detach() - old_log_probs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            ratio = torch.where(valid, log_ratio.exp(), torch.zeros_like(log_ratio)).double()
            tokens = valid.sum(-1).double()
            means = ratio.sum(-1) / tokens.clamp(min=1)
            self._sums.append(torch.stack([tokens.sum(), (tokens * means).sum(),
                                           (tokens * means.square()).sum()]))

    def variance(self) -> float:
        """The variance of what was added (0 without tokens)."""
        if not self._sums:
            return 0.0
        tokens, first, second = torch.stack(self._sums).sum(0).tolist()
        if tokens <= 0:
            return 0.0
        mean = first / tokens
        return max(second / tokens - mean * mean, 0.0)

    def observe(self, loss: Callable[..., Any]) -> Callable[..., Any]:
        """`loss` (a registered policy loss), recording each call's ratios first; its result is unchanged."""

        @functools.wraps(loss)
        def observed(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.add(log_probs, old_log_probs, mask)
            return loss(log_probs, old_log_probs, advantages, mask, *args, **kwargs)

        return observed


class ObservedGRPOLearner(GRPOLearner):
    """`GRPOLearner` that also reports `val/ratio_var` and keeps the last batch's lengths (for the driver)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ratio_stats = SequenceRatioStats()
        self.add_ratio_observer(self.ratio_stats.add)
        self.last_prompt_lengths: list[int] = []
        self.last_response_lengths: list[int] = []
        # Prompt + response tokens of every sample (what the forward passes see).
        self.last_sequence_tokens = 0

    def train_step(self, experiences: list[Experience],
                   policy_version: int | None = None) -> dict[str, float]:
        """`GRPOLearner.train_step`, plus `val/ratio_var` (reduced across ranks with the other metrics)."""
        self.ratio_stats.reset()
        self.last_prompt_lengths, self.last_response_lengths = batch_lengths(experiences)
        self.last_sequence_tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in experiences)
        metrics = super().train_step(experiences, policy_version)
        metrics[names.RATIO_VAR] = self.ratio_stats.variance()
        return metrics


def batch_lengths(experiences: Sequence[Experience]) -> tuple[list[int], list[int]]:
    """Prompt lengths (one per group, i.e. per prompt) and response lengths (one per sample)."""
    seen: set[str] = set()
    prompts = []
    for experience in experiences:
        group = experience.group_id if experience.group_id is not None else f"single:{experience.id}"
        if group not in seen:
            seen.add(group)
            prompts.append(len(experience.prompt_ids))
    return prompts, [len(e.response_ids) for e in experiences]


def polyak_update_ref_policy(learner: GRPOLearner, alpha: float) -> bool:
    """ref <- alpha * policy + (1 - alpha) * ref; False (nothing done) without a reference or alpha <= 0."""
    if learner.reference is None or alpha <= 0:
        return False
    learner.update_ref_policy(alpha)
    return True


def open_instruct_step_metrics(metrics: Mapping[str, float], beta: float, kl_kind: str) -> dict[str, float]:
    """A step's metrics with open-instruct's names and meanings added: `lr`, `optim/grad_norm`, the KL as
    `objective/kl<j>_avg` and `loss/kl_avg` = beta x KL (open-instruct logs the KL term with its
    coefficient)."""
    out = dict(metrics)
    for theirs, ours in names.OPEN_INSTRUCT_ALIASES.items():
        if ours in metrics:
            out[theirs] = metrics[ours]
    index = {kind: j for j, kind in KL_ESTIMATORS.items()}.get(kl_kind)
    if names.LOSS_KL in metrics and index is not None:
        out[f"objective/kl{index}_avg"] = metrics[names.LOSS_KL]
        out[names.LOSS_KL] = beta * metrics[names.LOSS_KL]
    return out


def matmul_dtype(learner: GRPOLearner) -> str:
    """The dtype of the learner's matmuls: its autocast dtype in use, else the policy's bf16/fp16, else
    float32."""
    return learner.matmul_dtype()
