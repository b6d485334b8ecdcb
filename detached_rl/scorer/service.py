"""What a maker sends its batches to: the `ScoringService` protocol, and `LocalScoring` over in-process
scorers.

A maker whose roles are served by remote scorer groups talks to `detached_rl.actors.scorer.RemoteScoring`;
tests and one-process runs use `LocalScoring`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from detached_rl.scorer.requests import ScoreAnswer, ScoreRequest

if TYPE_CHECKING:
    from detached_rl.scorer.core import Scorer

PendingScores = Callable[[float], dict[str, ScoreAnswer]]
"""Waits at most the given seconds and returns each role's answer (raises if a role cannot answer)."""


class ScoringService(Protocol):
    """What a maker sends its batches to when some roles are served elsewhere (remote scorer groups)."""

    roles: frozenset[str]

    def attach(self) -> None:
        """Find the services of every role (may wait); called before the first batch."""
        ...

    def submit(self, request: ScoreRequest, roles: frozenset[str] | None = None) -> PendingScores:
        """Ask every role (or `roles`) at once, without waiting; the returned
        function collects the answers."""
        ...


class LocalScoring:
    """A `ScoringService` over in-process `Scorer`s (tests, and one-process runs)."""

    def __init__(self, scorers: dict[str, Scorer]) -> None:
        for role, scorer in scorers.items():
            if role != scorer.role:
                raise ValueError(f"LocalScoring: scorer under {role!r} serves role {scorer.role!r}")
        self.scorers = dict(scorers)
        self.roles = frozenset(scorers)

    def attach(self) -> None:
        """Nothing to find: the scorers are in this process."""

    def submit(self, request: ScoreRequest, roles: frozenset[str] | None = None) -> PendingScores:
        """Answer at once; the returned function only hands the answers over."""
        asked = self.roles if roles is None else roles
        answers = {role: self.scorers[role].answer([request])[0] for role in asked}
        return lambda timeout: answers
