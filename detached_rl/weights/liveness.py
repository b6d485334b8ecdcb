"""Which makers answer: a trainer asks each of its makers a small question every few seconds, without
waiting, and names those whose answer is overdue (issue 37: a maker whose host vanished is named in
`status` within 30 s, whether or not a weight push to it is under way).

A maker on a node that was killed, or behind a link that was cut, leaves its question unanswered (Ray keeps
retrying, or the actor waits to be restarted): after `silent_after` s it is named with how long it has been
silent; its next answer takes it off the list. Plain code over `ask(maker) -> Future`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

Ask = Callable[[str], "Future[Any]"]


class MakerLiveness:
    """The makers that have not answered for `silent_after` s; `check` asks whoever is due (every
    `interval` s) and never waits."""

    def __init__(self, ask: Ask, interval: float = 5.0, silent_after: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < interval < silent_after:
            raise ValueError(f"MakerLiveness: need 0 < interval < silent_after, got {interval} and "
                             f"{silent_after}")
        self.ask, self.interval, self.silent_after, self.clock = ask, interval, silent_after, clock
        self._heard: dict[str, float] = {}  # maker -> when it last answered (first: when it was first asked)
        self._asked: dict[str, float] = {}  # maker -> when it was last asked
        self._question: dict[str, Future] = {}  # maker -> its question not yet taken
        self._errors: dict[str, str] = {}  # maker -> why its last question failed (e.g. its actor is gone)
        self._checked = -float("inf")  # when `check` last ran
        self._lock = threading.Lock()

    def check(self, makers: Iterable[str]) -> None:
        """Take the answers that came and ask the makers that are due; forget makers not in `makers`."""
        now = self.clock()
        makers = set(makers)
        due = []
        with self._lock:
            self._checked = now
            for maker in self._heard.keys() - makers:
                for table in (self._heard, self._asked, self._question, self._errors):
                    table.pop(maker, None)
            for maker in makers:
                question = self._question.get(maker)
                if question is not None and question.done():
                    self._take(maker, self._question.pop(maker))
                elif question is None and now - self._asked.get(maker, -float("inf")) >= self.interval:
                    self._heard.setdefault(maker, now)
                    self._asked[maker] = now
                    self._question[maker] = Future()  # claimed: asked below, outside the lock
                    due.append(maker)
        for maker in due:
            try:
                question = self.ask(maker)
            except Exception as error:  # noqa: BLE001 - no such actor now: a failed answer
                question = Future()
                question.set_exception(error)
            question.add_done_callback(self._stamp)
            with self._lock:
                if maker in self._question:
                    self._question[maker] = question

    def _stamp(self, question: Future) -> None:
        question.answered_at = self.clock()  # type: ignore[attr-defined]  # heard then, not when taken

    def _take(self, maker: str, question: Future) -> None:
        """Its question came back (hold the lock): an answer, or an error that says why it is silent."""
        error = question.exception()
        if error is None:
            self._heard[maker] = getattr(question, "answered_at", self.clock())
            self._errors.pop(maker, None)
        else:
            self._errors[maker] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"

    def silent(self) -> Mapping[str, str]:
        """maker -> why it is named: how long it has not answered (and its last error, if any); nothing once
        `check` stopped running (no question asked: no silence known)."""
        now = self.clock()
        with self._lock:
            if now - self._checked > 2 * self.interval:
                return {}
            return {maker: f"no answer for {now - heard:.0f} s"
                    + (f" ({self._errors[maker]})" if maker in self._errors else "")
                    for maker, heard in sorted(self._heard.items()) if now - heard >= self.silent_after}
