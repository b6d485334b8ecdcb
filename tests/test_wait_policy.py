"""The maker's one wait policy (`detached_rl/maker/wait_policy.py`) as a table: what a wait sees at one
poll -> what it does. Limits: resync after 30 s, time out after 300 s, stall after 3 intervals plus one per
version missing."""

from __future__ import annotations

import math

import pytest

from detached_rl.maker.wait_policy import Decision, WaitLimits, WaitState, decide, stall_after_s, stalled

LIMITS = WaitLimits(resync_after_s=30.0, timeout_s=300.0, stall_updates=3)
WAIT, RESYNC, GENERATE, STOP = Decision.WAIT, Decision.RESYNC, Decision.GENERATE, Decision.STOP

# since_update_s, update_interval_s, missing, waited_s, paced, resynced, resync_asked, stop_asked -> decision
ROWS = [
    # 1. Stop asked: stop, whatever else holds.
    ("stop", 0.0, None, 1, 0.0, True, False, False, True, STOP),
    ("stop over a resync asked", 500.0, 2.0, 3, 500.0, False, False, True, True, STOP),
    ("stop with the version here", 0.0, None, 0, 0.0, True, False, False, True, STOP),
    # 2. The version came: generate, however long it took.
    ("came", 0.0, 2.0, 0, 1.0, True, False, False, False, GENERATE),
    ("came after the timeout", 400.0, None, 0, 400.0, False, True, False, False, GENERATE),
    ("came with a resync asked", 1.0, None, 0, 1.0, True, False, True, False, GENERATE),
    # 3. A reason to register again: resync at once, paced or not, pace known or not, already resynced or not.
    ("resync asked, paced", 0.0, 2.0, 1, 0.0, True, False, True, False, RESYNC),
    ("resync asked, catch-up", 0.0, None, 1, 0.0, False, False, True, False, RESYNC),
    ("resync asked again", 40.0, None, 1, 40.0, True, True, True, False, RESYNC),
    # 4. Paced with a known pace: the stall rule, (3 + missing) intervals after the newest version.
    ("paced, before the stall", 11.99, 2.0, 3, 11.99, True, False, False, False, WAIT),
    ("paced, at the stall", 12.0, 2.0, 3, 12.0, True, False, False, False, GENERATE),
    ("paced, one missing, before", 7.99, 2.0, 1, 7.99, True, False, False, False, WAIT),
    ("paced, one missing, at", 8.0, 2.0, 1, 8.0, True, False, False, False, GENERATE),
    # ... counted from the newest version even when it came before the wait began
    ("paced, stalled at the start", 8.0, 2.0, 1, 0.0, True, False, False, False, GENERATE),
    # ... and never a resync for being quiet: quiet past resync_after_s, short of the stall, it waits
    ("paced, quiet past resync_after_s", 60.0, 20.0, 3, 60.0, True, False, False, False, WAIT),
    ("paced, quiet past resync_after_s, resynced", 60.0, 20.0, 3, 60.0, True, True, False, False, WAIT),
    # ... a stall due after the timeout: the timeout ends the wait the same way
    ("paced, slow pace, before the timeout", 299.99, 100.0, 1, 299.99, True, False, False, False, WAIT),
    ("paced, slow pace, at the timeout", 300.0, 100.0, 1, 300.0, True, False, False, False, GENERATE),
    # 5. No pace known (paced) or a catch-up: resync once quiet for resync_after_s, once per wait.
    ("no pace, before resync_after_s", 29.99, None, 2, 29.99, True, False, False, False, WAIT),
    ("no pace, at resync_after_s", 30.0, None, 2, 30.0, True, False, False, False, RESYNC),
    ("no pace, resynced", 30.0, None, 2, 30.0, True, True, False, False, WAIT),
    ("catch-up, pace known, before resync_after_s", 29.99, 2.0, 1, 29.99, False, False, False, False, WAIT),
    ("catch-up, pace known, no stall rule", 12.0, 2.0, 3, 12.0, False, False, False, False, WAIT),
    ("catch-up, at resync_after_s", 30.0, 2.0, 1, 30.0, False, False, False, False, RESYNC),
    ("catch-up, resynced", 200.0, 2.0, 1, 200.0, False, True, False, False, WAIT),
    # quiet: since the later of the wait's start and the newest version
    ("newest version long ago, wait just begun", 100.0, None, 1, 5.0, True, False, False, False, WAIT),
    ("wait long, newest version just came", 5.0, None, 1, 100.0, False, False, False, False, WAIT),
    ("quiet 35 s", 40.0, None, 1, 35.0, False, False, False, False, RESYNC),
    # 6. Quiet for the timeout: generate with the weights held.
    ("no pace, resynced, before the timeout", 299.99, None, 1, 299.99, True, True, False, False, WAIT),
    ("no pace, resynced, at the timeout", 300.0, None, 1, 300.0, True, True, False, False, GENERATE),
    ("catch-up, resynced, at the timeout", 300.0, 2.0, 1, 300.0, False, True, False, False, GENERATE),
    # a resync the wait never got to (the resync rule first): the timeout waits for it
    ("no pace, timeout before resync", 300.0, None, 1, 300.0, True, False, False, False, RESYNC),
]


@pytest.mark.parametrize(
    ("since", "interval", "missing", "waited", "paced", "resynced", "resync_asked", "stop", "expected"),
    [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_the_policy_decides_as_the_table_says(since, interval, missing, waited, paced, resynced, resync_asked,
                                              stop, expected):
    state = WaitState(since_update_s=since, update_interval_s=interval, missing=missing, waited_s=waited,
                      paced=paced, resynced=resynced, resync_asked=resync_asked, stop_asked=stop)
    assert decide(state, LIMITS) is expected


def test_the_table_covers_every_decision():
    assert {row[-1] for row in ROWS} == set(Decision)


def test_stalled_tells_the_stall_rule_from_the_timeout():
    """A paced wait that generates without its weights: `stalled` says whether the stall rule ended it."""
    def paced(since: float, interval: float | None) -> WaitState:
        return WaitState(since, interval, missing=1, waited_s=since, paced=True)

    at_stall, at_timeout, no_pace = paced(8.0, 2.0), paced(300.0, 100.0), paced(300.0, None)
    catch_up = WaitState(since_update_s=300.0, update_interval_s=2.0, missing=1, waited_s=300.0, paced=False)
    assert all(decide(state, LIMITS) is GENERATE for state in (at_stall, at_timeout))
    assert stalled(at_stall, LIMITS)
    assert not any(stalled(state, LIMITS) for state in (at_timeout, no_pace, catch_up))
    assert stall_after_s(2.0, 3) == 12.0 and stall_after_s(2.0, 0, stall_updates=5) == 10.0
    assert stall_after_s(None, 3) is None


@pytest.mark.parametrize(("make", "field"), [
    (lambda: WaitLimits(resync_after_s=0.0, timeout_s=1.0), "WaitLimits.resync_after_s"),
    (lambda: WaitLimits(resync_after_s=1.0, timeout_s=-1.0), "WaitLimits.timeout_s"),
    (lambda: WaitLimits(resync_after_s=1.0, timeout_s=1.0, stall_updates=0), "WaitLimits.stall_updates"),
    (lambda: WaitState(-1.0, None, 1, 0.0, True), "WaitState.since_update_s"),
    (lambda: WaitState(0.0, None, 1, math.nan, True), "WaitState.waited_s"),
    (lambda: WaitState(0.0, -2.0, 1, 0.0, True), "WaitState.update_interval_s"),
    (lambda: WaitState(0.0, math.inf, 1, 0.0, True), "WaitState.update_interval_s"),
    (lambda: WaitState(0.0, None, -1, 0.0, True), "WaitState.missing"),
])
def test_bad_input_is_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


def test_a_wait_registers_again_before_it_times_out_with_resync_after_s_beyond_the_timeout():
    """A catch-up wait shorter than `resync_after_s` (a maker with `weight_timeout_s` 5 s) whose update a cut
    lost: it resyncs once at the timeout, not generating stale samples for good (the fault test's m2)."""
    limits = WaitLimits(resync_after_s=60.0, timeout_s=10.0)

    def state(waited: float, resynced: bool) -> WaitState:
        return WaitState(since_update_s=waited, update_interval_s=None, missing=1, waited_s=waited,
                         paced=False, resynced=resynced)

    assert decide(state(9.99, False), limits) is WAIT
    assert decide(state(10.0, False), limits) is RESYNC
    assert decide(state(10.0, True), limits) is GENERATE
