"""Samples a maker leaves out of its push because their reward was refused (`rewards.task_reward`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from detached_rl.rewards.task_reward import REFUSED


def refused_rows(components: Sequence[dict[str, Any]],
                 group_size: int) -> tuple[set[int], Counter, str | None]:
    """Rows to leave out (each refused sample and, for GRPO, the rest of its group, whose advantages would be
    measured against a missing member), the count of left-out samples by the group's first refusal reason,
    and the last refusal's detail (None if no sample was refused)."""
    size = max(1, group_size)
    left_out: set[int] = set()
    counts: Counter = Counter()
    detail = None
    for start in range(0, len(components), size):
        rows = range(start, min(start + size, len(components)))
        reasons = [components[row][REFUSED] for row in rows if REFUSED in components[row]]
        if reasons:
            left_out.update(rows)
            counts[reasons[0]] += len(rows)
            detail = next(components[row].get("refused_detail") for row in rows if REFUSED in components[row])
    return left_out, counts, detail
