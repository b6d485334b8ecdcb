"""ExperiencePusher telling a slow trainer link from a dead one (no Ray, a fake clock): a push its trainer is
still receiving is never failed for taking long; one that stalls or whose trainer does not answer fails,
pinned, and is retried to the same trainer with the same ids (at most once across trainers)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from detached_rl.core.experience import Experience
from detached_rl.core.replay_buffer import AppendResult, ReplayBuffer
from detached_rl.maker.pusher import ExperiencePusher

STALL = 4.0


def make(index: int) -> Experience:
    return Experience(prompt_ids=torch.tensor([5, 6, 7]), response_ids=torch.tensor([8, 9]),
                      log_probs=torch.tensor([-0.1, -0.2]), reward=torch.tensor(1.0), id=f"p{index}")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Trainers:
    """Two trainers with real buffers; an attempt is answered when the test says, progress likewise."""

    def __init__(self) -> None:
        self.buffers = {"t1": ReplayBuffer(), "t2": ReplayBuffer()}
        self.attempts: list[tuple[str, list[str], Future]] = []
        self.questions: list[tuple[str, Future]] = []

    def submit(self, trainer: str, experiences: list[Experience]) -> Future:
        self.attempts.append((trainer, [e.id for e in experiences], Future()))
        return self.attempts[-1][2]

    def progress(self, trainer: str) -> Future:
        self.questions.append((trainer, Future()))
        return self.questions[-1][1]

    def answer(self, *transfers: dict[str, Any]) -> None:
        self.questions[-1][1].set_result({"host": "10.213.0.1", "transfers": list(transfers)})

    def deliver(self, experiences: list[Experience]) -> None:
        """The newest attempt lands: its trainer appends it and acknowledges."""
        trainer, _, future = self.attempts[-1]
        future.set_result(self.buffers[trainer].append(experiences, 0))


def pusher_for(trainers: Trainers, clock: Clock, push_timeout: float = 60.0) -> ExperiencePusher:
    return ExperiencePusher(trainers.submit, ["t1", "t2"], push_timeout=push_timeout, clock=clock,
                            sleep=lambda s: None, progress=trainers.progress, stall_timeout=STALL,
                            backoff_initial=0.5, backoff_max=1.0)


def test_a_push_the_trainer_keeps_receiving_is_never_failed_however_long_it_takes() -> None:
    clock, trainers = Clock(), Trainers()
    pusher = pusher_for(trainers, clock, push_timeout=30.0)
    batch = [make(i) for i in range(4)]
    pusher.push(batch)
    for step in range(40):  # 40 x 3 s = 120 s: four times push_timeout
        clock.now += 3.0
        pusher.flush(timeout=0)
        if trainers.questions and not trainers.questions[-1][1].done():
            trainers.answer({"done": 100_000 * (step + 1), "total": 10**8, "seconds": clock.now,
                             "idle_s": 1.0})
        pusher.flush(timeout=0)
    stats = pusher.stats()
    assert stats["in_flight"] == 1 and stats["failed_attempts"] == 0 and len(trainers.questions) > 10
    trainers.deliver(batch)
    assert pusher.flush(timeout=0) and pusher.stats()["accepted"] == 4


def test_a_silent_trainer_fails_the_attempt_which_is_retried_to_it_with_the_same_ids() -> None:
    clock, trainers = Clock(), Trainers()
    pusher = pusher_for(trainers, clock)
    batch = [make(i) for i in range(10, 14)]
    pusher.push(batch)
    first, ids, _ = trainers.attempts[0]
    clock.now += STALL
    pusher.flush(timeout=0)  # asked how the push arrives
    trainers.answer({"done": 300_000, "total": 900_000, "seconds": 4.0, "idle_s": 0.2})
    pusher.flush(timeout=0)
    clock.now += STALL
    pusher.flush(timeout=0)  # asked again: the link is down, no answer comes
    clock.now += STALL
    pusher.flush(timeout=0)
    stats = pusher.stats()
    assert stats["failed_attempts"] == 1, stats
    for part in (f"trainer {first!r}: push of 4 samples", "to its host 10.213.0.1", "300.0 KB of 900.0 KB",
                 "no answer to a progress query within 4 s"):
        assert part in stats["last_error"], (part, stats["last_error"])
    clock.now += 2.0
    pusher.flush(timeout=0)  # the retry is due
    assert [(t, i) for t, i, _ in trainers.attempts] == [(first, ids), (first, ids)]  # pinned, same ids
    trainers.deliver(batch)
    assert pusher.flush(timeout=0)
    assert pusher.stats()["accepted"] == 4 and len(trainers.buffers[first]) == 4


def test_a_transfer_that_stalls_fails_naming_the_push_the_bytes_and_the_rate() -> None:
    clock, trainers = Clock(), Trainers()
    pusher = pusher_for(trainers, clock)
    pusher.push([make(i) for i in range(20, 22)])
    clock.now += STALL
    pusher.flush(timeout=0)
    trainers.answer({"done": 2_000_000, "total": 8_000_000, "seconds": 8.0, "idle_s": 5.0})
    pusher.flush(timeout=0)
    error = pusher.stats()["last_error"]
    for part in ("push of 2 samples", "to its host 10.213.0.1", "no progress for 5.0 s (stall interval 4 s)",
                 "stalled: 2.0 MB of 8.0 MB in 8.0 s (2.00 Mbit/s)"):
        assert part in error, (part, error)


def test_a_trainer_that_answers_but_receives_nothing_is_bounded_by_push_timeout() -> None:
    clock, trainers = Clock(), Trainers()
    pusher = pusher_for(trainers, clock, push_timeout=20.0)
    pusher.push([make(30)])
    while clock.now < 20.0:
        clock.now += STALL
        pusher.flush(timeout=0)
        if trainers.questions and not trainers.questions[-1][1].done():
            trainers.answer()  # alive, nothing from this maker arriving
            pusher.flush(timeout=0)
    assert pusher.stats()["failed_attempts"] == 1
    assert "no answer within push_timeout=20 s" in pusher.stats()["last_error"]


def test_without_progress_push_timeout_bounds_every_attempt_as_before() -> None:
    clock, trainers = Clock(), Trainers()
    pusher = ExperiencePusher(trainers.submit, ["t1"], push_timeout=10.0, clock=clock, sleep=lambda s: None)
    pusher.push([make(40)])
    clock.now += 10.0
    pusher.flush(timeout=0)
    assert pusher.stats()["failed_attempts"] == 1 and trainers.questions == []


def test_appended_results_count_as_before() -> None:
    clock, trainers = Clock(), Trainers()
    pusher = pusher_for(trainers, clock)
    batch = [make(50), make(51)]
    pusher.push(batch)
    trainers.deliver(batch)
    assert pusher.flush(timeout=0)
    assert isinstance(trainers.attempts[0][2].result(), AppendResult) and pusher.stats()["accepted"] == 2
