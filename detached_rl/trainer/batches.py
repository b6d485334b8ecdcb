"""How a trainer waits for its next batch: every rank together, or per rank where the learner assembles it."""

from __future__ import annotations

import functools
import time
from typing import Any, Protocol, runtime_checkable

from detached_rl.algorithms.learner import Learner
from detached_rl.core.replay_buffer import ReplayBuffer
from detached_rl.strategies.base import Strategy
from detached_rl.trainer.config import TrainerConfig


class TrainerView(Protocol):
    """What drawing a batch reads of a trainer (`TrainerCore` is one)."""

    name: str
    config: TrainerConfig
    buffer: ReplayBuffer
    learner: Learner
    strategy: Strategy
    policy_version: int

    @property
    def stop_requested(self) -> bool:
        """Whether `stop()` asked the running `fit` to end."""
        ...

    def wait_for_batch(self) -> None:
        """Block until every rank holds a full batch."""
        ...


class TrainingStopped(Exception):
    """`stop()` was called while `fit` waited for data."""


@runtime_checkable
class BatchSource(Protocol):
    """Where a `TrainerCore` takes its batches from instead of the buffer (`TrainerCore(batch_source=...)`).

    `next_batch(core)` returns (experiences, batch metrics); it may call `next_batch(core)` of this module
    for the buffer's own next batch.
    """

    def next_batch(self, core: TrainerView) -> tuple[list[Any], dict[str, float]]:
        """The next training batch and its metrics."""
        ...


def wait_for_batch(core: TrainerView) -> None:
    """Block until every rank holds a full batch; all ranks give up together when one times out."""
    size = core.config.train_batch_size
    deadline = time.monotonic() + core.config.batch_timeout_s
    while True:
        available = core.buffer.wait_for(size, core.policy_version,
                                         timeout=min(0.5, core.config.batch_timeout_s))
        if core.strategy.all_true(available >= size):
            return
        if not core.strategy.all_true(not core.stop_requested):
            raise TrainingStopped(f"trainer {core.name!r} was asked to stop")
        if not core.strategy.all_true(time.monotonic() < deadline):
            raise TimeoutError(
                f"trainer {core.name!r} (rank {core.strategy.rank}): no full batch of {size} samples on "
                f"every rank within {core.config.batch_timeout_s:.0f} s (this rank holds {available}); "
                "are the makers running and pushing here?"
            )

def sample_waiting(core: TrainerView, count: int) -> list[Any]:
    """`count` samples from this rank's buffer, waiting up to `batch_timeout_s` (no collectives)."""
    deadline = time.monotonic() + core.config.batch_timeout_s
    while True:
        samples = core.buffer.sample(count, current_version=core.policy_version, timeout=0.5)
        if samples:
            return samples
        if core.stop_requested:
            raise TrainingStopped(f"trainer {core.name!r} was asked to stop")
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"trainer {core.name!r} (rank {core.strategy.rank}): fewer than {count} samples arrived "
                f"within {core.config.batch_timeout_s:.0f} s (buffer holds {len(core.buffer)}); are the "
                "makers running?"
            )

def next_batch(core: TrainerView) -> tuple[list[Any], dict[str, float]]:
    """The next training batch: learner-defined (e.g. whole groups, dynamic sampling) or plain FIFO."""
    if not core.learner.assembles_batches:
        core.wait_for_batch()
        return core.buffer.sample(core.config.train_batch_size, current_version=core.policy_version), {}
    # Assembled per rank without collectives; then every rank learns whether all got a full
    # batch, so no rank enters the gradient all-reduce alone.
    size, error = core.config.train_batch_size, None
    try:
        experiences, stats = core.learner.make_batch(functools.partial(sample_waiting, core), size)
    except (TimeoutError, TrainingStopped) as caught:
        experiences, stats, error = [], {}, caught
    if not core.strategy.all_true(len(experiences) == size):
        if error is not None:
            raise error
        if not experiences:
            raise RuntimeError(
                f"trainer {core.name!r}: dynamic sampling found no group with different rewards in "
                f"{core.learner.max_sampling_rounds} draws; the task is too easy or too hard for the policy"
            )
        raise RuntimeError(f"trainer {core.name!r}: a rank could not assemble a full batch of {size} samples")
    return experiences, stats
