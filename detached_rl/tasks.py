"""Deterministic verifiable tasks: prompts with known answers, split into train and held-out sets."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """A prompt and its ground-truth numeric answer."""

    prompt: str
    answer: int

    @property
    def metadata(self) -> dict[str, int]:
        """Keyword arguments for the reward function."""
        return {"answer": self.answer}


def addition_problems(count: int, seed: int = 0, low: int = 1, high: int = 20, split: str = "train") -> list[Problem]:
    """`count` problems "What is a + b?"; train and held-out splits never share a pair (a, b)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(1234).shuffle(pairs)  # fixed split, independent of `seed`
    held_out = len(pairs) // 5
    pool = pairs[:held_out] if split == "test" else pairs[held_out:]
    rng = random.Random(seed)
    chosen = [pool[rng.randrange(len(pool))] for _ in range(count)]
    return [Problem(f"What is {a} + {b}? Answer with a number.", a + b) for a, b in chosen]
