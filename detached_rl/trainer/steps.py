"""What a training step records beside the learner's own metrics, and the hooks around it.

`info_means` (batch means of the samples' numeric `info`), `samples_per_step` (what a step takes from the
buffer, for pacing the makers) and the step callbacks `TrainerCallback` / `PushWhen` of `TrainerCore`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from detached_rl.algorithms.metrics import SKIPPED_STEPS, skipped_steps_key
from detached_rl.algorithms.step_guard import SKIP_REASONS

# A grouped learner's share of the groups a step drew and dropped (GRPO's dynamic sampling): a step takes more
# than `train_batch_size` samples from the buffer, which pacing the makers counts (`_samples_per_step`).
DYNAMIC_SAMPLING_DROPPED = "dynamic_sampling/dropped_fraction"


def info_means(experiences: list[Any]) -> dict[str, float]:
    """Batch means of the numeric `info` entries every sample carries (reward components, "finished"), as
    "info/<key>"."""
    if not experiences:
        return {}
    common = set.intersection(*(set(getattr(e, "info", None) or {}) for e in experiences))
    means = {}
    for key in sorted(common):
        values = [e.info[key] for e in experiences]
        if all(isinstance(v, int | float) for v in values):  # bools count as 0/1
            mean = _finite_mean(values)
            if mean is not None:
                means[f"info/{key}"] = mean
    return means


def _finite_mean(values: list[int | float]) -> float | None:
    """The mean of numbers, or None when one is not a finite float (NaN, inf, an int beyond float's range)."""
    try:
        floats = [float(v) for v in values]
    except OverflowError:
        return None
    if not all(math.isfinite(v) for v in floats):
        return None
    scale = max(abs(v) for v in floats) or 1.0  # scaled: a sum of values near float's limit would overflow
    return math.fsum(v / scale for v in floats) / len(floats) * scale


class TrainerCallback:
    """Step callbacks of a `TrainerCore` (`add_callbacks`); any object with some of these methods will do.

    `step` is the policy version: before the step in `on_step_start`, after it in the others. `on_step_end`
    may add entries to `metrics` (the row `history` keeps). `on_push_start`/`on_push_end` frame a weight push
    of `fit`.
    """

    def on_step_start(self, step: int) -> None:
        """A step is about to draw its batch."""

    def on_step_end(self, step: int, metrics: dict[str, float], batch: list[Any]) -> None:
        """A step trained on `batch`."""

    def on_push_start(self, step: int) -> None:
        """`fit` is about to push the weights of `step`."""

    def on_push_end(self, step: int, metrics: dict[str, float]) -> None:
        """`fit` pushed the weights of `step`; `metrics` are the push's."""


# Decides whether `fit` pushes the weights after a step (given the policy version after it).
PushWhen = Callable[[int], bool]


def samples_per_step(history: Sequence[dict[str, float]], train_batch_size: int) -> int:
    """What a step took from the buffer lately: `train_batch_size`, more where dynamic sampling dropped
    groups (the mean of the recent 8 steps' dropped fraction, at most 3/4)."""
    recent = [history[-i] for i in range(1, min(len(history), 8) + 1)]
    dropped = [row.get(DYNAMIC_SAMPLING_DROPPED, 0.0) for row in recent]
    fraction = min(sum(dropped) / len(dropped), 0.75) if dropped else 0.0
    return math.ceil(train_batch_size / (1.0 - fraction))


def skipped_steps(metrics: dict[str, float] | Any) -> dict[str, int]:
    """Reason -> optimizer steps skipped, from the learner's `train/skipped_steps*` metrics ({}: none)."""
    if not int(metrics.get(SKIPPED_STEPS, 0)):
        return {}
    reasons = {reason: int(metrics.get(skipped_steps_key(reason), 0)) for reason in SKIP_REASONS}
    return {reason: count for reason, count in reasons.items() if count}


def skip_message(step: int, reasons: dict[str, int]) -> str:
    """What `status` says of a step whose optimizer steps were skipped."""
    return (f"step {step}: {sum(reasons.values())} optimizer step(s) skipped ("
            + ", ".join(f"{reason}: {count}" for reason, count in reasons.items())
            + "); weights and optimizer state unchanged")
