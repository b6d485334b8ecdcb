"""Loss aggregation: how a per-token loss [B, T] becomes the scalar that is differentiated.

Conventions (see ``_common``): ``loss`` and ``mask`` are [B, T]; only valid tokens count; a batch
with no valid token aggregates to 0.
"""

from __future__ import annotations

import torch

from detached_rl.algorithms._common import bool_mask, check_2d, check_choice
from detached_rl.algorithms.masks import masked_mean, masked_sum
from detached_rl.algorithms.registry import LOSS_AGG_MODES


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    max_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar, in one of LOSS_AGG_MODES.

    Conventions: token-mean = sum over valid tokens / their count (0 if none);
    seq-mean-token-sum = per-sequence token sum, mean over non-empty sequences;
    seq-mean-token-mean = per-sequence token mean, mean over non-empty sequences;
    seq-mean-token-sum-norm = per-sequence token sum / max_length (default T = mask.shape[-1], the
    padded length; Dr.GRPO's constant), mean over *all* B sequences. No sequence → 0.
    max_length is only used by seq-mean-token-sum-norm (ignored by the other modes) and must be > 0.
    """
    fn = "aggregate_loss"
    check_2d(fn, "loss", loss)
    m = bool_mask(fn, mask, "loss", loss)
    check_choice(fn, "mode", mode, LOSS_AGG_MODES)
    if max_length is not None and not max_length > 0:
        raise ValueError(f"{fn}: max_length must be > 0, got {max_length}")

    if mode == "token-mean":
        return masked_mean(loss, m)
    non_empty = m.any(dim=-1)
    if mode == "seq-mean-token-sum":
        return masked_mean(masked_sum(loss, m, dim=-1), non_empty)
    if mode == "seq-mean-token-mean":
        return masked_mean(masked_mean(loss, m, dim=-1), non_empty)
    # seq-mean-token-sum-norm
    norm = float(max_length) if max_length is not None else float(m.shape[-1])
    seq_sums = masked_sum(loss, m, dim=-1) / norm
    return seq_sums.sum() / max(m.shape[0], 1)
