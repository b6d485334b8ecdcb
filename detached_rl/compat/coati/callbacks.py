"""coati's callback hooks and its `eval_performance` timer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)


class Callbacks:
    """Calls coati's callback hooks on every callback that has them (a missing hook is a no-op)."""

    def __init__(self, callbacks: Iterable[Any]) -> None:
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for callback in self.callbacks:
                method = getattr(callback, hook, None)
                if method is not None:
                    method(*args)
        return call


class PerformanceEvaluator:
    """`eval_performance=True`: times batches; logs their count and mean time when the loop or fit ends."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.batches = 0
        self.seconds = 0.0
        self._start: float | None = None

    def on_batch_start(self) -> None:
        """Start timing a batch."""
        self._start = time.perf_counter()

    def on_batch_end(self, *args: Any) -> None:
        """Stop timing a batch."""
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.batches += 1
            self._start = None

    def summary(self) -> dict[str, float]:
        """Batches timed and their mean duration."""
        return {"batches": float(self.batches), "seconds_per_batch": self.seconds / max(self.batches, 1)}

    def _log(self) -> None:
        logger.info("%s performance: %s", self.role, self.summary())

    on_fit_end = on_loop_end = _log
