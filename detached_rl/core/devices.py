"""Moving tensors between the host and an accelerator: pinned, non-blocking host-to-device copies, and
device scalars read back in one transfer.

A host tensor copied to a CUDA device from pageable memory blocks the host while the copy runs; from
pinned (page-locked) memory the copy is a DMA queued on the current stream (`non_blocking=True`),
ordered before every kernel queued after it. Reading a device scalar (`float(t)`, `.item()`) waits
for the device to finish all queued work, so many of them are read back together.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`: a CPU tensor bound for CUDA goes through pinned memory as a non-blocking copy."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        # The caching host allocator keeps a pinned block alive until the queued copy out of it has run.
        pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
        return pinned.to(device, non_blocking=True)
    return tensor.to(device)


def pin_for(device: torch.device | str | None) -> bool:
    """Whether host buffers that will be copied to `device` should be allocated pinned (CUDA targets)."""
    return device is not None and torch.device(device).type == "cuda"


def host_floats(values: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """Each value as a Python float; 0-d tensors are read back with one transfer per device, not one each."""
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[str]] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(key)
        else:
            out[key] = float(value)
    for keys in by_device.values():
        stacked = torch.stack([values[key].detach().reshape(()).to(torch.float64) for key in keys])  # type: ignore[union-attr]
        out.update(zip(keys, stacked.tolist(), strict=True))
    return {key: out[key] for key in values}
