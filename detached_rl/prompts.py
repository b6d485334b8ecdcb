"""Prompt sources for experience makers: prompts with optional metadata (e.g. ground-truth answers)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class PromptItem:
    """A prompt (text or chat messages) and the metadata its reward function receives."""

    prompt: Any
    metadata: dict[str, Any] = field(default_factory=dict)


def as_prompt_item(item: Any) -> PromptItem:
    """Normalise a str, a `PromptItem`, or anything with `.prompt` and `.metadata` (e.g. a task `Problem`)."""
    if isinstance(item, PromptItem):
        return item
    if isinstance(item, str):
        return PromptItem(item)
    if hasattr(item, "prompt"):
        return PromptItem(item.prompt, dict(getattr(item, "metadata", {}) or {}))
    raise TypeError(f"cannot use {type(item).__name__} as a prompt (need str, PromptItem or .prompt)")


@runtime_checkable
class PromptSource(Protocol):
    """Where a maker gets its prompts."""

    def next_batch(self, count: int) -> list[PromptItem]:
        """The next `count` prompts."""
        ...


class CyclingPrompts:
    """Cycles over a fixed list of prompts in epochs, reshuffled each epoch with a seeded RNG."""

    def __init__(self, items: Sequence[Any], shuffle: bool = True, seed: int = 0) -> None:
        if len(items) == 0:
            raise ValueError("CyclingPrompts: no prompts")
        self.items = [as_prompt_item(item) for item in items]
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order()

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, count: int) -> list[PromptItem]:
        """The next `count` prompts, continuing into the next epoch when this one runs out."""
        batch = []
        while len(batch) < count:
            if self.cursor == len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order()
            batch.append(self.items[self._order[self.cursor]])
            self.cursor += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position in the stream, for exact resume."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position saved by `state_dict`."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._epoch_order()
