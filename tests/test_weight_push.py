"""`WeightPushQueue` on its own (no Ray, no models): one update in flight per maker, the
newest waits, none blocks."""

import threading
from concurrent.futures import Future

import pytest

from detached_rl.weights.push_queue import WeightPushQueue
from detached_rl.weights.update import ApplyResult, WeightManifest, WeightUpdate


def update(version: int) -> WeightUpdate:
    return WeightUpdate(WeightManifest(version=version, kind="lora", tensors=(), num_chunks=0, total_bytes=0),
                        [])


class Makers:
    """Records every send; each maker answers only when the test resolves its future."""

    def __init__(self, missing: tuple[str, ...] = ()) -> None:
        self.sent: list[tuple[str, int]] = []
        self.futures: dict[str, Future] = {}
        self.missing = missing

    def send(self, maker: str, weights: WeightUpdate) -> Future:
        if maker in self.missing:
            raise LookupError(f"no maker named {maker!r}")
        self.sent.append((maker, weights.manifest.version))
        self.futures[maker] = Future()
        return self.futures[maker]

    def ack(self, maker: str) -> None:
        version = max(v for m, v in self.sent if m == maker)  # the one in flight: the newest sent to it
        self.futures.pop(maker).set_result(ApplyResult(applied=False, staged=True, version=version))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_maker_gets_only_the_newest_update_next_and_offer_never_waits():
    makers = Makers()
    queue = WeightPushQueue(makers.send, timeout=60)
    queue.offer(update(1), ["fast", "slow"])
    assert makers.sent == [("fast", 1), ("slow", 1)]
    makers.ack("fast")
    queue.offer(update(2), ["fast", "slow"])  # "slow" has v1 in flight: v2 waits behind it
    queue.offer(update(3), ["slow"])  # ... and v3 replaces v2, which is never sent
    assert makers.sent == [("fast", 1), ("slow", 1), ("fast", 2)]
    assert queue.superseded == 1 and queue.stats()["waiting"] == {"slow": 3}
    makers.ack("slow")  # v1 acknowledged: v3 goes at once
    queue.settle()
    assert makers.sent[-1] == ("slow", 3) and queue.acked == {"fast": 1, "slow": 1}
    makers.ack("slow")
    makers.ack("fast")
    assert queue.wait(1.0) and queue.acked == {"fast": 2, "slow": 3}
    assert queue.lag(4, ["fast", "slow", "new"]) == {"fast": 2, "slow": 1, "new": 5}
    results = queue.take_results()
    assert {m: r.version for m, r in results.items()} == {"fast": 2, "slow": 3} and queue.take_results() == {}


def test_a_missing_maker_is_a_result_not_an_exception():
    makers = Makers(missing=("gone",))
    queue = WeightPushQueue(makers.send, timeout=60)
    queue.offer(update(1), ["gone", "here"])
    results = queue.take_results()
    assert isinstance(results["gone"], LookupError) and "gone" in str(results["gone"]) and queue.failed == 1
    assert makers.sent == [("here", 1)]


def test_an_unanswered_update_times_out_and_the_next_offer_is_sent_anyway():
    makers, clock = Makers(), Clock()
    queue = WeightPushQueue(makers.send, timeout=10, clock=clock)
    queue.offer(update(1), ["stuck"])
    clock.now = 11
    queue.offer(update(2), ["stuck"])
    assert makers.sent == [("stuck", 1), ("stuck", 2)]
    result = queue.take_results()["stuck"]
    assert isinstance(result, TimeoutError) and "v1" in str(result)
    makers.futures["stuck"].set_result(ApplyResult(applied=False, staged=True, version=2))
    assert queue.acked == {"stuck": 2}


def test_wait_gives_up_on_makers_that_do_not_answer():
    makers = Makers()
    queue = WeightPushQueue(makers.send, timeout=60)
    queue.offer(update(1), ["stuck", "fine"])
    makers.ack("fine")
    assert not queue.wait(0.05)
    results = queue.take_results()
    assert isinstance(results["stuck"], TimeoutError) and results["fine"].version == 1
    assert queue.stats()["in_flight"] == {}


def test_a_refusal_is_the_makers_result_and_leaves_its_acknowledged_version():
    makers = Makers()
    queue = WeightPushQueue(makers.send, timeout=60)
    queue.offer(update(1), ["m"])
    makers.ack("m")
    queue.offer(update(2), ["m"])
    makers.futures.pop("m").set_exception(ValueError("v2: checksum mismatch"))
    assert queue.acked == {"m": 1} and isinstance(queue.take_results()["m"], ValueError)


def test_a_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout"):
        WeightPushQueue(Makers().send, timeout=0)


def test_the_next_update_is_not_sent_from_the_thread_that_completed_the_previous_one():
    """Ray completes a remote call's future on its event thread; sending from there (`ray.get_actor`, a
    remote call) waits for that same thread, and the trainer actor stopped answering."""
    makers = Makers()
    sending_threads: list[str] = []

    def send(maker: str, weights: WeightUpdate) -> Future:
        sending_threads.append(threading.current_thread().name)
        return makers.send(maker, weights)

    queue = WeightPushQueue(send, timeout=60)
    queue.offer(update(1), ["m"])
    queue.offer(update(2), ["m"])  # waits behind v1
    completer = threading.Thread(target=makers.ack, args=("m",), name="ray-event-loop")
    completer.start()
    completer.join()
    queue.settle()
    assert makers.sent == [("m", 1), ("m", 2)]
    assert sending_threads[1] != "ray-event-loop" and sending_threads[1].startswith("weight-push")
