"""`detached_rl.cli.placing` without a cluster: the placement wait's bound, its message and its variable."""

from __future__ import annotations

import pytest

from detached_rl.cli.cluster import JobError
from detached_rl.cli.placing import (
    PLACEMENT_TIMEOUT_VARIABLE,
    ActorRow,
    placement_timeout,
    wait_placed,
    why_unplaced,
)


def test_message_names_the_request_what_is_free_and_the_restarting_rival() -> None:
    rows = [ActorRow("m3", "PENDING_CREATION", placed=False, required={"CPU": 1, "maker_host": 1}),
            ActorRow("m2", "RESTARTING", placed=True, required={"CPU": 1, "maker_host": 1}),
            ActorRow("m1", "ALIVE", placed=True, required={"CPU": 1, "maker_host": 1}),
            ActorRow("t", "RESTARTING", placed=True, required={"CPU": 1, "trainer_host": 1})]
    message = why_unplaced("maker 'm3'", "m3", {"CPU": 1.0, "maker_host": 1.0}, rows,
                           {"CPU": 3.0, "maker_host": 0.0}, 15.0)
    assert message.startswith("maker 'm3' (asking for 1 CPU, 1 maker_host) did not start within 15 s; "
                              "the cluster has 3 CPU, 0 GPU, 0 maker_host free; waiting for the same "
                              "resources: 'm2'")
    assert "'m1'" not in message and "'t'" not in message  # only the actors that wait for a node


def test_the_wait_is_bounded_and_ends_once_placed(monkeypatch: pytest.MonkeyPatch) -> None:
    import detached_rl.cli.placing as placing

    now = [0.0]
    table = [ActorRow("m3", "PENDING_CREATION", placed=False, required={"maker_host": 1})]
    monkeypatch.setattr(placing, "actor_rows", lambda namespace: table)
    monkeypatch.setattr("ray.available_resources", lambda: {"CPU": 1.0})
    sleep = lambda s: now.__setitem__(0, now[0] + s)  # noqa: E731
    with pytest.raises(JobError, match="did not start within 10 s"):
        wait_placed("maker 'm3'", "m3", "ns", {"maker_host": 1.0}, 10.0, clock=lambda: now[0], sleep=sleep)
    table[0] = ActorRow("m3", "PENDING_CREATION", placed=True, required={"maker_host": 1})
    now[0] = 0.0
    wait_placed("maker 'm3'", "m3", "ns", {"maker_host": 1.0}, 10.0, clock=lambda: now[0], sleep=sleep)
    assert now[0] == 0.0  # placed (constructor running): no wait


@pytest.mark.parametrize("raw", ["0", "-3", "nan", "soon"])
def test_a_bad_variable_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(PLACEMENT_TIMEOUT_VARIABLE, raw)
    with pytest.raises(JobError, match=PLACEMENT_TIMEOUT_VARIABLE):
        placement_timeout()
    monkeypatch.setenv(PLACEMENT_TIMEOUT_VARIABLE, "15")
    assert placement_timeout() == 15.0
