"""A trainer rank's checkpoints: learner, buffer, RNG states and counters, saved atomically."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Protocol

from detached_rl.core.checkpoint import CheckpointError, load_state, rng_state, save_atomic, set_rng_state
from detached_rl.core.replay_buffer import ReplayBuffer
from detached_rl.strategies.base import Strategy
from detached_rl.trainer.resume import merge_buffer_states
from detached_rl.weights.publisher import WeightPublisher
from detached_rl.weights.update import Put


class CheckpointedTrainer(Protocol):
    """What a checkpoint saves and restores of a trainer rank (`TrainerCore` is one)."""

    learner: Any
    buffer: ReplayBuffer
    strategy: Strategy
    weights: WeightPublisher
    weights_lock: threading.Lock
    push_lock: threading.Lock
    policy_version: int
    samples_trained: int


def save_checkpoint(core: CheckpointedTrainer, directory: str | Path) -> Path:
    """Save `core`'s rank to `directory/rank_<r>` atomically."""
    path = Path(directory) / f"rank_{core.strategy.rank}"
    with core.weights_lock:
        state = {"policy_version": core.policy_version, "samples_trained": core.samples_trained,
                 "learner": core.learner.state_dict(), "buffer": core.buffer.state_dict(),
                 "rng": rng_state()}
    return save_atomic(state, path)


def load_checkpoint(core: CheckpointedTrainer, directory: str | Path, put: Put | None = None) -> None:
    """Restore `core`'s rank from `directory`; with `put`, rebuild the update makers start from."""
    state = load_state(Path(directory) / f"rank_{core.strategy.rank}")
    steps = core.strategy.all_gather_object(state["policy_version"])
    if len(set(steps)) > 1:  # ranks save separately: a save interrupted on some rank leaves them apart
        raise CheckpointError(f"{directory}: the ranks' checkpoints are of different steps {steps} "
                              "(a save was interrupted on some rank); resume every rank from one step")
    with core.weights_lock:
        core.learner.load_state_dict(state["learner"])
        # Pushes acknowledged since this trainer started are kept, merged after the restored ones.
        with core.push_lock:
            core.buffer.load_state_dict(merge_buffer_states(state["buffer"], core.buffer.state_dict()))
            core.policy_version, core.samples_trained = state["policy_version"], state["samples_trained"]
        set_rng_state(state["rng"])
    if put is not None:
        core.weights.reload(put)
