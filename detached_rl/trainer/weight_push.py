"""`WeightPushQueue`: a trainer's weight pushes, never waiting for a maker to be between batches.

Per maker, at most one update is in flight (sent, not yet acknowledged) and at most one waits
behind it. A maker acknowledges an update once it has pulled and verified it (it swaps it in at its
next safe point, `WeightReceiver.receive`), so an acknowledgement costs the transfer, not a
generation batch. An update offered while the previous one to that maker is still in flight waits;
a newer one offered before it was sent replaces it (counted in `superseded`), so a slow maker gets
the newest weights next and the trainer never queues more. Plain code over a `send` function that
returns a `concurrent.futures.Future` (the Ray shell passes `handle.apply_weight_update.remote(u).future()`).

The update waiting behind an acknowledged one is sent from the queue's own thread, never from the thread
that completed the future: Ray completes `.future()`s on its core worker's event thread, and a `send`
run there (`ray.get_actor`, a remote call) waits for that very thread, so the actor stopped answering.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from detached_rl.core.weight_sync import ApplyResult, WeightUpdate

Send = Callable[[str, WeightUpdate], "Future[ApplyResult]"]


@dataclass
class _InFlight:
    version: int
    sent_at: float
    future: Future


class WeightPushQueue:
    """Delivers each maker the newest update, one at a time; `offer` never blocks on a maker.

    `timeout`: an update a maker has not acknowledged after this many seconds counts as failed
    for it (a `TimeoutError` result) and the next offer is sent regardless.
    """

    def __init__(self, send: Send, timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not timeout > 0:
            raise ValueError(f"WeightPushQueue: timeout must be > 0 s, got {timeout}")
        self.send = send
        self.timeout = timeout
        self.clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._in_flight: dict[str, _InFlight] = {}
        self._waiting: dict[str, WeightUpdate] = {}
        self._results: dict[str, ApplyResult | BaseException] = {}  # since the last `take_results`
        self.acked: dict[str, int] = {}  # maker -> newest version it acknowledged
        self.sent = 0
        self.superseded = 0  # updates replaced by a newer one before they were sent
        self.failed = 0
        self._dispatcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-push")

    def offer(self, update: WeightUpdate, makers: Iterable[str]) -> None:
        """Send `update` to every maker with nothing in flight; leave it waiting (replacing
        an older one) for the rest."""
        to_send = []
        with self._lock:
            now = self.clock()
            for maker in makers:
                flight = self._in_flight.get(maker)
                if flight is not None and now - flight.sent_at > self.timeout:
                    self._record(maker, TimeoutError(
                        f"maker {maker!r} did not acknowledge weight update v{flight.version} within "
                        f"{self.timeout:.0f} s"))
                    del self._in_flight[maker]
                    flight = None
                if flight is None:
                    self._in_flight[maker] = _InFlight(update.manifest.version, now, Future())
                    to_send.append(maker)
                else:
                    if maker in self._waiting:
                        self.superseded += 1
                    self._waiting[maker] = update
        for maker in to_send:
            self._dispatch(maker, update)

    def _dispatch(self, maker: str, update: WeightUpdate) -> None:
        try:
            future = self.send(maker, update)
        # No actor by that name, a closed connection: that maker's result.
        except BaseException as error:  # noqa: BLE001
            future = Future()
            future.set_exception(error)
        with self._lock:
            flight = self._in_flight.get(maker)
            if flight is None or flight.version != update.manifest.version:
                return  # timed out and replaced meanwhile
            flight.future = future
            self.sent += 1
        future.add_done_callback(lambda done: self._done(maker, update.manifest.version, done))

    def _done(self, maker: str, version: int, future: Future) -> None:
        error = future.exception()
        next_update = None
        with self._lock:
            flight = self._in_flight.get(maker)
            if flight is None or flight.future is not future:
                return  # counted as timed out already
            del self._in_flight[maker]
            self._record(maker, error if error is not None else future.result())
            if error is None:
                self.acked[maker] = max(self.acked.get(maker, -1), version)
            next_update = self._waiting.pop(maker, None)
            if next_update is not None:
                self._in_flight[maker] = _InFlight(next_update.manifest.version, self.clock(), Future())
            self._changed.notify_all()
        if next_update is not None:
            self._dispatcher.submit(self._dispatch, maker, next_update)

    def _record(self, maker: str, result: ApplyResult | BaseException) -> None:
        """Keep `result` as the maker's latest; hold `_lock`."""
        if isinstance(result, BaseException):
            self.failed += 1
        self._results[maker] = result

    def take_results(self) -> dict[str, ApplyResult | BaseException]:
        """Each maker's latest result since the previous call (acknowledgement or error)."""
        with self._lock:
            results, self._results = self._results, {}
        return results

    def wait(self, timeout: float, makers: Iterable[str] | None = None) -> bool:
        """Wait up to `timeout` s until nothing is in flight or waiting (for
        `makers`, default all); True if so."""
        deadline = self.clock() + timeout
        only = None if makers is None else set(makers)
        with self._lock:
            while True:
                busy = sorted(m for m in self._in_flight.keys() | self._waiting.keys() if only is None
                              or m in only)
                if not busy:
                    return True
                remaining = deadline - self.clock()
                if remaining <= 0:
                    for maker in busy:  # give up on them: their results say why
                        flight = self._in_flight.pop(maker, None)
                        self._waiting.pop(maker, None)
                        version = flight.version if flight is not None else "?"
                        self._record(maker, TimeoutError(
                            f"maker {maker!r} did not acknowledge weight update v{version} within "
                            f"{timeout:.0f} s"))
                    return False
                self._changed.wait(min(remaining, 0.5))

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until the sends owed to acknowledged makers' waiting updates have been made."""
        self._dispatcher.submit(lambda: None).result(timeout=timeout)  # one thread, in order: after them

    def forget(self, maker: str) -> None:
        """Stop tracking a maker that is gone."""
        with self._lock:
            self._in_flight.pop(maker, None)
            self._waiting.pop(maker, None)
            self.acked.pop(maker, None)

    def lag(self, version: int, makers: Iterable[str],
            known: Mapping[str, int] | None = None) -> dict[str, int]:
        """Versions each maker's newest acknowledged update (or the version in `known`, if newer) trails
        `version` by; a maker with neither counts as holding version -1."""
        known = known or {}
        with self._lock:
            return {maker: version - max(self.acked.get(maker, -1), known.get(maker, -1)) for maker in makers}

    def stats(self) -> Mapping[str, Any]:
        """Counters and the per-maker state, for `status`."""
        with self._lock:
            return {"sent": self.sent, "superseded": self.superseded, "failed": self.failed,
                    "in_flight": {m: f.version for m, f in self._in_flight.items()},
                    "waiting": {m: u.manifest.version for m, u in self._waiting.items()},
                    "acked": dict(self.acked)}
