"""ExperiencePusher with real ReplayBuffers on a thread pool: acks, policies, backpressure, retries, drops."""

import dataclasses
import itertools
import json
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from detached_rl.core.experience import Experience
from detached_rl.core.replay_buffer import ReplayBuffer
from detached_rl.maker.pusher import ExperiencePusher

_ids = itertools.count()


def make(**kwargs) -> Experience:
    return Experience(
        prompt_ids=torch.tensor([5, 6, 7], dtype=torch.long),
        response_ids=torch.tensor([8, 9], dtype=torch.long),
        log_probs=kwargs.pop("log_probs", torch.tensor([-0.1, -0.2])),
        reward=torch.tensor(1.0),
        id=f"x{next(_ids)}",
        **kwargs,
    )


def batches(count: int, size: int = 2) -> list[list[Experience]]:
    return [[make() for _ in range(size)] for _ in range(count)]


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=8) as pool:
        yield pool


def submitter(executor, buffers, current_version=0, calls=None):
    """The Ray-free `submit`: each trainer is a real ReplayBuffer appended to on a worker thread."""

    def submit(trainer: str, experiences: list[Experience]) -> Future:
        if calls is not None:
            calls.append(trainer)
        return executor.submit(buffers[trainer].append, experiences, current_version)

    return submit


def assert_accounted(pusher: ExperiencePusher, samples: int) -> dict:
    stats = pusher.stats()
    json.dumps(stats)
    assert stats["samples_pushed"] == samples
    assert stats["in_flight"] == stats["waiting_retry"] == 0
    acked = stats["accepted"] + stats["duplicates"] + stats["dropped_stale_by_trainer"]
    counted = acked + sum(stats["dropped"].values())
    assert counted == samples, stats
    return stats


def buffer_ids(buffer: ReplayBuffer) -> list[str]:
    return [exp.id for exp in buffer.take(buffer.max_samples)]


def test_one_trainer_acks_everything():
    buffers = {"t0": ReplayBuffer()}
    # one thread: the trainer answers the pushes in the order they came, so its last answer is the fullest
    # (appends on several threads may answer 15 before 12, and the maker keeps the answer that came last)
    with ThreadPoolExecutor(max_workers=1) as in_order:
        pusher = ExperiencePusher(submitter(in_order, buffers), ["t0"])
        pushes = batches(5, size=3)
        for push in pushes:
            pusher.push(push)
        assert pusher.flush(timeout=5)
    stats = assert_accounted(pusher, 15)
    assert stats["accepted"] == 15 and stats["acked_pushes"] == stats["pushes"] == 5
    assert stats["per_trainer"]["t0"] == {"accepted": 15, "last_size": 15, "failures": 0, "last_version": 0,
                                          "oldest_useful_version": None}
    assert pusher.oldest_useful_version is None  # a bare buffer states no bound
    assert sorted(buffer_ids(buffers["t0"])) == sorted(exp.id for push in pushes for exp in push)
    assert stats["last_error"] is None and stats["dropped"] == {"rejected": 0, "failed": 0, "stopped": 0}


def test_round_robin_spreads_evenly(executor):
    buffers = {name: ReplayBuffer() for name in ("t0", "t1", "t2")}
    calls: list[str] = []
    pusher = ExperiencePusher(submitter(executor, buffers, calls=calls), list(buffers), max_in_flight=3)
    for push in batches(9):
        pusher.push(push)
    assert pusher.flush(timeout=5)
    assert_accounted(pusher, 18)
    assert calls == ["t0", "t1", "t2"] * 3
    assert [len(buffer) for buffer in buffers.values()] == [6, 6, 6]


def test_least_full_sends_to_the_emptier_buffer(executor):
    buffers = {"a": ReplayBuffer(), "b": ReplayBuffer()}
    buffers["a"].append([make() for _ in range(10)], 0)
    calls: list[str] = []
    pusher = ExperiencePusher(
        submitter(executor, buffers, calls=calls), ["a", "b"], max_in_flight=1, policy="least_full"
    )
    for push in batches(7):
        pusher.push(push)
    assert pusher.flush(timeout=5)
    assert_accounted(pusher, 14)
    # Unknown sizes count as 0, so "a" goes first (ties: round-robin order); it reports 12, then
    # "b" gets every push until it catches up, and the tie at 12 goes back to round-robin order.
    assert calls == ["a", "b", "b", "b", "b", "b", "b"]
    assert (len(buffers["a"]), len(buffers["b"])) == (12, 12)


def test_max_in_flight_is_never_exceeded(executor):
    buffers = {"t0": ReplayBuffer(), "t1": ReplayBuffer()}
    lock = threading.Lock()
    outstanding = [0]
    peak = [0]

    def slow_append(trainer, experiences):
        time.sleep(0.02)
        result = buffers[trainer].append(experiences, 0)
        # Before the future resolves: a done-callback could run after the pusher already sent the next push.
        with lock:
            outstanding[0] -= 1
        return result

    def submit(trainer, experiences):
        with lock:
            outstanding[0] += 1
            peak[0] = max(peak[0], outstanding[0])
        return executor.submit(slow_append, trainer, experiences)

    pusher = ExperiencePusher(submit, ["t0", "t1"], max_in_flight=2)
    for push in batches(12):
        pusher.push(push)
        assert pusher.stats()["in_flight"] <= 2
    assert pusher.flush(timeout=5)
    assert_accounted(pusher, 24)
    assert peak[0] == 2


def test_push_blocks_while_max_in_flight_pushes_are_outstanding(executor):
    buffer = ReplayBuffer()
    gate = threading.Event()

    def gated_append(experiences):
        assert gate.wait(5)
        return buffer.append(experiences, 0)

    pusher = ExperiencePusher(lambda _, exps: executor.submit(gated_append, exps), ["t0"], max_in_flight=2)
    pusher.push(batches(1)[0])
    pusher.push(batches(1)[0])
    third = threading.Thread(target=pusher.push, args=(batches(1)[0],))
    third.start()
    third.join(0.3)
    assert third.is_alive(), "the third push should wait for a free slot"
    assert pusher.stats()["in_flight"] == 2
    gate.set()
    third.join(5)
    assert not third.is_alive()
    assert pusher.flush(timeout=5)
    assert assert_accounted(pusher, 6)["accepted"] == 6


def test_full_trainers_back_off_and_nothing_is_lost_or_duplicated(executor):
    buffers = {"t0": ReplayBuffer(max_samples=4), "t1": ReplayBuffer(max_samples=4)}
    sampled: list[str] = []
    stop = threading.Event()

    def consume():
        while not stop.is_set():
            for buffer in buffers.values():
                sampled.extend(exp.id for exp in buffer.take(1))
            time.sleep(0.01)

    consumer = threading.Thread(target=consume)
    pusher = ExperiencePusher(
        submitter(executor, buffers), list(buffers), max_in_flight=2, backoff_initial=0.005, backoff_max=0.02
    )
    pushes = batches(15)
    consumer.start()
    try:
        for push in pushes:
            pusher.push(push)
        assert pusher.flush(timeout=10)
    finally:
        stop.set()
        consumer.join()
    stats = assert_accounted(pusher, 30)
    assert stats["accepted"] == 30 and stats["full_retries"] > 0 and stats["failed_attempts"] == 0
    everywhere = sampled + [sample_id for buffer in buffers.values() for sample_id in buffer_ids(buffer)]
    assert Counter(everywhere) == Counter(exp.id for push in pushes for exp in push)


def test_backoff_doubles_up_to_the_cap_and_resets_on_success(executor):
    buffer = ReplayBuffer(max_samples=2)
    buffer.append([make(), make()], 0)
    now = [0.0]
    submitted_at: list[float] = []

    def submit(_, experiences):
        # Calls 0-3 and 5 find the buffer full; before calls 4 and 6 a trainer drains it.
        if len(submitted_at) in (4, 6):
            buffer.take(2)
        submitted_at.append(now[0])
        return executor.submit(buffer.append, experiences, 0)

    def fake_sleep(seconds):
        now[0] += seconds

    pusher = ExperiencePusher(
        submit, ["t0"], max_in_flight=1, backoff_initial=0.05, backoff_max=0.15,
        sleep=fake_sleep, clock=lambda: now[0],
    )
    pusher.push(batches(1)[0])
    pusher.push(batches(1)[0])
    assert pusher.flush(timeout=5)
    gaps = [b - a for a, b in itertools.pairwise(submitted_at)]
    assert gaps == pytest.approx([0.05, 0.1, 0.15, 0.15, 0.0, 0.05])
    stats = assert_accounted(pusher, 4)
    assert stats["accepted"] == 4 and stats["full_retries"] == 5


def test_a_retried_push_counts_as_duplicates_not_stored_twice(executor):
    buffer = ReplayBuffer()
    pusher = ExperiencePusher(submitter(executor, {"t0": buffer}), ["t0"])
    push = batches(1, size=3)[0]
    pusher.push(push)
    pusher.push(push)
    assert pusher.flush(timeout=5)
    stats = assert_accounted(pusher, 6)
    assert (stats["accepted"], stats["duplicates"], stats["acked_pushes"]) == (3, 3, 2)
    assert len(buffer) == 3


@pytest.mark.parametrize("fails", ["in_the_future", "at_submit"])
def test_a_transient_failure_is_retried(executor, fails):
    buffers = {"t0": ReplayBuffer()}
    submit = submitter(executor, buffers)
    calls = [0]

    def flaky_append(experiences):
        raise ConnectionError("connection reset")

    def flaky_submit(trainer, experiences):
        calls[0] += 1
        if calls[0] > 1:
            return submit(trainer, experiences)
        if fails == "at_submit":
            raise ConnectionError("connection reset")
        return executor.submit(flaky_append, experiences)

    pusher = ExperiencePusher(flaky_submit, ["t0"], backoff_initial=0.01)
    pusher.push(batches(1)[0])
    assert pusher.flush(timeout=5)
    stats = assert_accounted(pusher, 2)
    assert stats["accepted"] == 2 and stats["failed_attempts"] == 1 and calls[0] == 2
    assert stats["per_trainer"]["t0"]["failures"] == 1
    not_sent = "not sent: " if fails == "at_submit" else ""
    assert stats["last_error"] == f"trainer 't0': {not_sent}ConnectionError: connection reset"


def dead_trainer(executor, buffers, dead: str):
    submit = submitter(executor, buffers)
    calls: list[str] = []

    def append_raises(experiences):
        raise ConnectionError(f"actor {dead} died")

    def dead_or_alive(trainer, experiences):
        calls.append(trainer)
        if trainer == dead:
            return executor.submit(append_raises, experiences)
        return submit(trainer, experiences)

    return dead_or_alive, calls


def test_pushes_avoid_a_dead_trainer_and_reach_the_healthy_one(executor):
    buffers = {"dead": ReplayBuffer(), "alive": ReplayBuffer()}
    submit, calls = dead_trainer(executor, buffers, "dead")
    pusher = ExperiencePusher(
        submit, ["dead", "alive"], max_in_flight=1, max_attempts=2, backoff_initial=0.01, backoff_max=5.0
    )
    pushes = batches(8)
    for push in pushes:
        pusher.push(push)
    assert pusher.flush(timeout=5)
    stats = assert_accounted(pusher, 16)
    # Only the first push tried the dead trainer: sent there, it stays there (it may have been stored) and is
    # dropped after its attempts; while the dead trainer cools down every other push goes to the healthy one.
    assert stats["accepted"] == 14 and stats["dropped"]["failed"] == 2
    assert calls[:2] == ["dead", "dead"] and calls.count("dead") == 2
    assert sorted(buffer_ids(buffers["alive"])) == sorted(exp.id for push in pushes[1:] for exp in push)


def test_a_single_dead_trainer_drops_pushes_as_failed_after_max_attempts(executor):
    submit, calls = dead_trainer(executor, {}, "t0")
    pusher = ExperiencePusher(submit, ["t0"], max_attempts=3, backoff_initial=0.005, backoff_max=0.01)
    for push in batches(2, size=3):
        pusher.push(push)
    assert pusher.flush(timeout=5)
    stats = assert_accounted(pusher, 6)
    assert stats["dropped"]["failed"] == 6 and stats["failed_attempts"] == 6 and len(calls) == 6
    assert stats["per_trainer"]["t0"]["failures"] == 6
    assert "after 3 failed attempts" in stats["last_error"] and "'t0'" in stats["last_error"]
    assert "actor t0 died" in stats["last_error"]


def test_a_timed_out_push_is_retried(executor):
    buffer = ReplayBuffer()
    release = threading.Event()
    futures: list[Future] = []

    def stuck_then_fast(experiences, stuck):
        if stuck:
            assert release.wait(5)  # answers only after the pusher gave up on it
        return buffer.append(experiences, 0)

    def submit(_, experiences):
        futures.append(executor.submit(stuck_then_fast, experiences, stuck=not futures))
        return futures[-1]

    pusher = ExperiencePusher(submit, ["t0"], push_timeout=0.2, backoff_initial=0.01)
    push = batches(1, size=3)[0]
    pusher.push(push)
    assert pusher.flush(timeout=5)
    assert not futures[0].done(), "flush should not wait for the abandoned attempt"
    stats = assert_accounted(pusher, 3)
    assert stats["accepted"] == 3 and stats["failed_attempts"] == 1 and len(futures) == 2
    assert "push_timeout=0.2" in stats["last_error"]
    release.set()
    late = futures[0].result(timeout=5)  # the abandoned attempt lands late: duplicates, stored once
    assert late.duplicates == 3
    assert sorted(buffer_ids(buffer)) == sorted(exp.id for exp in push)


def test_a_malformed_push_is_dropped_as_rejected_and_not_retried(executor):
    buffer = ReplayBuffer()
    calls: list[str] = []
    pusher = ExperiencePusher(submitter(executor, {"t0": buffer}, calls=calls), ["t0"])
    pusher.push([make(), make(log_probs=torch.tensor([-0.1, 0.5]))])
    pusher.push(batches(1)[0])
    assert pusher.flush(timeout=5)
    stats = assert_accounted(pusher, 4)
    assert stats["dropped"]["rejected"] == 2 and stats["accepted"] == 2 and len(calls) == 2
    assert stats["failed_attempts"] == 0 and stats["per_trainer"]["t0"]["failures"] == 0
    assert "rejected" in stats["last_error"] and "log_probs" in stats["last_error"]
    assert len(buffer) == 2


def test_should_stop_while_full_drops_as_stopped_and_flush_returns(executor):
    buffer = ReplayBuffer(max_samples=2)
    buffer.append([make(), make()], 0)
    stop = threading.Event()
    pusher = ExperiencePusher(
        submitter(executor, {"t0": buffer}), ["t0"],
        backoff_initial=0.01, backoff_max=0.05, should_stop=stop.is_set,
    )
    pusher.push(batches(1)[0])
    assert pusher.flush(timeout=0.3) is False  # full is not a failure: it keeps retrying
    stats = pusher.stats()
    assert stats["full_retries"] > 1 and stats["failed_attempts"] == 0
    assert stats["in_flight"] + stats["waiting_retry"] == 1
    stop.set()
    assert pusher.flush(timeout=5)
    stats = assert_accounted(pusher, 2)
    assert stats["dropped"]["stopped"] == 2 and stats["accepted"] == 0


def test_stats_can_be_read_from_another_thread_during_pushes(executor):
    buffers = {"t0": ReplayBuffer(max_samples=6), "t1": ReplayBuffer(max_samples=6)}
    snapshots: list[dict] = []
    errors: list[BaseException] = []
    done = threading.Event()
    pusher = ExperiencePusher(
        submitter(executor, buffers), list(buffers), backoff_initial=0.001, backoff_max=0.005
    )

    def read_stats():
        try:
            while not done.is_set():
                snapshot = pusher.stats()
                json.dumps(snapshot)
                snapshots.append(snapshot)
                for buffer in buffers.values():
                    buffer.take(1)
                time.sleep(0.001)
        except BaseException as err:
            errors.append(err)

    reader = threading.Thread(target=read_stats)
    reader.start()
    try:
        for push in batches(40):
            pusher.push(push)
        assert pusher.flush(timeout=10)
    finally:
        done.set()
        reader.join()
    assert not errors and snapshots
    assert all(s["in_flight"] + s["waiting_retry"] <= 2 for s in snapshots)
    assert assert_accounted(pusher, 80)["accepted"] == 80


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(trainers=[]), "trainers"),
        (dict(trainers="t0"), "trainers"),
        (dict(trainers=["t0", "t0"]), "trainers"),
        (dict(max_in_flight=0), "max_in_flight"),
        (dict(policy="random"), "policy"),
        (dict(push_timeout=0), "push_timeout"),
        (dict(push_timeout=float("inf")), "push_timeout"),
        (dict(max_attempts=0), "max_attempts"),
        (dict(backoff_initial=-1), "backoff_initial"),
        (dict(backoff_initial=1.0, backoff_max=0.5), "backoff_max"),
    ],
)
def test_invalid_arguments_are_named(kwargs, name):
    kwargs = {"trainers": ["t0"], **kwargs}
    with pytest.raises(ValueError, match=name):
        ExperiencePusher(lambda trainer, experiences: Future(), **kwargs)


def test_a_timed_out_push_is_retried_on_the_same_trainer(executor):
    """The abandoned attempt may still land: a retry elsewhere would store the samples twice."""
    buffers = {"t0": ReplayBuffer(), "t1": ReplayBuffer()}
    release = threading.Event()
    calls: list[str] = []

    def stuck_then_fast(name, experiences, stuck):
        if stuck:
            assert release.wait(5)
        return buffers[name].append(experiences, 0)

    def submit(name, experiences):
        calls.append(name)
        return executor.submit(stuck_then_fast, name, experiences, stuck=len(calls) == 1)

    pusher = ExperiencePusher(submit, ["t0", "t1"], push_timeout=0.2, backoff_initial=0.01)
    push = batches(1, size=3)[0]
    pusher.push(push)
    assert pusher.flush(timeout=5)
    release.set()
    time.sleep(0.2)
    assert calls == ["t0", "t0"]
    assert len(buffers["t0"]) == 3 and len(buffers["t1"]) == 0
    assert_accounted(pusher, 3)


def test_the_trainers_acknowledgements_say_how_new_the_next_batch_must_be(executor):
    buffers = {"t0": ReplayBuffer(), "t1": ReplayBuffer()}
    bounds = {"t0": 3, "t1": 5}

    def submit(trainer: str, experiences: list[Experience]) -> Future:
        def append():
            result = buffers[trainer].append(experiences, 0)
            return dataclasses.replace(result, oldest_useful_version=bounds[trainer])
        return executor.submit(append)

    pusher = ExperiencePusher(submit, ["t0", "t1"], max_in_flight=1)
    pusher.push(batches(1)[0])
    assert pusher.flush(timeout=5) and pusher.oldest_useful_version is None  # t1 has not bounded it yet
    pusher.push(batches(1)[0])  # round robin: t1 answers last
    assert pusher.flush(timeout=5) and pusher.oldest_useful_version == 3  # the lower bound: good for both
    assert pusher.stats()["per_trainer"]["t0"]["oldest_useful_version"] == 3


def reply_lost_once(executor, buffers, calls):
    """A transport whose first attempt reaches the trainer and stores the push, but whose answer is lost."""

    def store_then_fail(trainer, experiences):
        buffers[trainer].append(experiences, 0)
        raise ConnectionError("connection reset after the call was sent")

    def submit(trainer, experiences):
        calls.append(trainer)
        if len(calls) == 1:
            return executor.submit(store_then_fail, trainer, experiences)
        return executor.submit(buffers[trainer].append, experiences, 0)

    return submit


def test_a_push_whose_answer_failed_is_retried_on_the_same_trainer_and_stored_once(executor):
    buffers = {"t0": ReplayBuffer(), "t1": ReplayBuffer()}
    calls: list[str] = []
    pusher = ExperiencePusher(reply_lost_once(executor, buffers, calls), ["t0", "t1"], backoff_initial=0.01)
    push = batches(1, size=3)[0]
    pusher.push(push)
    assert pusher.flush(timeout=5)
    assert calls == ["t0", "t0"]  # t0 is cooling down after its failure, yet the retry may not go to t1
    stats = assert_accounted(pusher, 3)
    assert (stats["accepted"], stats["duplicates"], stats["failed_attempts"]) == (0, 3, 1)
    everywhere = buffer_ids(buffers["t0"]) + buffer_ids(buffers["t1"])
    assert sorted(everywhere) == sorted(exp.id for exp in push)


def test_a_pinned_push_is_dropped_after_its_attempts_rather_than_sent_to_another_trainer(executor):
    """The trainer died after the call was sent and is not running: a checkpoint of it may hold the push."""
    buffers = {"t0": ReplayBuffer(), "t1": ReplayBuffer()}
    calls: list[str] = []
    healthy = submitter(executor, buffers)

    def died(experiences):
        raise ConnectionError("actor t0 died")

    def submit(trainer, experiences):
        calls.append(trainer)
        if trainer == "t1":
            return healthy(trainer, experiences)
        if calls.count("t0") == 1:
            return executor.submit(died, experiences)
        raise ConnectionError("trainer 't0' is not running")  # later attempts: nothing is sent

    pusher = ExperiencePusher(submit, ["t0", "t1"], max_in_flight=1, max_attempts=3, backoff_initial=0.005,
                              backoff_max=0.01)
    lost, later = batches(2)
    pusher.push(lost)
    assert pusher.flush(timeout=5)
    pusher.push(later)  # a new push is free to go to the healthy trainer
    assert pusher.flush(timeout=5)
    assert calls == ["t0", "t0", "t0", "t1"]
    stats = assert_accounted(pusher, 4)
    assert stats["dropped"]["failed"] == 2 and stats["accepted"] == 2
    assert sorted(buffer_ids(buffers["t1"])) == sorted(exp.id for exp in later)
    assert "after 3 failed attempts" in stats["last_error"] and "not running" in stats["last_error"]


def test_a_push_that_was_never_sent_may_go_to_another_trainer(executor):
    buffers = {"t0": ReplayBuffer(), "t1": ReplayBuffer()}
    calls: list[str] = []
    healthy = submitter(executor, buffers)

    def submit(trainer, experiences):
        calls.append(trainer)
        if trainer == "t0":
            raise ConnectionError("trainer 't0' is not running")
        return healthy(trainer, experiences)

    pusher = ExperiencePusher(submit, ["t0", "t1"], backoff_initial=0.01)
    push = batches(1, size=3)[0]
    pusher.push(push)
    assert pusher.flush(timeout=5)
    assert calls == ["t0", "t1"]
    assert assert_accounted(pusher, 3)["accepted"] == 3
    assert sorted(buffer_ids(buffers["t1"])) == sorted(exp.id for exp in push) and len(buffers["t0"]) == 0


def test_a_weight_update_error_while_registering_again_is_retried_not_rejected(executor):
    """`submit` registers with a restarted trainer before it sends; taking that trainer's weights may fail."""
    from detached_rl.weights.update import WeightUpdateError

    buffer = ReplayBuffer()
    healthy = submitter(executor, {"t0": buffer})
    registrations = [0]

    def submit(trainer, experiences):
        registrations[0] += 1
        if registrations[0] <= 2:
            raise WeightUpdateError("chunk 3 of version 7 failed its checksum")
        return healthy(trainer, experiences)

    pusher = ExperiencePusher(submit, ["t0"], backoff_initial=0.01)
    push = batches(1, size=3)[0]
    pusher.push(push)
    assert pusher.flush(timeout=5)
    stats = assert_accounted(pusher, 3)
    assert stats["accepted"] == 3 and stats["dropped"]["rejected"] == 0 and stats["failed_attempts"] == 2
    assert sorted(buffer_ids(buffer)) == sorted(exp.id for exp in push)


def test_the_fresh_weights_bound_is_the_lowest_of_every_trainers_acknowledgement():
    from detached_rl.core.replay_buffer import AppendResult

    hints = {"rank_0": 3, "rank_1": 1}

    def submit(trainer, experiences):
        future = Future()
        future.set_result(AppendResult(accepted=len(experiences), duplicates=0, dropped_stale=0, evicted=0,
                                       full=False, size=len(experiences), nbytes=0, current_version=0,
                                       oldest_useful_version=hints[trainer]))
        return future

    pusher = ExperiencePusher(submit, ["rank_0", "rank_1"], policy="round_robin")
    pusher.push(batches(1)[0])
    pusher.flush(timeout=5)
    # Only rank_0 answered: rank_1 (of the same group, say) may be starving for the next batch, so no wait.
    assert pusher.oldest_useful_version is None
    pusher.push(batches(1)[0])
    pusher.flush(timeout=5)
    assert pusher.oldest_useful_version == 1
