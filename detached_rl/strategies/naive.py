"""The naive strategy: one process, on one GPU when there is one, else the CPU."""

from __future__ import annotations

import torch
from torch import nn

from detached_rl.strategies.base import Strategy


def default_device() -> torch.device:
    """The first accelerator if present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class NaiveStrategy(Strategy):
    """Train in this process without any wrapper."""

    name = "naive"

    def __init__(self, device: torch.device | str | None = None, seed: int | None = None) -> None:
        self._device = torch.device(device) if device is not None else default_device()
        if seed is not None:
            torch.manual_seed(seed)

    @property
    def device(self) -> torch.device:
        """Device of the model and batches."""
        return self._device

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move the model to this strategy's device."""
        return model.to(self._device)
