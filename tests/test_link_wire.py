"""The user-space wire of the multi-host harness (tests/hosts/wire.py) without root: its release rule, its
settings, the netem arguments it stands in for, and its forwarding loop over socket pairs."""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest

from .hosts.wire import LinkCharacter, Wire, netem_args, release_time


def test_release_is_the_delay_later_in_order_and_loss_drops_the_fraction_asked() -> None:
    rng = random.Random(0)
    plain = LinkCharacter(delay_ms=50)
    assert release_time(10.0, plain, 0.0, rng) == pytest.approx(10.05)
    # jitter never reorders: a frame leaves no earlier than the one ahead of it
    jittery, previous, releases = LinkCharacter(delay_ms=20, jitter_ms=15), 0.0, []
    for step in range(1000):
        previous = release_time(step * 0.001, jittery, previous, rng)
        releases.append(previous)
    assert releases == sorted(releases)
    assert all(now * 0.001 + 0.005 <= at for now, at in enumerate(releases))
    lossy = LinkCharacter(loss=0.3)
    lost = sum(release_time(0.0, lossy, 0.0, rng) is None for _ in range(20000))
    assert abs(lost / 20000 - 0.3) < 0.02


@pytest.mark.parametrize("fields", [{"delay_ms": -1}, {"jitter_ms": -0.5}, {"loss": 1.0}, {"loss": -0.1}])
def test_a_character_out_of_range_is_refused_naming_the_field(fields: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(fields))):
        LinkCharacter(**fields)


def test_netem_arguments_say_the_same_link() -> None:
    assert netem_args(LinkCharacter(50, 5, 0.005), 20) == ["netem", "delay", "50ms", "5ms", "loss", "0.5000%",
                                                          "rate", "20000000bit"]
    assert netem_args(LinkCharacter(10), None) == ["netem", "delay", "10ms"]
    assert LinkCharacter().plain and not LinkCharacter(loss=0.01).plain


def test_the_wire_forwards_frames_both_ways_after_the_delay_and_loses_the_fraction_asked() -> None:
    left, left_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    right, right_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in (left_end, right_end):
        end.setblocking(False)
    wire = Wire(left_end.fileno(), right_end.fileno(), LinkCharacter(delay_ms=30))
    runner = threading.Thread(target=wire.run, daemon=True)
    runner.start()
    try:
        right.settimeout(5)
        start = time.monotonic()
        left.send(b"frame-1")
        assert right.recv(100) == b"frame-1" and time.monotonic() - start >= 0.03
        right.send(b"back")
        left.settimeout(5)
        assert left.recv(100) == b"back"
        wire.character = LinkCharacter(loss=0.5)
        for index in range(400):
            left.send(index.to_bytes(4, "big"))
        got = []
        right.settimeout(0.5)
        while True:
            try:
                got.append(int.from_bytes(right.recv(100), "big"))
            except TimeoutError:
                break
        assert got == sorted(got) and 120 < len(got) < 280, len(got)  # in order; 200 +- 8 sd
        assert wire.counts["lost"] == 400 - len(got)
    finally:
        wire.running = False
        runner.join(timeout=5)
        for end in (left, left_end, right, right_end):
            end.close()
