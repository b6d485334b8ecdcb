"""MakerLoop: a maker's decisions between batches (generate, push, wait for acks and fresh weights, save).

The Ray actor `ExperienceMakerHolder` only attaches to its trainers by name and hands this loop
an `ExperiencePusher` whose `submit` calls them; everything the maker decides lives here, in
plain code that runs (and is tested) without Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from detached_rl.core.replay_buffer import NEWER_THAN_TRAINER
from detached_rl.maker.experience_maker import ExperienceMaker
from detached_rl.maker.pusher import ExperiencePusher

logger = logging.getLogger(__name__)

# How often a maker without complete weights looks again, and how often a wait for a version polls.
NOT_SYNCED_POLL_S = 0.05
VERSION_POLL_S = 0.02
# A `wait_for_ack` wait flushes in slices this long, so that a stop request is noticed.
ACK_POLL_S = 1.0
# A wait for fresh weights gives up once no newer weights have come for this many update intervals (as the
# maker saw them), plus one per version still missing: the trainer is then short of samples, because batches
# it counted on did not come (a maker gone, samples dropped), and this maker generates rather than wait.
STALL_UPDATES = 3
# Weight of the newest interval in the running estimate of the time between two weight updates.
INTERVAL_WEIGHT = 0.25


class MakerLoop:
    """Generates and pushes batches until told to stop; waits for acks and fresh
    weights as the config says."""

    def __init__(
        self,
        maker: ExperienceMaker,
        stop: threading.Event,
        save_state: Callable[[dict[str, Any]], Any] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        resync: Callable[[], None] | None = None,
    ) -> None:
        self.maker = maker
        self.stop = stop
        self.save_state = save_state  # called with the maker's state after every pushed batch
        self.sleep = sleep
        self.clock = clock
        self.pusher: ExperiencePusher | None = None  # the pusher of the latest `run`
        self.first_batch_version: int | None = None  # policy version of the first batch this process made
        # Registers with the trainers again and takes their newest weights, even older
        # ones (see `resync_now`).
        self.resync = resync
        self.resyncs = 0
        # Waits for fresh weights: how many, seconds in all, and how many ended because no weights came.
        self.fresh_waits = {"waits": 0, "seconds": 0.0, "stalled": 0}
        self.update_interval: float | None = None  # running estimate of the seconds between weight updates
        self._seen: tuple[int, float] | None = None  # the newest policy version seen, and when first seen
        self._gave_up = False  # the latest wait ended because weight updates stopped coming (`stalled`)
        self._stalled_since_seen = False  # a wait gave up since the newest version came: an abnormal interval

    def run(
        self,
        pusher: ExperiencePusher,
        num_batches: int | None = None,
        connect: Callable[[], None] | None = None,
        trainers_finished: Callable[[], bool] | None = None,
    ) -> int:
        """Make and push batches until `num_batches` are pushed or `stop` is set; returns how many were made.

        `connect` (e.g. attach to the trainers) runs first; `trainers_finished` says whether every
        trainer already ended its training and stopped its makers, in which case a run without
        `num_batches` has nobody to feed and ends at once. Any error is recorded in the maker's
        `last_error` and raised.
        """
        if num_batches is not None and num_batches < 0:
            raise ValueError(f"num_batches must be >= 0 or None, got {num_batches}")
        self.stop.clear()
        maker, config = self.maker, self.maker.config
        made = 0
        try:
            if connect is not None:
                connect()
                maker.last_error = None  # registered again: an earlier run's error is over
            if num_batches is None and trainers_finished is not None and trainers_finished():
                self.stop.set()
            self.pusher = pusher
            stale_seen = rejected_seen = 0
            while not self.stop.is_set() and (num_batches is None or made < num_batches):
                if maker.resync_reason is not None:
                    self.resync_now()
                if not maker.synced:  # not yet given weights (or half-updated): wait for an update
                    self.sleep(NOT_SYNCED_POLL_S)
                    continue
                self.observe_version()
                experiences = maker.make_experience()
                if self.first_batch_version is None and experiences:
                    self.first_batch_version = experiences[0].policy_version
                pusher.push(experiences)
                if self.save_state is not None:
                    self.save_state(maker.state_dict())
                # Backpressure, not a failure: a full trainer takes the push once it trains. A trainer that is
                # gone makes the pusher drop the push after its retries, which ends this wait too.
                while config.wait_for_ack and not pusher.flush(timeout=ACK_POLL_S) and not self.stop.is_set():
                    pass
                made += 1
                rejected_seen = self._check_not_ahead(pusher, rejected_seen)
                needed = pusher.oldest_useful_version
                if config.wait_for_fresh_weights and needed is not None and maker.policy_version < needed:
                    self.wait_for_fresh_weights(needed)
                stats = pusher.stats()
                if stats["dropped_stale_by_trainer"] > stale_seen:
                    # Samples arrived too old: catch up with the trainers' version before generating more.
                    stale_seen = stats["dropped_stale_by_trainer"]
                    versions = [t["last_version"] for t in stats["per_trainer"].values() if t["last_version"]]
                    if versions:
                        self.wait_or_resync(max(versions))
            pusher.flush(timeout=config.push_timeout_s)
        except Exception as error:
            maker.last_error = f"{type(error).__name__}: {error}"
            raise
        return made

    def wait_or_resync(self, version: int, paced: bool = False) -> bool:
        """Wait for weights of `version` or newer; if none came within `resync_after_s`, register with the
        trainers again (they may have moved on without this maker, as a trainer resumed from a checkpoint
        does) and wait out the rest of `weight_timeout_s`. True if they came.

        `paced`: the wait an acknowledgement asks for, which may span several versions: its timeouts count
        from the newest weights seen, and it ends when weight updates stop coming (`stalled`).
        """
        config = self.maker.config
        first = min(config.resync_after_s, config.weight_timeout_s)
        came = self.wait_for_version(version, first, paced)
        if came or self.resync is None or self.stop.is_set() or self._gave_up:
            return self.maker.policy_version >= version
        if self.maker.resync_reason is None:
            self.maker.resync_reason = f"asked for weights v{version} or newer, none came within {first:g} s"
        self.resync_now()
        return self.wait_for_version(version, config.weight_timeout_s - first, paced)

    def wait_for_fresh_weights(self, version: int) -> bool:
        """Wait for the weights an acknowledgement's `oldest_useful_version` asks for (paced); counted."""
        start = self.clock()
        try:
            return self.wait_or_resync(version, paced=True)
        finally:
            self.fresh_waits["waits"] += 1
            self.fresh_waits["seconds"] += self.clock() - start

    def resync_now(self) -> None:
        """Register with the trainers again and take their newest weights (`maker.resync_reason` says why)."""
        reason, self.maker.resync_reason = self.maker.resync_reason, None
        if self.resync is None:
            return
        logger.warning("maker %s registers with its trainers again: %s", self.maker.name, reason)
        self.resyncs += 1
        try:
            self.resync()
        except Exception as error:  # noqa: BLE001 - the next push or update tells again; the loop goes on
            self.maker.last_error = f"registering again ({reason}) failed: {type(error).__name__}: {error}"
            logger.warning("maker %s: %s", self.maker.name, self.maker.last_error)

    def _check_not_ahead(self, pusher: ExperiencePusher, rejected_seen: int) -> int:
        """Ask for a resync when a trainer refused samples as newer than its weights (this maker serves
        weights its trainers never sent); returns the pusher's count of rejected samples."""
        stats = pusher.stats()
        rejected = stats["dropped"].get("rejected", 0)
        if rejected > rejected_seen and NEWER_THAN_TRAINER in (stats["last_error"] or ""):
            self.maker.resync_reason = (f"serves v{self.maker.policy_version}, ahead of its trainers: "
                                        f"{stats['last_error']}")
        return rejected

    def wait_for_version(self, version: int, timeout: float, paced: bool = False) -> bool:
        """Wait up to `timeout` s (or until `stop`, or a reason to register again) for weights of `version` or
        newer; True if they came.

        `paced`: `timeout` counts from the newest weights seen, and the wait gives up once weight updates
        have stopped coming (`stalled`).
        """
        self._gave_up = False
        self.observe_version()
        start = self.clock()
        while (self.maker.policy_version < version and not self.stop.is_set()
               and self.maker.resync_reason is None):
            since = max(start, self._seen[1]) if paced and self._seen is not None else start
            if self.clock() >= since + timeout:
                break
            if paced and self.stalled(version):
                self.give_up_waiting()
                break
            self.sleep(VERSION_POLL_S)
            self.observe_version()
        return self.maker.policy_version >= version

    def give_up_waiting(self) -> None:
        """Record that a wait for fresh weights ended because they stopped coming (`stalled`)."""
        self._gave_up = self._stalled_since_seen = True
        self.fresh_waits["stalled"] += 1

    def stalled(self, version: int) -> bool:
        """True once past `stall_deadline(version)`."""
        deadline = self.stall_deadline(version)
        return deadline is not None and self.clock() > deadline

    def stall_deadline(self, version: int) -> float | None:
        """When a wait for `version` has stalled: no newer weights for `STALL_UPDATES` update intervals, plus
        one per version still missing (the makers due last give up last); None before an interval is known."""
        if self.update_interval is None or self._seen is None:
            return None
        missing = max(version - self.maker.policy_version, 0)
        return self._seen[1] + (STALL_UPDATES + missing) * self.update_interval

    def observe_version(self) -> None:
        """Note the maker's policy version now; a newer one updates the interval estimate (`update_interval`),
        unless a wait gave up in between (that interval measured a trainer short of samples, not its pace)."""
        version, now = self.maker.policy_version, self.clock()
        newer = self._seen is not None and self._seen[0] >= 0 and version > self._seen[0]
        if self._seen is not None and newer and not self._stalled_since_seen:
            interval, previous = now - self._seen[1], self.update_interval
            self.update_interval = (interval if previous is None
                                    else previous + INTERVAL_WEIGHT * (interval - previous))
        if self._seen is None or version != self._seen[0]:
            self._seen = (version, now)
            self._stalled_since_seen = False
