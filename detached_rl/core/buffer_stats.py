"""What the replay buffer reports of its samples: reward statistics (`stats`) and sample rows (`peek`)."""

from __future__ import annotations

import copy
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

from detached_rl.core.experience import Experience


def summary(values: list[float]) -> dict[str, float | None]:
    """Mean, std, min and max; never raises and stays finite for any finite values (1e308s included)."""
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None}
    if not all(math.isfinite(v) for v in values):  # only an unvalidated (restored) state can hold these
        return {"mean": math.nan, "std": math.nan, "min": min(values, key=_nan_last),
                "max": max(values, key=_nan_first)}
    try:
        mean, std = statistics.fmean(values), statistics.pstdev(values)
    except OverflowError:  # sums of values near the float64 limit: scaled into [-1, 1] first
        scale = max(abs(v) for v in values)
        scaled = [v / scale for v in values]
        mean, std = statistics.fmean(scaled) * scale, min(statistics.pstdev(scaled) * scale,
                                                          sys.float_info.max)
    return {"mean": mean, "std": std, "min": min(values), "max": max(values)}


def describe(exp: Experience, score: float, uses: int,
             decode: Callable[[list[int]], str] | None) -> dict[str, Any]:
    """One `peek` row: the sample's tags, lengths, score, info and uses; its texts when `decode` is given."""
    row: dict[str, Any] = {
        "id": exp.id,
        "maker": exp.maker,
        "policy_version": exp.policy_version,
        "group_id": exp.group_id,
        "score": score,
        "prompt_length": int(exp.prompt_ids.numel()),
        "response_length": exp.response_length,
        "info": copy.deepcopy(exp.info),
        "uses": uses,
    }
    if decode is not None:
        row["prompt_text"] = decode(exp.prompt_ids.tolist())
        row["response_text"] = decode(exp.response_ids.tolist())
    return row


def _nan_last(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _nan_first(value: float) -> float:
    return -math.inf if math.isnan(value) else value
