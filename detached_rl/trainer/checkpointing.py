"""A trainer rank's checkpoints: learner, buffer, RNG states and counters, saved atomically."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from detached_rl.core.checkpoint import CheckpointError, load_state, rng_state, save_atomic, set_rng_state
from detached_rl.core.weight_sync import Put
from detached_rl.trainer.resume import merge_buffer_states

if TYPE_CHECKING:
    from detached_rl.trainer.core import TrainerCore


def save_checkpoint(core: TrainerCore, directory: str | Path) -> Path:
    """Save `core`'s rank to `directory/rank_<r>` atomically."""
    path = Path(directory) / f"rank_{core.strategy.rank}"
    with core.weights_lock:
        state = {"policy_version": core.policy_version, "samples_trained": core.samples_trained,
                 "learner": core.learner.state_dict(), "buffer": core.buffer.state_dict(),
                 "rng": rng_state()}
    return save_atomic(state, path)


def load_checkpoint(core: TrainerCore, directory: str | Path, put: Put | None = None) -> None:
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
        with core.delivery.registration_lock:
            # The loaded base may be another than the one fingerprinted at the start: makers holding that one
            # refuse the next LoRA update and register for a full one. Without `adapter_only` it is full.
            core.delivery.refresh_base_fingerprints()
            core.build_update(put, None if core.delivery.adapter_only else "full")
