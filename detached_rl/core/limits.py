"""Bounds, names and checks of settings that the configs share with the code that applies them.

Torch-free: the run config (`detached_rl.config`) checks its values with these without loading torch; the
replay buffer, the experience checks, the transfers and the wire use the same ones.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_MAX_ABS_REWARD = 1e4
"""The replay buffer's default bound on |reward| (`TrainerConfig.max_abs_reward`)."""
MAX_ABS_REWARD_LIMIT = 1e8
"""The largest `max_abs_reward` allowed, and `validate`'s default: with it, the largest estimate
(`ESTIMATE_SCALE` times it) squared and summed over a batch's tokens stays far inside float32."""

COMPRESSIONS = ("auto", "zlib", "none")
"""How weight pieces travel (`TrainerConfig.wire_compression`, `detached_rl.core.wire_compression`)."""

FLOAT_DTYPES = ("float32", "float", "float16", "half", "bfloat16", "float64", "double", "float8_e4m3fn",
                "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
"""torch's floating dtypes by the names `getattr(torch, name)` takes (what a maker may cast weights to)."""

WEIGHT_SYNC_KINDS = ("full", "lora")
"""What a trainer syncs (`TrainerConfig.weight_sync`)."""
DEFAULT_MAX_VERSION_JUMP = 1000
"""How many versions a pushed update may move a maker's weights ahead (`MakerConfig.max_version_jump`)."""
DEFAULT_MAX_WEIGHT_CHANGE = 10.0
"""How much a pushed update may change a tensor, relative to it (`MakerConfig.max_weight_change`)."""


def check_max_abs_reward(name: str, value: Any) -> float:
    """`value` as a bound on |reward|: a number in (0, MAX_ABS_REWARD_LIMIT];
    else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_ABS_REWARD_LIMIT:
        raise ValueError(f"{name} must be a number in (0, {MAX_ABS_REWARD_LIMIT:g}], got {value!r}")
    return float(value)


def check_stall_s(name: str, value: Any) -> float:
    """`value` as seconds if a finite number > 0, else a ValueError naming `name`."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_compression(value: str, field: str) -> str:
    """`value` if it is one of `COMPRESSIONS`, else a ValueError naming `field`."""
    if value not in COMPRESSIONS:
        raise ValueError(f"{field} must be one of {COMPRESSIONS}, got {value!r}")
    return value


def check_float_dtype(value: str | None, field: str) -> str | None:
    """`value` if None or a floating torch dtype's name (`FLOAT_DTYPES`); else ValueError naming `field`."""
    if value is not None and value not in FLOAT_DTYPES:
        raise ValueError(f"{field} {value!r} is not a floating torch dtype (one of {FLOAT_DTYPES})")
    return value
