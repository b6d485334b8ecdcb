"""Helpers shared by the model wrappers: position ids for padded batches, keyword support checks."""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, so left padding does not shift them (as HF generate does)."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 1)


def innermost_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside peft / DDP wrappers."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


@functools.lru_cache(maxsize=64)
def _forward_parameters(cls: type) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def accepts_argument(model: nn.Module, name: str) -> bool:
    """True when the (unwrapped) model's forward takes a keyword `name`."""
    return name in _forward_parameters(type(innermost_model(model)))


def forward_kwargs(model: nn.Module, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """attention_mask plus position_ids when the model takes them."""
    kwargs = {"attention_mask": attention_mask}
    if accepts_argument(model, "position_ids"):
        kwargs["position_ids"] = position_ids_from_mask(attention_mask)
    return kwargs


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every dropout probability to 0, in `nn.Dropout` modules and in float `*dropout*` attributes.

    RL needs a deterministic forward in train mode: the PPO ratio of an unchanged policy
    must be exactly 1, and recomputed log-probs must equal the behaviour log-probs. Some
    architectures (OPT, GPT-2's SDPA path) read dropout from plain float attributes.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)
    return model
