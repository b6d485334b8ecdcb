"""Input checks and constants shared by the math modules (private).

Conventions of every math module in this package:

* Token-level tensors are shaped ``[batch, response_len]`` (``[B, T]``) unless a function says otherwise.
* ``mask`` marks valid response tokens: nonzero / ``True`` is valid, ``0`` / ``False`` is padding.
  Bool and float (0/1) masks are both accepted.
* Values at masked positions never leak into a result, even when they are NaN or inf: they are
  removed with ``torch.where`` (never by multiplying with the mask), and masked positions of a
  token-level output are 0.
* Every new tensor is created on the device (and, for floating results, the dtype) of the inputs.
* Bad input raises ``ValueError`` whose message starts with the function name and names the argument.
"""

from __future__ import annotations

import torch

# Log-ratios are clamped to this range before exp() so that a ratio never overflows.
LOG_RATIO_CLAMP = 20.0


def check_shape(fn: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Refuse `t` unless it has `ref`'s shape."""
    if t.shape != ref.shape:
        raise ValueError(f"{fn}: {name} shape {tuple(t.shape)} != {ref_name} shape {tuple(ref.shape)}")


def check_2d(fn: str, name: str, t: torch.Tensor) -> None:
    """Refuse `t` unless it is [batch, response_len]."""
    if t.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2-D [batch, response_len], got shape {tuple(t.shape)}")


def bool_mask(fn: str, mask: torch.Tensor, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """Check that mask has ref's shape and return it as a bool tensor (nonzero = valid)."""
    check_shape(fn, "mask", mask, ref_name, ref)
    return mask if mask.dtype == torch.bool else mask != 0


def check_choice(fn: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    """Refuse `value` unless it is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{fn}: unknown {name} {value!r}; expected one of {choices}")
