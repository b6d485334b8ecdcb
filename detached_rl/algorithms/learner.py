"""The `Learner` protocol: everything `TrainerCore` (and the trainer actors) use of a learner, and nothing
more.

`PPOLearner` and `GRPOLearner` satisfy it; a new algorithm needs a class with these members, its
config, and (for the CLI) a config section. `TrainerCore` never reads an algorithm's config.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import nn

from detached_rl.core.experience import Experience
from detached_rl.strategies.base import Strategy

#: `sample(count)`: `count` experiences from this rank's buffer, waiting for them as needed.
Sample = Callable[[int], list[Experience]]


@runtime_checkable
class Learner(Protocol):
    """What a trainer drives: batches in, optimizer steps, weights out, state for checkpoints."""

    #: The training strategy (device, data-parallel collectives, optimizer steps).
    strategy: Strategy
    #: The policy as the strategy prepared it; `strategy.unwrap(actor)` is the `Actor` (model + tokenizer).
    actor: nn.Module
    #: Passes over each batch per `train_step`; `TrainerCore.fit(train_epochs=...)` may set it.
    train_epochs: int
    #: True: `TrainerCore` draws each batch through `make_batch` on each rank (e.g. whole groups, dynamic
    #: sampling); False: plain first-in-first-out batches, waited for on every rank together.
    assembles_batches: bool
    #: How many draws `make_batch` may make for one batch (1 when it never draws again).
    max_sampling_rounds: int

    def synced_models(self) -> dict[str, nn.Module]:
        """The models makers mirror, by name ("actor", and "critic" for PPO)."""
        ...

    def synced_sources(self) -> dict[str, tuple[nn.Module, str]]:
        """Each synced model as (prepared model, key prefix) for the strategy to gather."""
        ...

    def make_batch(self, sample: Sample, size: int) -> tuple[list[Experience], dict[str, float]]:
        """`size` experiences drawn with `sample`, and metrics about the drawing."""
        ...

    def train_step(self, experiences: list[Experience],
                   policy_version: int | None = None) -> dict[str, float]:
        """Train on one batch; returns the step's metrics (names of `detached_rl.algorithms.metrics`)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything training changes (models, optimizers, schedules, counters)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        ...


class EpochsFromConfig:
    """`train_epochs` read from and written to the learner's `config`, refusing
    values below 1 by field name."""

    config: Any

    @property
    def train_epochs(self) -> int:
        """Passes over each batch (the config's `train_epochs`)."""
        return self.config.train_epochs

    @train_epochs.setter
    def train_epochs(self, epochs: int) -> None:
        if epochs < 1:
            raise ValueError(f"{type(self.config).__name__}.train_epochs must be >= 1, got {epochs}")
        self.config.train_epochs = epochs
