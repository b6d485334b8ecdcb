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

Slow or dead (`progress`, `stall_timeout`): a push is not failed for taking long while the maker receives
it. A watch thread of the queue's own (`check`, never Ray's callback thread) asks a maker whose push is
older than the stall interval for its transfer's progress (`progress(maker)`: a future of the maker's
answer). Bytes still arriving (any transfer of the maker's: a push may wait behind its registration's) ->
keep waiting; a transfer without progress for the stall interval, or no answer within it -> the push
failed (`TransferStalled` naming update, maker, host, bytes and rate) and the waiting update, if any, is
sent. A maker that answers but receives nothing (the push waits for its intake thread or generation lock)
is bounded by `timeout`, measured from the send. Without `progress`, `timeout` bounds every push.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from detached_rl.core.transfer import TransferStalled, check_stall_s, describe_answer
from detached_rl.weights.liveness import MakerLiveness
from detached_rl.weights.relay import RelayPlanner, routes
from detached_rl.weights.update import ApplyResult, WeightUpdate

logger = logging.getLogger(__name__)

# (maker, update) -> a future of its `ApplyResult`.
Send = Callable[[str, WeightUpdate], "Future[ApplyResult]"]
# (relay, update, its host) -> the relay's streaming copy of `update`, for the makers it relays to
# (`weights.relay`).
RelayCopy = Callable[[str, WeightUpdate, str], WeightUpdate]
# maker -> a future of its transfer progress: {"host", "version", "done", "total", "seconds", "idle_s"}
# (version None: it receives nothing now).
Progress = Callable[[str], "Future[Mapping[str, Any] | None]"]
Locate = Callable[[str], "str | None"]  # maker -> the IP of its node, None if unknown
# Delivers an update to the named makers and returns each one's result (an `ApplyResult` or the error).
SendUpdate = Callable[[WeightUpdate, list[str]], Mapping[str, Any]]


@dataclass(frozen=True)
class _Offer:
    """What a maker is to be sent: `update`, which is relay `via`'s copy of the trainer's `original`."""

    update: WeightUpdate
    via: str | None = None
    original: WeightUpdate | None = None


@dataclass
class _InFlight:
    version: int
    sent_at: float
    future: Future
    kind: str = "?"
    offer: _Offer | None = None
    seen: float = 0.0  # the last time the maker was seen receiving (or alive, when it receives nothing)
    query: Future | None = None  # a progress question not yet answered
    asked_at: float = 0.0
    last: Mapping[str, Any] = field(default_factory=dict)  # the maker's last answer about a transfer


class WeightPushQueue:
    """Delivers each maker the newest update, one at a time; `offer` never blocks on a maker.

    `timeout`: an update a maker has not acknowledged after this many seconds counts as failed
    for it (a `TimeoutError` result) and the next offer is sent regardless; with `progress`, only while the
    maker receives nothing (see the module docstring): a transfer is failed when it stalls for
    `stall_timeout` s. `watch`: run the watch thread (`check` every `poll` s); tests call `check` themselves.
    `relay_fanout` > 0 (with `relay`): makers on other hosts than `origin` (the trainer's) take each update
    of `relay_min_bytes` or more from one another (`weights.relay`); a relay's copy failed: the trainer's.
    `liveness`: checked at each watch pass for every maker offered to (`stats()["silent"]`).
    """

    def __init__(self, send: Send, timeout: float, clock: Callable[[], float] = time.monotonic,
                 progress: Progress | None = None, stall_timeout: float = 30.0, locate: Locate | None = None,
                 watch: bool = True, poll: float | None = None, relay_fanout: int = 0,
                 relay_min_bytes: int = 0, origin: str | None = None, relay: RelayCopy | None = None,
                 liveness: MakerLiveness | None = None) -> None:
        if not timeout > 0:
            raise ValueError(f"WeightPushQueue: timeout must be > 0 s, got {timeout}")
        self.send = send
        self.timeout = timeout
        self.clock = clock
        self.progress = progress
        self.stall_timeout = check_stall_s("WeightPushQueue: stall_timeout", stall_timeout)
        self.locate = locate
        self.hosts: dict[str, str] = {}  # maker -> its node IP, from its answers
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None
        if progress is not None and watch:
            self.poll = min(self.stall_timeout / 4, 1.0) if poll is None else poll
            self._watch = threading.Thread(target=self._watch_loop, daemon=True, name="weight-push-watch")
            self._watch.start()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._in_flight: dict[str, _InFlight] = {}
        self._waiting: dict[str, _Offer] = {}
        self._results: dict[str, ApplyResult | BaseException] = {}  # since the last `take_results`
        self.acked: dict[str, int] = {}  # maker -> newest version it acknowledged
        self.failures: dict[str, str] = {}  # maker -> its latest failure, until it acknowledges again
        self.sent = 0
        self.superseded = 0  # updates replaced by a newer one before they were sent
        self.failed = 0
        self.relay = relay
        self.relays = RelayPlanner(relay_fanout if relay is not None else 0, origin, progress,
                                   relay_min_bytes)
        self.tree: dict[str, str] = {}  # child -> relay, at the last offer
        self.relayed = 0  # updates a maker was sent as another maker's copy
        self.relay_fallbacks = 0  # relayed copies that failed, so the maker was sent the trainer's own
        self.liveness = liveness
        self.known: set[str] = set()  # makers offered to and not forgotten
        self._dispatcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-push")

    def offer(self, update: WeightUpdate, makers: Iterable[str]) -> None:
        """Send `update` to every maker with nothing in flight (a relayed maker its relay's copy); leave it
        waiting (replacing an older one) for the rest."""
        makers = list(makers)
        offers = self._route(update, makers)
        with self._lock:
            self.known.update(makers)
            now = self.clock()
            to_send = [maker for maker in makers if self._place(maker, offers[maker], now)]
        for maker in to_send:
            self._dispatch(maker, offers[maker])

    def _route(self, update: WeightUpdate, makers: list[str]) -> dict[str, _Offer]:
        """What each maker is offered: the trainer's `update`, or its relay's copy (`relay.routes`)."""
        tree = self.relays.tree(makers, update.manifest.total_bytes)
        served = routes(update, tree, self.relay, self.relays) if tree else {}
        offers = {maker: _Offer(served[maker], tree[maker], update) if maker in served else _Offer(update)
                  for maker in makers}
        self.tree = {child: tree[child] for child in served}
        return offers

    def _place(self, maker: str, offer: _Offer, now: float) -> bool:
        """`offer` in flight for `maker` (True: send it now) or waiting behind its flight (hold `_lock`)."""
        flight = self._in_flight.get(maker)
        if flight is not None and self.progress is None and now - flight.sent_at > self.timeout:
            self._record(maker, TimeoutError(
                f"maker {maker!r} did not acknowledge weight update v{flight.version} within "
                f"{self.timeout:.0f} s"))
            del self._in_flight[maker]
            flight = None
        if flight is None:
            self._in_flight[maker] = self._flight(offer, now)
            return True
        if maker in self._waiting:
            self.superseded += 1
        self._waiting[maker] = offer
        return False

    def _dispatch(self, maker: str, offer: _Offer) -> None:
        try:
            future = self.send(maker, offer.update)
        # No actor by that name, a closed connection: that maker's result.
        except BaseException as error:  # noqa: BLE001
            future = Future()
            future.set_exception(error)
        with self._lock:
            flight = self._in_flight.get(maker)
            if flight is None or flight.offer is not offer:
                return  # timed out and replaced meanwhile
            flight.future = future
            self.sent += 1
            self.relayed += offer.via is not None
        future.add_done_callback(lambda done: self._done(maker, offer, done))

    def _done(self, maker: str, offer: _Offer, future: Future) -> None:
        with self._lock:
            flight = self._in_flight.get(maker)
            if flight is None or flight.future is not future:
                return  # counted as timed out already
            error = future.exception()
            next_offer = self._end(maker, flight, error if error is not None else future.result())
        if next_offer is not None:
            self._dispatcher.submit(self._dispatch, maker, next_offer)

    def _end(self, maker: str, flight: _InFlight, result: ApplyResult | BaseException) -> _Offer | None:
        """`flight` ended with `result`: record it, or (a relayed copy that failed) offer the trainer's own
        update instead; the offer to send `maker` next, now in flight, if any (hold `_lock`)."""
        del self._in_flight[maker]
        offer = flight.offer
        if isinstance(result, BaseException) and offer is not None and offer.via is not None:
            self.relay_fallbacks += 1
            self.relays.distrust(offer.via)
            logger.warning("weight update v%d relayed by %r to %r failed (%s: %s): sending the trainer's own",
                           flight.version, offer.via, maker, type(result).__name__, result)
            waiting = self._waiting.get(maker)  # a newer one waits: it goes, but never through that relay
            self._waiting[maker] = self._direct(waiting or offer, offer.via)
        else:
            self._record(maker, result, None if offer is None else offer.via)
            if not isinstance(result, BaseException):
                self.acked[maker] = max(self.acked.get(maker, -1), flight.version)
        next_offer = self._waiting.pop(maker, None)
        if next_offer is not None:
            self._in_flight[maker] = self._flight(next_offer, self.clock())
        self._changed.notify_all()
        return next_offer

    @staticmethod
    def _direct(offer: _Offer, relay: str | None) -> _Offer:
        """`offer`, but the trainer's own update where it is `relay`'s copy."""
        return _Offer(offer.original) if offer.via == relay and offer.original is not None else offer

    @staticmethod
    def _flight(offer: _Offer, now: float) -> _InFlight:
        manifest = offer.update.manifest
        return _InFlight(manifest.version, now, Future(), manifest.kind, offer=offer, seen=now)

    def _record(self, maker: str, result: ApplyResult | BaseException, via: str | None = None) -> None:
        """Keep `result` as the maker's latest (`via`: the relay whose copy it took); hold `_lock`."""
        if isinstance(result, BaseException):
            self.failed += 1
            self.failures[maker] = f"{type(result).__name__}: {result}"
            self.relays.forget(maker)  # a restarted maker may come back on another node
        else:
            self.failures.pop(maker, None)
            self.relays.record(maker, getattr(result, "bytes", 0), getattr(result, "fetch_seconds", 0.0), via)
        self._results[maker] = result

    def take_results(self) -> dict[str, ApplyResult | BaseException]:
        """Each maker's latest result since the previous call (acknowledgement or error)."""
        with self._lock:
            results, self._results = self._results, {}
        return results

    def wait(self, timeout: float | None, makers: Iterable[str] | None = None) -> bool:
        """Wait up to `timeout` s until nothing is in flight or waiting (for `makers`, default all) but for
        makers that stopped answering (`liveness`); True if so. Without `progress`, pushes still
        unacknowledged then fail; with it, they stay in flight (the watch fails those that stall) and
        `timeout` None waits until every push is acknowledged or failed."""
        if timeout is None and self._watch is None:
            raise ValueError("WeightPushQueue.wait: timeout None needs the progress watch (progress=...)")
        deadline = math.inf if timeout is None else self.clock() + timeout
        only = None if makers is None else set(makers)
        with self._lock:
            while True:
                silent = {} if self.liveness is None else self.liveness.silent()
                busy = sorted(m for m in self._in_flight.keys() | self._waiting.keys()
                              if (only is None or m in only) and m not in silent)
                if not busy:
                    return True
                remaining = deadline - self.clock()
                if remaining <= 0 and self.progress is not None:
                    return False
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

    @property
    def watched(self) -> bool:
        """The watch thread runs: `wait(None)` ends once every push is acknowledged or failed."""
        return self._watch is not None and not self._closed.is_set()

    def close(self) -> None:
        """Stop the watch thread (pushes in flight are left as they are)."""
        self._closed.set()

    def _watch_loop(self) -> None:
        while not self._closed.wait(self.poll):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the watch outlives one bad pass; the next one retries
                logger.exception("weight push watch")

    def check(self) -> None:
        """One pass of the watch: ask makers whose push is older than the stall interval for progress, judge
        their answers, fail pushes that stalled or got no answer in time (and send what waits behind)."""
        now = self.clock()
        ask: list[tuple[str, _InFlight]] = []
        failed: list[tuple[str, _InFlight, BaseException | None]] = []
        with self._lock:
            for maker, flight in self._in_flight.items():
                if flight.query is not None and flight.query.done():
                    query, flight.query = flight.query, None
                    error = self._judge(maker, flight, query, now)
                    if error is not None:
                        failed.append((maker, flight, error))
                elif flight.query is not None and now - flight.asked_at >= self.stall_timeout:
                    failed.append((maker, flight, None))  # no answer: the message needs the host
                elif flight.query is None and now - flight.seen >= self.stall_timeout:
                    flight.query, flight.asked_at = Future(), now  # claimed; the question is asked below
                    ask.append((maker, flight))
        for maker, flight in ask:
            try:
                query = self.progress(maker)
            except Exception as error:  # noqa: BLE001 - no such actor now: judged like a failed answer
                query = Future()
                query.set_exception(error)
            with self._lock:
                if flight.query is not None and not flight.query.done():
                    flight.query = query
        for maker, flight, error in failed:
            self._fail(maker, flight, error or self._unanswered(maker, flight, now))
        if self.liveness is not None:
            self.liveness.check(list(self.known))  # one C call copies it whole (the GIL held)
            silent = self.liveness.silent()
            with self._lock:  # a silent maker relays for none; what waits for its copy takes the trainer's
                for maker in silent:
                    self.relays.distrust(maker)
                for maker, waiting in self._waiting.items():
                    if waiting.via in silent:
                        self._waiting[maker] = self._direct(waiting, waiting.via)

    def _judge(self, maker: str, flight: _InFlight, query: Future, now: float) -> BaseException | None:
        """The error that fails `flight` after the maker's answer `query`, or None (keep waiting); hold the
        lock."""
        try:
            answer = query.result()
        except Exception as error:  # noqa: BLE001 - the maker's actor is gone or unreachable
            return TransferStalled(f"{self._what(maker, flight)}: progress query failed: "
                                   f"{type(error).__name__}: {error}")
        answer = answer or {}
        if answer.get("host"):
            self.hosts[maker] = answer["host"]
        if answer.get("version") is None:  # alive, receiving nothing: bounded by `timeout` from the send
            flight.seen = now
            if now - flight.sent_at > self.timeout:
                return TimeoutError(f"{self._what(maker, flight)}: not acknowledged within "
                                    f"{self.timeout:g} s (the maker answers but receives nothing)")
            return None
        idle = float(answer.get("idle_s", math.inf))
        if idle < self.stall_timeout:
            flight.seen, flight.last = now - idle, dict(answer)
            return None
        return TransferStalled(f"{self._what(maker, flight)}: stalled: {_what_answer(answer)}, no progress "
                               f"for {idle:.1f} s (stall interval {self.stall_timeout:g} s)")

    def _unanswered(self, maker: str, flight: _InFlight, now: float) -> TransferStalled:
        """The error of a push whose maker did not answer a progress question within the stall interval."""
        if maker not in self.hosts and self.locate is not None:
            try:
                host = self.locate(maker)
            except Exception:  # noqa: BLE001 - only for the message
                host = None
            if host:
                self.hosts[maker] = host
        last = (f"last seen receiving {_what_answer(flight.last)}, {now - flight.seen:.1f} s ago"
                if flight.last else f"sent {now - flight.sent_at:.1f} s ago, no progress reported")
        return TransferStalled(f"{self._what(maker, flight)}: no answer to a progress query within "
                               f"{self.stall_timeout:g} s ({last})")

    def _what(self, maker: str, flight: _InFlight) -> str:
        via = f" relayed by {flight.offer.via!r}" if flight.offer is not None and flight.offer.via else ""
        return (f"weight update v{flight.version} ({flight.kind}){via} to maker {maker!r} at "
                f"{self.hosts.get(maker, 'an unknown host')}")

    def _fail(self, maker: str, flight: _InFlight, error: BaseException) -> None:
        """Count `flight` as failed (unless it ended meanwhile) and send the update waiting behind it."""
        with self._lock:
            if self._in_flight.get(maker) is not flight:
                return
            next_offer = self._end(maker, flight, error)
        logger.warning("%s", error)
        if next_offer is not None:
            self._dispatcher.submit(self._dispatch, maker, next_offer)

    def forget(self, maker: str) -> None:
        """Stop tracking a maker that is gone (makers it relays to fall back to the trainer's update when
        their copies fail)."""
        with self._lock:
            self._in_flight.pop(maker, None)
            self._waiting.pop(maker, None)
            self.acked.pop(maker, None)
            self.known.discard(maker)
            self.relays.forget(maker)

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
                    "failures": dict(self.failures),
                    "in_flight": {m: f.version for m, f in self._in_flight.items()},
                    "waiting": {m: o.update.manifest.version for m, o in self._waiting.items()},
                    "relay_tree": dict(self.tree), "relayed": self.relayed,
                    "relay_fallbacks": self.relay_fallbacks, "acked": dict(self.acked),
                    "silent": {} if self.liveness is None else dict(self.liveness.silent())}


def _what_answer(answer: Mapping[str, Any]) -> str:
    """'v3: 1.2 MB of 3.4 MB in 12.0 s (0.80 Mbit/s)' from a maker's progress answer."""
    return f"v{answer['version']}: {describe_answer(answer)}" if answer.get("version") is not None \
        else describe_answer(answer)


def synchronous_send(send_update: SendUpdate) -> Send:
    """A queue's `send` over a plain `send_update`: delivers to one maker at a time, in the caller's
    thread."""

    def send(maker: str, update: WeightUpdate) -> Future:
        future: Future = Future()
        result = send_update(update, [maker]).get(maker)
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
        return future

    return send


def push_queue_over(send_update: SendUpdate | WeightPushQueue, timeout: float,
                    reuse: WeightPushQueue | None = None) -> WeightPushQueue:
    """The queue to deliver through: `send_update` itself when it is one, else a queue over it (`reuse`'s
    state kept: what makers acknowledged), sending synchronously (the one adapter for plain functions)."""
    if isinstance(send_update, WeightPushQueue):
        return send_update
    if reuse is None:
        return WeightPushQueue(synchronous_send(send_update), timeout)
    reuse.send = synchronous_send(send_update)
    return reuse
