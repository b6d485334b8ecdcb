"""The one rule for a maker waiting for newer weights: each poll, `decide` maps what the wait sees to
WAIT, RESYNC, GENERATE or STOP.

A maker waits for weights of some version in two cases. *Paced*: an acknowledgement's
`oldest_useful_version` asks for a version the trainer reaches only once it trains the samples ahead
(the makers' promised batches among them). *Catch-up* (not paced): the maker's samples arrived stale, and
it waits for the version its trainers already hold. "Quiet" is how long the wait has gone without news:
the seconds since it started or since the newest version was seen, whichever is later. The rule, first
match wins:

1. Stop asked: STOP.
2. The version came (none missing): GENERATE.
3. A reason to register again is pending (an update refused as off the trainer's weights, a trainer
   that refused samples as newer than its own version): RESYNC.
4. Paced, with the trainer's update interval known: updates came at a known pace and stopped, so the
   trainer is short of samples (batches promised by other makers did not come): GENERATE once no newer
   version came for `stall_updates` intervals plus one per version still missing (counted from the
   newest version seen; the makers due last give up last). No resync: a maker that is in fact off its
   trainer finds out when its samples arrive stale (a catch-up wait, below) or are refused (rule 3).
5. Otherwise (a catch-up wait, or no interval known: no update came to pace by): the maker may be off
   its trainers' updates (a trainer resumed from a checkpoint, pushes lost): RESYNC once the wait has
   been quiet for `resync_after_s`, or for the timeout if that is shorter, once per wait. A wait never
   times out without registering again first: the update a cut link lost is not sent again while the
   trainer, short of fresh samples, makes no newer one, so a maker that only generated on would feed it
   stale samples for good.
6. Quiet for `timeout_s` (`maker.weight_timeout_s`): GENERATE with the weights held.
7. WAIT.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Update intervals without a newer version before a paced wait counts the trainer as stalled (rule 4).
STALL_UPDATES = 3


class Decision(enum.Enum):
    """What a waiting maker does next."""

    WAIT = "wait"  # poll again
    RESYNC = "resync"  # register with the trainers again, take their newest weights, wait on
    GENERATE = "generate"  # end the wait and generate with the weights held (new enough or not)
    STOP = "stop"  # end the wait: the maker was asked to stop


@dataclass(frozen=True)
class WaitLimits:
    """The policy's settings: `maker.resync_after_s`, the wait's timeout, and `STALL_UPDATES`."""

    resync_after_s: float
    timeout_s: float
    stall_updates: int = STALL_UPDATES

    def __post_init__(self) -> None:
        for name in ("resync_after_s", "timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"WaitLimits.{name} must be > 0, got {value}")
        if self.stall_updates < 1:
            raise ValueError(f"WaitLimits.stall_updates must be >= 1, got {self.stall_updates}")


@dataclass(frozen=True)
class WaitState:
    """What a wait sees at one poll."""

    since_update_s: float  # seconds since the newest policy version was first seen
    update_interval_s: float | None  # estimated seconds between the trainer's updates; None: unknown
    missing: int  # versions still missing (0: the version waited for is here)
    waited_s: float  # seconds this wait has run
    paced: bool  # waiting for a version the trainer has yet to reach (not a catch-up)
    resynced: bool = False  # this wait already registered again for being quiet (rule 5)
    resync_asked: bool = False  # a reason to register again is pending (rule 3)
    stop_asked: bool = False

    def __post_init__(self) -> None:
        for name in ("since_update_s", "waited_s"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"WaitState.{name} must be >= 0 and finite, got {value}")
        if self.update_interval_s is not None and not 0 <= self.update_interval_s < math.inf:
            raise ValueError(f"WaitState.update_interval_s must be >= 0 and finite, or None; got "
                             f"{self.update_interval_s}")
        if self.missing < 0:
            raise ValueError(f"WaitState.missing must be >= 0, got {self.missing}")

    @property
    def quiet_s(self) -> float:
        """Seconds this wait has gone without a newer version: since it started or the newest version came."""
        return min(self.waited_s, self.since_update_s)


def stall_after_s(update_interval_s: float | None, missing: int,
                  stall_updates: int = STALL_UPDATES) -> float | None:
    """Seconds after the newest version at which a paced wait counts as stalled (rule 4); None without an
    interval."""
    if update_interval_s is None:
        return None
    return (stall_updates + missing) * update_interval_s


def stalled(state: WaitState, limits: WaitLimits) -> bool:
    """True when rule 4 applies and its time has come: a paced wait whose updates stopped coming."""
    after = stall_after_s(state.update_interval_s, state.missing, limits.stall_updates)
    return state.paced and after is not None and state.since_update_s >= after


def decide(state: WaitState, limits: WaitLimits) -> Decision:
    """The decision for one poll of a wait (the module docstring has the rule)."""
    if state.stop_asked:
        return Decision.STOP
    if state.missing == 0:
        return Decision.GENERATE
    if state.resync_asked:
        return Decision.RESYNC
    if state.paced and state.update_interval_s is not None:
        if stalled(state, limits):
            return Decision.GENERATE
    elif not state.resynced and state.quiet_s >= min(limits.resync_after_s, limits.timeout_s):
        return Decision.RESYNC
    if state.quiet_s >= limits.timeout_s:
        return Decision.GENERATE
    return Decision.WAIT
