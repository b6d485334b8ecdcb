"""Where bfloat16 is native, and the "auto" dtype settings that pick it only there.

A device without native bfloat16 emulates it, at a cost that dwarfs what the narrower dtype saves: on an
AVX2-only AMD EPYC (2 cores, 2026-11-28) a SmolLM2 + LoRA training step under bf16 autocast took 427 s
against 21 s in float32, and a vLLM CPU engine generated 7 tokens/s in bf16 against 33 in float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# CPU features that compute bfloat16 matmuls natively (Linux's names in /proc/cpuinfo).
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpuinfo_value(key: str) -> str | None:
    """The first processor's `key` line of /proc/cpuinfo ("model name", "flags"), or None (not Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where unknown."""
    return frozenset((cpuinfo_value("flags") or "").split())


def native_bfloat16(device: str | torch.device) -> bool:
    """Whether `device` computes bfloat16 natively: a CUDA device that supports it, or a CPU with AVX512-BF16
    or AMX (by Linux's CPU flags; unknown CPUs count as not)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and bool(cpu_flags() & NATIVE_BF16_CPU_FLAGS)


def resolve_auto_dtype(requested: str | None, device: str | torch.device, otherwise: str | None,
                       native: Callable[[str | torch.device], bool] = native_bfloat16) -> str | None:
    """`requested` as given, except "auto": bfloat16 where `device` computes it natively, else `otherwise`."""
    if requested != "auto":
        return requested
    return "bfloat16" if native(device) else otherwise
