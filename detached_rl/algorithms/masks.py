"""Masked statistics over token-level tensors: sum, mean, whitening, and spreading sequence values over
tokens.

Conventions (see ``_common``): ``mask`` has ``x``'s shape, nonzero = valid; masked entries are dropped
with ``torch.where`` so NaN/inf there never leaks; ``dim=None`` reduces over every position, an int
reduces along that dimension (``-1``: per sequence).
"""

from __future__ import annotations

import torch

from detached_rl.algorithms._common import bool_mask, check_2d

# Added to the variance in masked_whiten.
_WHITEN_EPS = 1e-8


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over valid positions (all of them, or per slice along ``dim``).

    Conventions: mask has x's shape; masked entries are dropped with torch.where, so NaN/inf there
    does not leak; an empty slice sums to 0.
    """
    m = bool_mask("masked_sum", mask, "x", x)
    kept = torch.where(m, x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over valid positions (all of them, or per slice along ``dim``).

    Conventions: mask has x's shape; masked entries are dropped with torch.where; a slice (or the
    whole tensor, when dim is None) with no valid position gives 0, not NaN.
    """
    m = bool_mask("masked_mean", mask, "x", x)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8), with mean and variance taken over the valid tokens.

    Conventions: one mean and one *unbiased* variance (divisor n - 1) over all valid tokens of the
    whole batch, not per sequence; with shift_mean=False the mean is added back (only the scale
    changes); masked positions are returned as 0. Fewer than 2 valid tokens raises ValueError.
    """
    m = bool_mask("masked_whiten", mask, "x", x)
    n = int(m.sum())
    if n < 2:
        raise ValueError(
            f"masked_whiten: mask has {n} valid token(s); need at least 2 for an unbiased variance"
        )
    mean = masked_sum(x, m) / n
    var = masked_sum((x - mean) ** 2, m) / (n - 1)
    whitened = (x - mean) * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros_like(whitened))


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread per-sequence values [N] over tokens: [N, T] with the sequence's value at valid tokens.

    Conventions: mask is [N, T]; masked positions are 0; dtype and device follow ``advantages``.
    """
    fn = "broadcast_to_tokens"
    if advantages.dim() != 1:
        raise ValueError(f"{fn}: advantages must be 1-D [N], got shape {tuple(advantages.shape)}")
    check_2d(fn, "mask", mask)
    if mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"{fn}: mask shape {tuple(mask.shape)} does not match advantages shape {tuple(advantages.shape)}"
        )
    m = mask if mask.dtype == torch.bool else mask != 0
    expanded = advantages.unsqueeze(-1).expand(mask.shape)
    return torch.where(m, expanded, torch.zeros_like(expanded))
