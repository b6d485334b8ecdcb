"""`RequestBatcher`: requests from many threads (one per maker call) merged into
batches for one worker thread."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from detached_rl.scorer.requests import ScoreAnswer, ScoreRequest


class RequestBatcher:
    """Merges requests submitted from many threads; one worker thread answers them in batches.

    A batch closes when it holds `max_batch_rows` rows or the oldest request has waited
    `max_wait_s`. A request larger than `max_batch_rows` runs alone. If `answer` raises, every
    request of that batch gets the error.
    """

    def __init__(self, answer: Callable[[list[ScoreRequest]], list[ScoreAnswer]], max_batch_rows: int = 64,
                 max_wait_s: float = 0.01) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"RequestBatcher: max_batch_rows must be >= 1, got {max_batch_rows}")
        if not max_wait_s >= 0 or math.isinf(max_wait_s):
            raise ValueError(f"RequestBatcher: max_wait_s must be a finite number >= 0, got {max_wait_s}")
        self._answer = answer
        self.max_batch_rows = max_batch_rows
        self.max_wait_s = max_wait_s
        self._pending: list[tuple[ScoreRequest, Future, float]] = []
        self._condition = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="scorer-batcher", daemon=True)
        self._worker.start()

    def submit(self, request: ScoreRequest) -> Future:
        """Queue a request; the future resolves to its `ScoreAnswer`."""
        request.validate()  # refuse a malformed request here, so it never spoils a merged batch
        future: Future = Future()
        with self._condition:
            if self._closed:
                raise RuntimeError("RequestBatcher is closed")
            self._pending.append((request, future, time.monotonic()))
            self._condition.notify_all()
        return future

    def close(self) -> None:
        """Answer what is queued, then stop the worker."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._worker.join(timeout=60)

    def _take_batch(self) -> list[tuple[ScoreRequest, Future, float]]:
        with self._condition:
            while True:
                if self._pending:
                    rows = sum(r.size for r, _, _ in self._pending)
                    waited = time.monotonic() - self._pending[0][2]
                    if rows >= self.max_batch_rows or waited >= self.max_wait_s or self._closed:
                        break
                    self._condition.wait(self.max_wait_s - waited)
                elif self._closed:
                    return []
                else:
                    self._condition.wait()
            batch, rows = [], 0
            while self._pending and (not batch or rows + self._pending[0][0].size <= self.max_batch_rows):
                item = self._pending.pop(0)
                batch.append(item)
                rows += item[0].size
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                return
            try:
                answers = self._answer([request for request, _, _ in batch])
            except Exception as error:  # noqa: BLE001 - every caller of the batch gets it
                for _, future, _ in batch:
                    future.set_exception(error)
                continue
            for (_, future, _), answer in zip(batch, answers, strict=True):
                future.set_result(answer)
