"""Verifiable reward functions: plain Python functions of (prompt, response, **metadata).

Each returns a dict with the total under "reward" and its components, the shape
`detached_rl.models.FunctionReward` turns into a batch scorer.
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas as thousands separators allowed), or None.

    The last, not the first: asked "What is a + b?", small models answer "a + b = c".
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return float(matches[-1].replace(",", ""))


def numeric_answer_reward(
    prompt: str, response: str, answer: float, format_weight: float = 0.1, tolerance: float = 1e-6
) -> dict[str, float]:
    """1 for a correct final number (plus `format_weight` for writing any number at all), else 0 / format."""
    if not math.isfinite(answer):
        raise ValueError(f"numeric_answer_reward: answer must be finite, got {answer}")
    value = last_number(response)
    has_number = float(value is not None)
    correct = float(value is not None and abs(value - answer) <= tolerance)
    return {"reward": correct + format_weight * has_number, "correct": correct, "format": has_number}
