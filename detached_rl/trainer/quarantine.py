"""Which makers' samples keep falling outside the honest band, and the quarantine that follows.

The learner checks each step's on-version samples (`algorithms.provenance`) and takes those outside their
bound out of the step. `ProvenanceWatch` counts the verdicts per maker; a maker with
`quarantine_after` samples outside among its last `window` checked ones is quarantined: the trainer refuses
its pushes (naming the reason) and drops its samples still in the buffer. The run goes on with the others.
Not thread-safe on its own: the trainer calls `observe` from its step and `refusal` under its push lock.
The served-adapter proof a push carries is checked here too (`served_refusal`, `weights.served_probe`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from detached_rl.algorithms.mismatch import UNKNOWN_ENGINE, experience_engine
from detached_rl.algorithms.provenance import ProvenanceVerdicts
from detached_rl.core.sample_checks import ProvenanceConfig
from detached_rl.weights.served_probe import ProbeBook, model_probe, probe_ids, proof_of


class ProvenanceWatch:
    """Per-maker counts of checked and outside samples, and the makers quarantined (with the reason)."""

    def __init__(self, config: ProvenanceConfig) -> None:
        self.config = config
        self._recent: dict[str, deque[bool]] = {}
        self.checked: dict[str, int] = {}
        self.outside: dict[str, int] = {}
        self.quarantined: dict[str, str] = {}
        self.refused_pushes: dict[str, int] = {}
        self.refused_samples: dict[str, int] = {}

    def observe(self, verdicts: ProvenanceVerdicts | None, version: int) -> list[str]:
        """Count a step's verdicts (trained at `version`); the makers quarantined by them."""
        if verdicts is None:
            return []
        newly = []
        rows = zip(verdicts.makers, verdicts.gaps, verdicts.bounds, verdicts.outside, strict=True)
        for maker, gap, bound, outside in rows:
            key = str(maker)
            recent = self._recent.setdefault(key, deque(maxlen=self.config.window))
            recent.append(outside)
            self.checked[key] = self.checked.get(key, 0) + 1
            if outside:
                self.outside[key] = self.outside.get(key, 0) + 1
            if key not in self.quarantined and sum(recent) >= self.config.quarantine_after:
                self.quarantined[key] = (
                    f"quarantined at v{version}: {sum(recent)} of its last {len(recent)} on-version samples "
                    f"were not made by the policy they name (mean log-prob gap {gap:.3g} a token against "
                    f"the trainer's recompute, honest bound {bound:.3g}; trainer.provenance, "
                    "docs/operations.md#security)")
                newly.append(key)
        return newly

    def refusal(self, makers: set[str | None], samples: int) -> str | None:
        """Why a push of `samples` from `makers` is refused (one is quarantined), counted; None: it is not."""
        for maker in sorted(str(m) for m in makers):
            reason = self.quarantined.get(maker)
            if reason is not None:
                self.refused_pushes[maker] = self.refused_pushes.get(maker, 0) + 1
                self.refused_samples[maker] = self.refused_samples.get(maker, 0) + samples
                return f"maker {maker!r} is {reason}; its pushes are refused"
        return None

    def status(self) -> dict[str, Any]:
        """What `status` shows: the quarantined makers and every checked maker's counts."""
        return {
            "quarantined": dict(self.quarantined),
            "makers": {maker: {"checked": count, "outside": self.outside.get(maker, 0),
                               "refused_pushes": self.refused_pushes.get(maker, 0),
                               "refused_samples": self.refused_samples.get(maker, 0)}
                       for maker, count in sorted(self.checked.items())},
        }


#: Strategies whose every rank holds the whole policy (a forward of it on one rank is no collective).
WHOLE_WEIGHT_STRATEGIES = ("naive", "ddp", "colossalai_ddp", "colossalai_zero2")


def trainer_probe_book(strategy: Any, learner: Any, check: bool) -> ProbeBook | None:
    """The trainer's `ProbeBook` over its policy, its initial weights recorded as version 0; None when the
    check is off or the strategy shards the policy (Gemini: the probe would be a collective)."""
    if not check or getattr(strategy, "name", None) not in WHOLE_WEIGHT_STRATEGIES:
        return None
    actor = strategy.unwrap(learner.actor)
    ids = probe_ids(actor.tokenizer)
    book = ProbeBook(lambda: model_probe(actor.model, ids))
    book.record(0)
    return book


def served_refusal(book: ProbeBook | None, experiences: list[Any], config: ProvenanceConfig,
                   learner: Any) -> str | None:
    """Why a push is refused for its served-adapter proof (`ProbeBook.check`); None: it is not."""
    proof = proof_of(experiences) if book is not None else None
    if proof is None:
        return None
    engine = experience_engine(getattr(experiences[0], "info", {}) or {})
    bound = config.bound_for(engine, getattr(learner, "engine", UNKNOWN_ENGINE))
    return book.check(str(getattr(experiences[0], "maker", None)), proof, bound, len(experiences))

