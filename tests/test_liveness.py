"""`MakerLiveness`, no Ray: makers asked every few seconds without waiting, named once their answer is
overdue (a vanished host, a cut link) and taken off the list by their next answer."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from detached_rl.weights.liveness import MakerLiveness


class Questions:
    def __init__(self) -> None:
        self.asked: list[str] = []
        self.open: dict[str, Future] = {}
        self.missing: set[str] = set()

    def ask(self, maker: str) -> Future:
        if maker in self.missing:
            raise LookupError(f"no maker named {maker!r}")
        self.asked.append(maker)
        self.open[maker] = Future()
        return self.open[maker]

    def answer(self, maker: str) -> None:
        self.open.pop(maker).set_result({"host": "10.0.0.2", "version": None})


def test_a_maker_that_stops_answering_is_named_after_silent_after_and_unnamed_by_its_next_answer() -> None:
    now = [0.0]
    questions = Questions()
    live = MakerLiveness(questions.ask, interval=5, silent_after=15, clock=lambda: now[0])
    live.check(["a", "b"])
    assert sorted(questions.asked) == ["a", "b"]
    questions.answer("a")
    questions.answer("b")
    for step in range(1, 7):  # a answers every question; b's host vanished after its first answer
        now[0] = 5.0 * step
        live.check(["a", "b"])
        if "a" in questions.open:
            questions.answer("a")
    assert questions.asked.count("b") == 2  # one question in the air at a time: never a pile of them
    now[0] = 31.0
    live.check(["a", "b"])
    assert live.silent() == {"b": "no answer for 31 s"}  # heard at 0 s
    questions.answer("b")  # it came back (the link again, or Ray restarted it)
    live.check(["a", "b"])
    assert live.silent() == {}


def test_a_maker_whose_actor_is_gone_is_named_with_the_reason_and_a_departed_one_is_forgotten() -> None:
    now = [0.0]
    questions = Questions()
    live = MakerLiveness(questions.ask, interval=5, silent_after=15, clock=lambda: now[0])
    questions.missing.add("c")
    live.check(["c"])
    now[0] = 16.0
    live.check(["c"])
    assert live.silent() == {"c": "no answer for 16 s (LookupError: no maker named 'c')"}
    live.check([])  # no longer among the trainer's makers (it was forgotten): not named
    assert live.silent() == {}
    live.check(["c"])
    now[0] = 40.0
    live.check(["c"])
    assert "c" in live.silent()
    now[0] = 51.0  # no check for longer than 2 intervals (the trainer's fit ended): no silence is claimed
    assert live.silent() == {}
    with pytest.raises(ValueError, match="interval < silent_after"):
        MakerLiveness(questions.ask, interval=20, silent_after=15)
