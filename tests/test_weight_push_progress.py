"""`WeightPushQueue` telling a slow maker from a dead one (no Ray): asked for progress once a push is older
than the stall interval, it keeps waiting while bytes arrive and fails a stalled or silent transfer, naming
it."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import pytest

from detached_rl.core.transfer import TransferStalled
from detached_rl.weights.push_queue import WeightPushQueue
from detached_rl.weights.update import ApplyResult, WeightManifest, WeightUpdate

STALL = 4.0


def update(version: int) -> WeightUpdate:
    return WeightUpdate(WeightManifest(version=version, kind="full", tensors=(), num_chunks=0, total_bytes=0),
                        [])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Maker:
    """A maker far away: acknowledges when the test says, answers progress questions when the test says."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.push: Future | None = None
        self.questions: list[Future] = []

    def send(self, maker: str, weights: WeightUpdate) -> Future:
        self.sent.append(weights.manifest.version)
        self.push = Future()
        return self.push

    def progress(self, maker: str) -> Future:
        self.questions.append(Future())
        return self.questions[-1]

    def answer(self, **answer: Any) -> None:
        self.questions[-1].set_result({"host": "10.213.0.2", **answer})


def queue_for(maker: Maker, clock: Clock, timeout: float = 60.0) -> WeightPushQueue:
    return WeightPushQueue(maker.send, timeout, clock, progress=maker.progress, stall_timeout=STALL,
                           locate=lambda name: "10.213.0.2", watch=False)


def test_a_push_that_keeps_progressing_is_never_failed_however_long_it_takes() -> None:
    clock, maker = Clock(), Maker()
    queue = queue_for(maker, clock, timeout=60.0)
    queue.offer(update(1), ["far"])
    queue.check()
    assert maker.questions == []  # younger than the stall interval: nobody is asked
    done = 0
    for _ in range(60):  # 60 x 3 s = 180 s, three times the fixed `timeout`
        clock.now += 3.0
        queue.check()
        if maker.questions and not maker.questions[-1].done():
            done += 100_000
            maker.answer(version=1, done=done, total=10**8, seconds=clock.now, idle_s=0.5)
        queue.check()
    assert queue.stats()["in_flight"] == {"far": 1} and queue.failed == 0 and len(maker.questions) > 10
    maker.push.set_result(ApplyResult(applied=False, staged=True, version=1))
    assert queue.take_results()["far"].version == 1 and queue.acked == {"far": 1}


def test_a_push_whose_maker_receives_but_gets_no_bytes_fails_naming_update_maker_host_bytes_rate() -> None:
    clock, maker = Clock(), Maker()
    queue = queue_for(maker, clock)
    queue.offer(update(3), ["far"])
    queue.offer(update(4), ["far"])  # waits behind v3
    clock.now += STALL
    queue.check()
    maker.answer(version=3, done=2_000_000, total=8_000_000, seconds=8.0, idle_s=STALL + 0.5)
    queue.check()
    error = queue.take_results()["far"]
    assert isinstance(error, TransferStalled)
    for part in ("weight update v3 (full)", "maker 'far'", "10.213.0.2", "2.0 MB of 8.0 MB", "2.00 Mbit/s",
                 "no progress for 4.5 s", "stall interval 4 s"):
        assert part in str(error), (part, str(error))
    assert maker.sent == [3, 4]  # the waiting update went out at once
    assert "weight update v3 (full)" in queue.stats()["failures"]["far"]  # shown by `status` meanwhile


def test_a_maker_that_does_not_answer_within_the_stall_interval_fails_its_push() -> None:
    clock, maker = Clock(), Maker()
    queue = queue_for(maker, clock)
    queue.offer(update(5), ["far"])
    clock.now += STALL
    queue.check()
    maker.answer(version=5, done=1_000_000, total=8_000_000, seconds=4.0, idle_s=0.1)
    queue.check()  # progress: keep waiting
    clock.now += STALL
    queue.check()  # asked again; the link is down now: no answer
    clock.now += STALL - 0.1
    queue.check()
    assert queue.take_results() == {}
    clock.now += 0.1
    queue.check()
    error = queue.take_results()["far"]
    assert isinstance(error, TransferStalled)
    for part in ("weight update v5 (full)", "maker 'far'", "10.213.0.2", "1.0 MB of 8.0 MB",
                 "no answer to a progress query within 4 s"):
        assert part in str(error), (part, str(error))


def test_a_maker_that_answers_but_receives_nothing_is_bounded_by_the_timeout_from_the_send() -> None:
    clock, maker = Clock(), Maker()
    queue = queue_for(maker, clock, timeout=20.0)
    queue.offer(update(2), ["busy"])
    while clock.now <= 20.0:
        clock.now += STALL
        queue.check()
        if maker.questions and not maker.questions[-1].done():
            maker.answer(version=None)
            queue.check()
    error = queue.take_results()["busy"]
    assert isinstance(error, TimeoutError) and "not acknowledged within 20 s" in str(error)


def test_wait_without_a_timeout_ends_once_the_watch_fails_a_dead_maker() -> None:
    maker = Maker()
    queue = WeightPushQueue(maker.send, 60.0, progress=maker.progress, stall_timeout=0.3, poll=0.05)
    try:
        queue.offer(update(1), ["dead"])
        waited: list[bool] = []
        waiter = threading.Thread(target=lambda: waited.append(queue.wait(None)), daemon=True)
        waiter.start()  # nobody answers: the watch fails the push after about 2 x 0.3 s
        waiter.join(60)  # a guard against a hang, not a timing
        assert waited == [True]
        assert isinstance(queue.take_results()["dead"], TransferStalled)
    finally:
        queue.close()
    with pytest.raises(ValueError, match="timeout None"):
        WeightPushQueue(maker.send, 60.0).wait(None)
