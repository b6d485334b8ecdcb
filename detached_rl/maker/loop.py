"""MakerLoop: a maker's decisions between batches (generate, push, wait for acks and fresh weights, save).

The Ray actor `ExperienceMakerHolder` only attaches to its trainers by name and hands this loop
an `ExperiencePusher` whose `submit` calls them; everything the maker decides lives here, in
plain code that runs (and is tested) without Ray.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from detached_rl.core.weight_sync import ApplyResult, Fetch, WeightUpdate
from detached_rl.maker.experience_maker import ExperienceMaker
from detached_rl.maker.pusher import ExperiencePusher

# How often a maker without complete weights looks again, and how often a wait for a version polls.
NOT_SYNCED_POLL_S = 0.05
VERSION_POLL_S = 0.02
# A `wait_for_ack` wait flushes in slices this long, so that a stop request is noticed.
ACK_POLL_S = 1.0


def update_to_apply(offered: Sequence[WeightUpdate | None], policy_version: int,
                    trainer_run: str | None) -> WeightUpdate | None:
    """The update a maker should take of those its trainers offer, or None.

    The newest one, if it is newer than the maker's weights or comes from a trainer run the maker
    does not follow (a trainer resumed from a checkpoint restarts at an older version).
    """
    updates = [update for update in offered if update is not None]
    if not updates:
        return None
    newest = max(updates, key=lambda update: update.manifest.version)
    new_run = newest.manifest.metadata.get("trainer_run") not in (None, trainer_run)
    return newest if newest.manifest.version > policy_version or new_run else None


def take_offered(maker: ExperienceMaker, offered: Sequence[WeightUpdate | None], fetch: Fetch) -> ApplyResult | None:
    """Apply the update `update_to_apply` chooses (pulling its chunks with `fetch`); None if none is chosen.

    `offered` are the answers of the maker's own registration with its trainers, so the update is
    applied as an explicit reset: the maker follows that trainer run from then on, at that version.
    """
    update = update_to_apply(offered, maker.policy_version, maker.receiver.trainer_run)
    return None if update is None else maker.apply_weight_update(update, fetch, reset=True)


class MakerLoop:
    """Generates and pushes batches until told to stop; waits for acks and fresh weights as the config says."""

    def __init__(
        self,
        maker: ExperienceMaker,
        stop: threading.Event,
        save_state: Callable[[dict[str, Any]], Any] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.maker = maker
        self.stop = stop
        self.save_state = save_state  # called with the maker's state after every pushed batch
        self.sleep = sleep
        self.clock = clock
        self.pusher: ExperiencePusher | None = None  # the pusher of the latest `run`
        self.first_batch_version: int | None = None  # policy version of the first batch this process made

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
            if num_batches is None and trainers_finished is not None and trainers_finished():
                self.stop.set()
            self.pusher = pusher
            stale_seen = 0
            while not self.stop.is_set() and (num_batches is None or made < num_batches):
                if not maker.synced:  # not yet given weights (or half-updated): wait for an update
                    self.sleep(NOT_SYNCED_POLL_S)
                    continue
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
                needed = pusher.oldest_useful_version
                if config.wait_for_fresh_weights and needed is not None and maker.policy_version < needed:
                    self.wait_for_version(needed, config.weight_timeout_s)
                stats = pusher.stats()
                if stats["dropped_stale_by_trainer"] > stale_seen:
                    # Samples arrived too old: catch up with the trainers' version before generating more.
                    stale_seen = stats["dropped_stale_by_trainer"]
                    versions = [t["last_version"] for t in stats["per_trainer"].values() if t["last_version"]]
                    if versions:
                        self.wait_for_version(max(versions), config.weight_timeout_s)
            pusher.flush(timeout=config.push_timeout_s)
        except Exception as error:
            maker.last_error = f"{type(error).__name__}: {error}"
            raise
        return made

    def wait_for_version(self, version: int, timeout: float) -> bool:
        """Wait up to `timeout` s (or until `stop`) for weights of `version` or newer; True if they came."""
        deadline = self.clock() + timeout
        while self.maker.policy_version < version and self.clock() < deadline and not self.stop.is_set():
            self.sleep(VERSION_POLL_S)
        return self.maker.policy_version >= version
