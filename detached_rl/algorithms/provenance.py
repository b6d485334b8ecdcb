"""Sample provenance: was an on-version sample made by the policy it names?

A sample tagged with policy version v and trained at version v ("on-version") was, if honest, sampled
by the trainer's own weights of v, served by the maker's engine: its behaviour log-probs then differ from
the trainer's recompute only by the engine's numerics. `sample_gaps` measures that difference per sample
(the mean over its valid tokens of |recomputed - behaviour|); a sample whose gap is beyond its engine's
honest bound (`ProvenanceConfig.bound_for`, calibrated in docs/performance.md "Provenance") was made by
another policy, or its log-probs were forged, or it is an old sample under a new version: it gets loss
training (`exclude_unproven`), and the trainer counts it against its maker (`trainer/quarantine.py`).

Conventions (see ``_common``): token tensors are ``[B, T]``, ``mask`` marks valid response tokens; a token
whose behaviour or recomputed log-prob is not finite is left out (``finite_token_mask``). A sample with no
valid token has gap 0. Samples of another version (stale ones) are not checked: the trainer holds only its
current weights, and an honest stale sample differs by the policy's drift too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from detached_rl.algorithms._common import check_shape
from detached_rl.algorithms.mismatch import experience_engine, finite_token_mask
from detached_rl.core.experience_batch import ExperienceBatch
from detached_rl.core.sample_checks import ProvenanceConfig


def sample_gaps(behaviour_log_probs: torch.Tensor, recomputed_log_probs: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """Per sample [B]: the mean over its valid tokens of |recomputed - behaviour| (0 with no valid token)."""
    return gaps_and_counts(behaviour_log_probs, recomputed_log_probs, mask)[0]


def gaps_and_counts(behaviour_log_probs: torch.Tensor, recomputed_log_probs: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample [B]: `sample_gaps` and the number of valid tokens it averages."""
    check_shape("sample_gaps", "recomputed_log_probs", recomputed_log_probs, "behaviour_log_probs",
                behaviour_log_probs)
    with torch.no_grad():
        valid = finite_token_mask(mask, behaviour_log_probs, recomputed_log_probs)
        diff = torch.where(valid, (recomputed_log_probs - behaviour_log_probs).abs(),
                           torch.zeros_like(behaviour_log_probs))
        counts = valid.sum(dim=-1)
        return (diff.sum(dim=-1) / counts.clamp(min=1)).float(), counts


def length_scaled_bound(bound: float, tokens: int, min_tokens: int) -> float:
    """`bound` for a sample of `tokens` valid tokens: widened by sqrt(min_tokens / tokens) below `min_tokens`
    (a mean over few tokens is noisier: one bf16 rounding flip weighs a whole 1-token sample)."""
    return bound * math.sqrt(min_tokens / tokens) if 0 < tokens < min_tokens else bound


@dataclass
class ProvenanceVerdicts:
    """A step's checked samples: their rows in the batch, gaps, bounds, makers and which fell outside."""

    rows: list[int]
    gaps: list[float]
    bounds: list[float]
    makers: list[str | None] = field(default_factory=list)

    @property
    def outside(self) -> list[bool]:
        """Per checked row: beyond its bound."""
        return [gap > bound for gap, bound in zip(self.gaps, self.bounds, strict=True)]

    def metrics(self) -> dict[str, float]:
        """`provenance/checked`, `provenance/outside`, `provenance/gap_mean`, `provenance/gap_max`."""
        if not self.rows:
            return {"provenance/checked": 0.0, "provenance/outside": 0.0}
        return {"provenance/checked": float(len(self.rows)), "provenance/outside": float(sum(self.outside)),
                "provenance/gap_mean": sum(self.gaps) / len(self.gaps), "provenance/gap_max": max(self.gaps)}


def check_samples(behaviour_log_probs: torch.Tensor, recomputed_log_probs: torch.Tensor, mask: torch.Tensor,
                  on_version: Sequence[bool], bounds: Sequence[float],
                  min_tokens: int = 1) -> ProvenanceVerdicts:
    """The verdicts on the on-version rows (`on_version[i]`: row i was made with the weights it is trained
    at; `bounds[i]`: its honest bound, widened for samples under `min_tokens`: `length_scaled_bound`)."""
    rows = [i for i, flag in enumerate(on_version) if flag]
    if not rows:
        return ProvenanceVerdicts([], [], [])
    index = torch.tensor(rows, device=behaviour_log_probs.device)
    gaps, counts = gaps_and_counts(behaviour_log_probs[index], recomputed_log_probs[index], mask[index])
    scaled = [length_scaled_bound(float(bounds[row]), int(count), min_tokens)
              for row, count in zip(rows, counts.tolist(), strict=True)]
    return ProvenanceVerdicts(rows, gaps.tolist(), scaled)


def exclude_unproven(config: ProvenanceConfig, batch: ExperienceBatch, recomputed_log_probs: torch.Tensor,
                     experiences: Sequence[Any], staleness: Sequence[int],
                     own_engine: str) -> ProvenanceVerdicts:
    """Check the batch's on-version samples and take those outside their bound out of training: their
    `response_mask` rows become 0, so no loss term, advantage or metric of the step counts them."""
    bounds = [config.bound_for(experience_engine(e.info), own_engine) for e in experiences]
    verdicts = check_samples(batch.log_probs, recomputed_log_probs, batch.response_mask,
                             [s == 0 for s in staleness], bounds, config.min_tokens)
    for row, outside in zip(verdicts.rows, verdicts.outside, strict=True):
        if outside:
            batch.response_mask[row] = 0
    verdicts.makers = [getattr(experiences[row], "maker", None) for row in verdicts.rows]
    return verdicts
