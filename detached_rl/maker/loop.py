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
from typing import TYPE_CHECKING, Any

from detached_rl.core.replay_buffer import NEWER_THAN_TRAINER
from detached_rl.maker import wait_policy
from detached_rl.maker.pusher import ExperiencePusher
from detached_rl.maker.wait_policy import Decision, WaitLimits, WaitState

if TYPE_CHECKING:
    from detached_rl.maker.experience_maker import ExperienceMaker

logger = logging.getLogger(__name__)

# How often a maker without complete weights looks again, and how often a wait for a version polls.
NOT_SYNCED_POLL_S = 0.05
VERSION_POLL_S = 0.02
# A `wait_for_ack` wait flushes in slices this long, so that a stop request is noticed.
ACK_POLL_S = 1.0
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
        self.first_batch_started: float | None = None  # when (`clock`) this process began its first batch
        # Registers with the trainers again and takes their newest weights, even older
        # ones (see `resync_now`).
        self.resync = resync
        self.resyncs = 0
        # Waits for fresh weights: how many, seconds in all, and how many ended without them because updates
        # stopped coming (`stalled`) or after `weight_timeout_s` without a newer version (`timed_out`).
        self.fresh_waits = {"waits": 0, "seconds": 0.0, "stalled": 0, "timed_out": 0}
        self.update_interval: float | None = None  # running estimate of the seconds between weight updates
        self._seen: tuple[int, float] | None = None  # the newest policy version seen, and when first seen
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
        self.pusher = pusher  # set first: `connect` may seed its pace (an admission)
        try:
            if connect is not None:
                connect()
                maker.last_error = None  # registered again: an earlier run's error is over
            if num_batches is None and trainers_finished is not None and trainers_finished():
                self.stop.set()
            stale_seen = rejected_seen = 0
            while not self.stop.is_set() and (num_batches is None or made < num_batches):
                if maker.resync_reason is not None:
                    self.resync_now()
                if not maker.synced:  # not yet given weights (or half-updated): wait for an update
                    self.sleep(NOT_SYNCED_POLL_S)
                    continue
                self.observe_version()
                needed = pusher.oldest_useful_version  # the pace of the last answer, or of the admission
                if config.wait_for_fresh_weights and needed is not None and maker.policy_version < needed:
                    self.wait_for_fresh_weights(needed)
                    if self.stop.is_set():
                        break
                if self.first_batch_started is None:
                    self.first_batch_started = self.clock()
                experiences = maker.make_experience()
                if self.first_batch_version is None and experiences:
                    self.first_batch_version = experiences[0].policy_version
                pusher.push(experiences)
                if self.save_state is not None:
                    self.save_state(maker.state_dict())
                # The next batch is made with the answer to the push before this one (to this one with
                # `wait_for_ack`): the batch the trainer counted on when it answered (`GenerationLedger`).
                # Backpressure, not a failure: a full trainer takes the push once it trains. A trainer that is
                # gone makes the pusher drop the push after its retries, which ends this wait too.
                while not pusher.flush(ACK_POLL_S, leave=config.answer_lag) and not self.stop.is_set():
                    pass
                made += 1
                rejected_seen = self._check_not_ahead(pusher, rejected_seen)
                stats = pusher.stats()
                if stats["dropped_stale_by_trainer"] > stale_seen:
                    # Samples arrived too old: catch up with the trainers' version before generating more.
                    stale_seen = stats["dropped_stale_by_trainer"]
                    versions = [t["last_version"] for t in stats["per_trainer"].values() if t["last_version"]]
                    if versions:
                        self.wait_for_version(max(versions))
            pusher.flush(timeout=config.push_timeout_s)
        except Exception as error:
            maker.last_error = f"{type(error).__name__}: {error}"
            raise
        return made

    def wait_for_fresh_weights(self, version: int) -> bool:
        """Wait for the weights an acknowledgement's `oldest_useful_version` asks for (paced); counted."""
        start = self.clock()
        try:
            return self.wait_for_version(version, paced=True)
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

    def wait_for_version(self, version: int, timeout: float | None = None, paced: bool = False) -> bool:
        """Wait for weights of `version` or newer, doing each poll what the wait policy says
        (`maker/wait_policy.py`): wait, register again, end the wait (generate) or stop; True if they came.

        `timeout`: seconds without a newer version before the wait ends (default `weight_timeout_s`).
        `paced`: the version is an acknowledgement's bound, which the trainer has yet to reach; otherwise a
        catch-up to a version the trainers hold. A paced wait that ends without its weights is counted in
        `fresh_waits` (`stalled` or `timed_out`).
        """
        self.observe_version()
        start, resynced = self.clock(), False
        while True:
            state, limits = self.wait_state(version, start, paced, resynced), self.wait_limits(timeout)
            decision = wait_policy.decide(state, limits)
            if decision is Decision.WAIT:
                self.sleep(VERSION_POLL_S)
            elif decision is Decision.RESYNC:
                if self.maker.resync_reason is None:
                    resynced = True
                    self.maker.resync_reason = (f"asked for weights v{version} or newer, none came within "
                                                f"{limits.resync_after_s:g} s")
                self.resync_now()
            else:
                if decision is Decision.GENERATE and paced and state.missing:
                    self.give_up_waiting(timed_out=not wait_policy.stalled(state, limits))
                return self.maker.policy_version >= version
            self.observe_version()

    def decide(self, version: int, start: float, paced: bool = False,
               timeout: float | None = None) -> Decision:
        """The wait policy's decision now for a wait for `version` begun at `start` (a time of `clock`)."""
        return wait_policy.decide(self.wait_state(version, start, paced), self.wait_limits(timeout))

    def wait_state(self, version: int, start: float, paced: bool, resynced: bool = False) -> WaitState:
        """What a wait for `version` begun at `start` sees now (`start`: a time of `clock`)."""
        now = self.clock()
        seen_at = start if self._seen is None else self._seen[1]
        return WaitState(since_update_s=max(now - seen_at, 0.0), update_interval_s=self.update_interval,
                         missing=max(version - self.maker.policy_version, 0), waited_s=max(now - start, 0.0),
                         paced=paced, resynced=resynced, resync_asked=self.maker.resync_reason is not None,
                         stop_asked=self.stop.is_set())

    def wait_limits(self, timeout: float | None = None) -> WaitLimits:
        """The wait policy's settings from the maker's config (read each poll), `timeout` overriding
        `weight_timeout_s`."""
        config = self.maker.config
        return WaitLimits(resync_after_s=config.resync_after_s,
                          timeout_s=config.weight_timeout_s if timeout is None else timeout)

    def give_up_waiting(self, timed_out: bool = False) -> None:
        """Record that a paced wait ended without its weights: they stopped coming (`stalled`), or
        `timed_out`."""
        self._stalled_since_seen = True
        self.fresh_waits["timed_out" if timed_out else "stalled"] += 1

    def stall_deadline(self, version: int) -> float | None:
        """When a paced wait for `version` counts as stalled (the wait policy's rule 4, as a time of `clock`);
        None before an interval is known."""
        if self._seen is None:
            return None
        after = wait_policy.stall_after_s(self.update_interval, max(version - self.maker.policy_version, 0))
        return None if after is None else self._seen[1] + after

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
