"""ExperiencePusher: the maker's side of pushing experience to trainers (docs/design.md §3.3).

Every push ends either acked (the trainer's `AppendResult` counts its samples as accepted,
duplicates or dropped as stale) or dropped with a reason: "rejected" (the trainer refused it as
malformed; never retried), "failed" (no answer on each of `max_attempts` attempts) or "stopped"
(`should_stop()` while the push still needed a retry). So once `flush` returns True,
`samples_pushed == accepted + duplicates + dropped_stale_by_trainer + sum(dropped.values())`.

A push is stored at most once across trainers. Its idempotency key is its experiences' ids
(made once by the maker, the same on every attempt); each trainer's buffer dedupes by id, and
its checkpoints keep the ids it has seen. An attempt handed to a trainer (`submit` returned a
future) may have been stored even when its answer failed or never came, so the push is then
pinned: every later attempt goes to that trainer name, alive, restarted or resumed under it,
where a copy already stored counts as duplicates; it is never sent to another trainer (a dead
trainer's checkpoint may hold it and come back), and is dropped as "failed" after
`max_attempts`. An attempt whose `submit` raised was never sent: that push may go to any
trainer. A `submit` error (finding the trainer, registering again with a restarted one, a
`WeightUpdateError` taking its weights) is a failed attempt retried with backoff, never a
rejection: only a trainer's own answer, a `ValueError` such as `RejectedPushError`, rejects.

Slow or dead (`progress`, `stall_timeout`): an attempt is not failed for taking long while its trainer
receives it. Once an attempt has waited the stall interval, its trainer is asked how the pushes from this
maker arrive (`progress(trainer)`, a future; a big push travels in pieces the trainer pulls and counts,
`actors.transport.put_payload`). Bytes still arriving -> keep waiting; a transfer without progress for the
stall interval, or no answer within it -> the attempt failed, pinned and retried like any sent attempt
(at most once holds: the ids are unchanged and it goes to the same trainer). A trainer that answers but
receives nothing from this maker is bounded by `push_timeout`, from the send or the last bytes seen.
Without `progress`, `push_timeout` bounds every attempt.

No thread of its own: finished attempts and due retries are handled whenever `push` or
`flush` runs on the maker's thread; `stats` may be called from any thread.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from detached_rl.core.experience import Experience
from detached_rl.core.replay_buffer import AppendResult
from detached_rl.core.transfer import check_stall_s, describe_answer, human_bytes
from detached_rl.maker.config import PUSH_POLICIES

DROP_REASONS = ("rejected", "failed", "stopped")
_COUNTERS = (
    "pushes", "samples_pushed", "acked_pushes", "accepted", "duplicates", "dropped_stale_by_trainer",
    "full_retries", "failed_attempts",
)
# Longest single wait, so that `should_stop()` is noticed soon even during a long backoff.
_POLL_SECONDS = 0.1

# Sends one attempt to the named trainer; raises (rather than returning a failed
# future) when nothing was sent.
Submit = Callable[[str, list[Experience]], "Future[AppendResult]"]
# trainer -> a future of its answer about the pushes arriving from this maker:
# {"host": its node IP, "transfers": [{"done", "total", "seconds", "idle_s"}, ...]}.
Progress = Callable[[str], "Future[Mapping[str, Any] | None]"]


@dataclass(eq=False)  # compared by identity: list.remove() must not compare tensors
class _Push:
    experiences: list[Experience]
    failures: int = 0  # transport failures so far; capacity refusals do not count
    trainer: str = ""  # the trainer of the current (or last) attempt
    future: Future[AppendResult] | None = None
    deadline: float = 0.0  # when the current attempt times out
    retry_at: float = 0.0  # when a waiting retry is due
    sent: bool = False  # the current attempt was handed to the trainer (`submit` returned)
    # Set once an attempt that was sent failed or timed out, as it may have been stored: every retry
    # goes to that trainer, whose id dedupe makes it safe (another trainer would store it twice).
    pinned: str | None = None
    seen: float = 0.0  # the last time the trainer was seen receiving this attempt (its send, at first)
    query: Future | None = None  # a progress question not yet answered
    asked_at: float = 0.0
    last: Mapping[str, Any] | None = None  # the trainer's last answer about a transfer that moved

    @property
    def nbytes(self) -> int:
        """The push's size (`Experience.nbytes`), for messages."""
        return sum(experience.nbytes() for experience in self.experiences if hasattr(experience, "nbytes"))


@dataclass
class _Trainer:
    accepted: int = 0
    last_size: int | None = None
    last_version: int | None = None  # the trainer's policy version at its latest acknowledgement
    oldest_useful_version: int | None = None  # from that acknowledgement (see `AppendResult`)
    admitted: list[int] = field(default_factory=list)  # the admission's versions for the next batches
    failures: int = 0
    avoid_until: float = field(default=-math.inf)  # set after a failure or a "full" answer


class ExperiencePusher:
    """Pushes lists of experiences to named trainers: bounded in flight, acknowledged, retried, accounted."""

    def __init__(
        self,
        submit: Submit,
        trainers: Sequence[str],
        max_in_flight: int = 2,
        policy: str = "round_robin",
        push_timeout: float = 60.0,
        max_attempts: int = 5,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
        should_stop: Callable[[], bool] = lambda: False,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        progress: Progress | None = None,
        stall_timeout: float = 30.0,
        on_rejected: Callable[[Exception], None] | None = None,
    ) -> None:
        self._on_rejected = on_rejected  # told of each push a trainer refused (the maker may resync)
        if not callable(submit):
            raise TypeError(f"submit must be callable, got {type(submit).__name__}")
        if isinstance(trainers, str) or not isinstance(trainers, Sequence) or not trainers:
            raise ValueError(f"trainers must be a non-empty sequence of trainer names, got {trainers!r}")
        names_ok = all(isinstance(name, str) and name for name in trainers)
        if not names_ok or len(set(trainers)) != len(trainers):
            raise ValueError(f"trainers must be distinct non-empty strings, got {list(trainers)!r}")
        if policy not in PUSH_POLICIES:
            raise ValueError(f"policy must be one of {PUSH_POLICIES}, got {policy!r}")
        self.trainers = list(trainers)
        self.policy = policy
        self.max_in_flight = _check_int("max_in_flight", max_in_flight)
        self.max_attempts = _check_int("max_attempts", max_attempts)
        self.push_timeout = _check_seconds("push_timeout", push_timeout)
        self.backoff_initial = _check_seconds("backoff_initial", backoff_initial)
        self.backoff_max = _check_seconds("backoff_max", backoff_max)
        if self.backoff_max < self.backoff_initial:
            raise ValueError(f"backoff_max ({backoff_max}) must be >= backoff_initial ({backoff_initial})")
        for name, value in (("should_stop", should_stop), ("sleep", sleep), ("clock", clock)):
            if not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        self._submit = submit
        self._progress = progress
        self.stall_timeout = check_stall_s("stall_timeout", stall_timeout)
        self._hosts: dict[str, str] = {}  # trainer -> its node IP, from its answers
        self._should_stop = should_stop
        self._sleep = sleep
        self._clock = clock

        self._lock = threading.Lock()
        self._state = {name: _Trainer() for name in self.trainers}
        self._cursor = 0  # index in `trainers` where the round-robin order starts next
        self._in_flight: list[_Push] = []
        self._waiting: list[_Push] = []
        self._backoff = self.backoff_initial
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._dropped = dict.fromkeys(DROP_REASONS, 0)
        self._last_error: str | None = None

    def push(self, experiences: Sequence[Experience]) -> None:
        """Send one push to a trainer, first blocking while `max_in_flight` pushes are outstanding."""
        experiences = list(experiences)
        if not experiences:
            return
        with self._lock:
            self._counts["pushes"] += 1
            self._counts["samples_pushed"] += len(experiences)
            for trainer in self._state.values():
                del trainer.admitted[:1]  # this batch was made under its admission
        self._process()
        while self._outstanding() >= self.max_in_flight:
            self._wait(deadline=None)
            self._process()
        self._send(_Push(experiences))

    def flush(self, timeout: float | None = None, leave: int = 0) -> bool:
        """Wait until every push but the `leave` newest is acked or dropped; False if `timeout` seconds passed
        first."""
        deadline = None if timeout is None else self._clock() + timeout
        while True:
            self._process()
            if self._outstanding() <= leave:
                return True
            if deadline is not None and self._clock() >= deadline:
                return False
            self._wait(deadline)

    def stats(self) -> dict[str, Any]:
        """Counters, drops by reason, outstanding pushes and per-trainer state (JSON-ready)."""
        with self._lock:
            return {
                **self._counts,
                "dropped": dict(self._dropped),
                "in_flight": len(self._in_flight),
                "waiting_retry": len(self._waiting),
                "per_trainer": {
                    name: {"accepted": t.accepted, "last_size": t.last_size, "failures": t.failures,
                           "last_version": t.last_version, "oldest_useful_version": t.oldest_useful_version}
                    for name, t in self._state.items()
                },
                "last_error": self._last_error,
            }

    @property
    def oldest_useful_version(self) -> int | None:
        """The oldest policy version the next batch may come from and still be trained wherever it goes: the
        lowest of the trainers' latest acknowledgements (None while a trainer has not bounded it: a trainer
        not pushed to yet may be waiting for this very batch, e.g. a rank its group cannot step without)."""
        with self._lock:
            hints = [trainer.admitted[0] if trainer.admitted else trainer.oldest_useful_version
                     for trainer in self._state.values()]
        return None if any(hint is None for hint in hints) else min(hints)

    def admitted(self, trainer: str, versions: Sequence[int] | None) -> None:
        """Take a trainer's admission (`admit_generation`: a version per batch) as the pace of the next
        batches, one per push, before its acknowledgements' answers."""
        with self._lock:
            self._state[trainer].admitted = list(versions or [])

    def _outstanding(self) -> int:
        """Pushes sent and unanswered, or waiting for a retry: both count against `max_in_flight`."""
        with self._lock:
            return len(self._in_flight) + len(self._waiting)

    def _send(self, push: _Push) -> None:
        with self._lock:
            push.trainer = push.pinned or self._choose_trainer(self._clock())
        try:
            future = self._submit(push.trainer, push.experiences)
            sent = True
        except Exception as err:  # nothing was sent: handled like a failed attempt, without pinning
            future, sent = Future(), False
            future.set_exception(err)
        with self._lock:
            push.future, push.sent = future, sent
            push.seen = self._clock()
            push.deadline = push.seen + self.push_timeout
            push.query, push.last = None, None
            self._in_flight.append(push)

    def _process(self) -> None:
        """Handle finished and timed-out attempts, then resend the retries that are due."""
        stopping = bool(self._should_stop())
        now = self._clock()
        due: list[_Push] = []
        ask: list[_Push] = []
        with self._lock:
            for push in list(self._in_flight):
                if push.future.done():
                    self._in_flight.remove(push)
                    self._settle(push, stopping, now)
                    continue
                reason = self._overdue(push, now)
                if reason is not None:
                    # A call already sent cannot be recalled and may still land; its answer is
                    # ignored, so the pusher counts each sample once (the retry's ack decides).
                    push.future.cancel()
                    self._in_flight.remove(push)
                    push.pinned = push.trainer
                    self._transport_failed(push, reason, stopping, now)
                elif (self._progress is not None and push.sent and push.query is None
                      and now - max(push.seen, push.asked_at) >= self.stall_timeout):
                    push.query, push.asked_at = Future(), now  # claimed; asked below, outside the lock
                    ask.append(push)
            for push in list(self._waiting):
                if stopping:
                    self._waiting.remove(push)
                    self._dropped["stopped"] += len(push.experiences)
                elif now >= push.retry_at:
                    self._waiting.remove(push)
                    due.append(push)
        for push in ask:
            try:
                query = self._progress(push.trainer)
            except Exception as error:  # noqa: BLE001 - no such trainer now: judged like a failed answer
                query = Future()
                query.set_exception(error)
            with self._lock:
                push.query = query
        for push in due:
            self._send(push)

    def _what(self, push: _Push) -> str:
        """'push of 4 samples (1.2 MB) to its host 10.213.0.1', for messages; hold the lock."""
        return (f"push of {len(push.experiences)} samples ({human_bytes(push.nbytes)}) to its host "
                f"{self._hosts.get(push.trainer, '(unknown)')}")

    def _overdue(self, push: _Push, now: float) -> str | None:
        """Why an unanswered attempt counts as failed now, or None; hold the lock."""
        if self._progress is None or not push.sent:
            return f"no answer within push_timeout={self.push_timeout:g} s" if now >= push.deadline else None
        if push.query is not None and push.query.done():
            query, push.query = push.query, None
            try:
                answer = query.result() or {}
            except Exception as error:  # noqa: BLE001 - the trainer is gone or unreachable
                return f"{self._what(push)}: progress query failed: {type(error).__name__}: {error}"
            if answer.get("host"):
                self._hosts[push.trainer] = answer["host"]
            what = self._what(push)
            transfers = list(answer.get("transfers") or [])
            moving = [t for t in transfers if float(t.get("idle_s", math.inf)) < self.stall_timeout]
            if moving:
                push.last = moving[0]
                push.seen = now - min(float(t["idle_s"]) for t in moving)
                push.deadline = max(push.deadline, push.seen + self.push_timeout)
            elif transfers:
                idle = min(float(t.get("idle_s", math.inf)) for t in transfers)
                return (f"{what}: stalled: {describe_answer(transfers[0])}, no progress for {idle:.1f} s "
                        f"(stall interval {self.stall_timeout:g} s)")
        elif push.query is not None and now - push.asked_at >= self.stall_timeout:
            last = (f"last seen receiving {describe_answer(push.last)}, {now - push.seen:.1f} s ago"
                    if push.last else f"sent {now - push.seen:.1f} s ago")
            return (f"{self._what(push)}: no answer to a progress query within {self.stall_timeout:g} s "
                    f"({last})")
        if now >= push.deadline:
            return (f"{self._what(push)}: no answer within push_timeout={self.push_timeout:g} s of its last "
                    "bytes (the trainer answers but receives nothing)")
        return None

    def _wait(self, deadline: float | None) -> None:
        """Block until an attempt finishes or times out, a retry is due, or `deadline` (at most one poll)."""
        now = self._clock()
        with self._lock:
            futures = [push.future for push in self._in_flight]
            wake_times = [push.deadline for push in self._in_flight]
            wake_times += [push.retry_at for push in self._waiting]
        wake = min([now + _POLL_SECONDS, *wake_times, *([] if deadline is None else [deadline])])
        timeout = max(0.0, wake - now)
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        elif timeout > 0:
            self._sleep(timeout)

    # Helpers below expect the lock to be held.

    def _choose_trainer(self, now: float) -> str:
        count = len(self.trainers)
        rotation = [self.trainers[(self._cursor + i) % count] for i in range(count)]
        available = [name for name in rotation if self._state[name].avoid_until <= now]
        if not available:
            chosen = min(rotation, key=lambda name: self._state[name].avoid_until)
        elif self.policy == "least_full":
            # min() keeps the first of equal sizes, i.e. round-robin order breaks ties.
            chosen = min(available, key=lambda name: self._state[name].last_size or 0)
        else:
            chosen = available[0]
        self._cursor = (self.trainers.index(chosen) + 1) % count
        return chosen

    def _settle(self, push: _Push, stopping: bool, now: float) -> None:
        try:
            result = push.future.result()
        except Exception as err:
            # The trainer's RejectedPushError (through Ray too: a RayTaskError subclasses the remote error's
            # class) rejects; a ValueError raised by `submit` (e.g. a WeightUpdateError while registering
            # again) never reached the trainer's buffer and is retried like RayActorError, ConnectionError...
            if push.sent and isinstance(err, ValueError):
                self._dropped["rejected"] += len(push.experiences)
                self._last_error = f"trainer {push.trainer!r} rejected {len(push.experiences)} samples: {err}"
                if self._on_rejected is not None:
                    self._on_rejected(err)
                return
            if push.sent:
                push.pinned = push.trainer
            reason = f"{type(err).__name__}: {err}" if push.sent else f"not sent: {type(err).__name__}: {err}"
            self._transport_failed(push, reason, stopping, now)
            return
        trainer = self._state[push.trainer]
        trainer.last_size = result.size
        trainer.last_version = getattr(result, "current_version", None)
        trainer.oldest_useful_version = getattr(result, "oldest_useful_version", None)
        if result.full:
            self._counts["full_retries"] += 1
            trainer.avoid_until = now + self.backoff_max
            self._retry_later(push, stopping, now)
            return
        trainer.accepted += result.accepted
        trainer.avoid_until = -math.inf
        self._counts["acked_pushes"] += 1
        self._counts["accepted"] += result.accepted
        self._counts["duplicates"] += result.duplicates
        self._counts["dropped_stale_by_trainer"] += result.dropped_stale
        self._backoff = self.backoff_initial

    def _transport_failed(self, push: _Push, reason: str, stopping: bool, now: float) -> None:
        trainer = self._state[push.trainer]
        trainer.failures += 1
        trainer.avoid_until = now + self.backoff_max
        self._counts["failed_attempts"] += 1
        push.failures += 1
        self._last_error = f"trainer {push.trainer!r}: {reason}"
        if push.failures >= self.max_attempts:
            self._dropped["failed"] += len(push.experiences)
            self._last_error = (
                f"push of {len(push.experiences)} samples dropped after {push.failures} failed attempts; "
                f"last: trainer {push.trainer!r}: {reason}"
            )
        else:
            self._retry_later(push, stopping, now)

    def _retry_later(self, push: _Push, stopping: bool, now: float) -> None:
        if stopping:
            self._dropped["stopped"] += len(push.experiences)
            return
        push.retry_at = now + self._backoff
        self._backoff = min(2 * self._backoff, self.backoff_max)
        self._waiting.append(push)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _check_seconds(name: str, value: Any) -> float:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)

