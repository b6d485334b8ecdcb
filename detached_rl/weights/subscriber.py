"""The maker and scorer side of the weight path: register with trainers, take the newest version offered (an
explicit reset), and receive the versions they push (`receive`) — all through one `WeightReceiver`, which
verifies, stages and swaps.

`WeightSubscriber` is built from explicit dependencies: the receiver (the version held, the trainer run
followed, the dtype served), the holder's one intake (`apply`, which may take only its part of an update),
and the base fingerprint it registers with. How trainers are asked (Ray calls, a test's objects) is the
caller's: `subscribe` takes it as functions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import ApplyResult, Fetch, WeightUpdate

Offered = Sequence[WeightUpdate | None]
# Asks every trainer to register this subscriber with (base fingerprint, serving dtype); answers in order.
Ask = Callable[[str | None, str | None], Offered]
# A fetch for pulling one of the offered updates, tracked while it runs.
Receiving = Callable[[Offered], AbstractContextManager[Fetch]]
# The trainer runs of the trainers at these positions of `Offered` (those that had no weights yet).
RunsOf = Callable[[list[int]], Sequence[str | None]]


class Apply(Protocol):
    """The holder's one weight intake (`ExperienceMaker.apply_weight_update`, `Scorer`'s)."""

    def __call__(self, update: WeightUpdate, fetch: Fetch, *, reset: bool = False) -> ApplyResult:
        """Receive `update` (`reset`: it answers this holder's registration)."""
        ...


def update_to_apply(offered: Offered, policy_version: int, trainer_run: str | None,
                    force: bool = False) -> WeightUpdate | None:
    """The update a subscriber should take of those its trainers offer, or None.

    The newest one, if it is newer than the weights held or comes from a trainer run the subscriber does
    not follow (a trainer resumed from a checkpoint restarts at an older version); with `force` (a maker
    that found itself off its trainers' weights), also if it is older.
    """
    updates = [update for update in offered if update is not None]
    if not updates:
        return None
    newest = max(updates, key=lambda update: update.manifest.version)
    new_run = newest.manifest.metadata.get("trainer_run") not in (None, trainer_run)
    version = newest.manifest.version
    return newest if version > policy_version or new_run or (force and version != policy_version) else None


class WeightSubscriber:
    """Registration and its answer for one weight holder (a maker, a critic scorer)."""

    def __init__(self, receiver: WeightReceiver, apply: Apply,
                 fingerprint: Callable[[], str | None] = lambda: None) -> None:
        self.receiver = receiver
        self.apply = apply
        self.fingerprint = fingerprint  # the base fingerprint to register with (None: send me a full update)

    def choose(self, offered: Offered, force: bool = False) -> WeightUpdate | None:
        """The offered update worth taking (`update_to_apply`), or None."""
        return update_to_apply(offered, self.receiver.version, self.receiver.trainer_run, force)

    def take_offered(self, offered: Offered, fetch: Fetch, force: bool = False) -> ApplyResult | None:
        """Apply the update `choose` picks (pulling its chunks with `fetch`); None if none is chosen.

        `offered` are the answers of this holder's own registration, so the update is applied as an explicit
        reset: it follows that trainer run from then on, at that version.
        """
        update = self.choose(offered, force)
        return None if update is None else self.apply(update, fetch, reset=True)

    def receive(self, update: WeightUpdate, fetch: Fetch) -> ApplyResult:
        """Take a version a trainer pushed (checked against the run and version held, never a reset)."""
        return self.apply(update, fetch, reset=False)

    def subscribe(self, ask: Ask, receiving: Receiving, runs_of: RunsOf | None = None,
                  force: bool = False) -> ApplyResult | None:
        """Register with the trainers (`ask`), take the newest weights offered, and follow the runs of those
        that had none yet from their first update."""
        offered = ask(self.fingerprint(), self.receiver.serving_dtype)
        with receiving(offered) as fetch:
            result = self.take_offered(offered, fetch, force)
        empty = [index for index, update in enumerate(offered) if update is None]
        if empty and runs_of is not None:
            self.receiver.expect_runs(runs_of(empty))
        return result
