"""coati's `fit` rounds and the trainer core whose batches, callbacks and weight pushes follow them."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from detached_rl.compat.coati.callbacks import Callbacks
from detached_rl.compat.coati.settings import coati_metrics
from detached_rl.trainer.core import TrainerCore


class CoatiRounds:
    """coati's `fit`: rounds of `update_steps` fresh batches, then `train_epochs - 1` shuffled re-runs."""

    def __init__(self, update_steps: int, train_epochs: int, seed: int = 0) -> None:
        if update_steps < 1 or train_epochs < 1:
            raise ValueError(f"update_steps and train_epochs must be >= 1, got {update_steps}, "
                             f"{train_epochs}")
        self.update_steps, self.train_epochs = update_steps, train_epochs
        self.step = 0
        self.recorded: list[Any] = []
        self._order: list[int] = []
        self._rng = random.Random(seed)

    @property
    def steps_per_round(self) -> int:
        """Training steps between two weight pushes."""
        return self.update_steps * self.train_epochs

    def position(self) -> tuple[int, int, int]:
        """(round, epoch, batch) of the next step."""
        within = self.step % self.steps_per_round
        return self.step // self.steps_per_round, within // self.update_steps, within % self.update_steps

    def next_batch(self, fresh: Callable[[], Any]) -> Any:
        """The next step's batch: fresh (and kept) in a round's first epoch, else a kept one, shuffled."""
        _, epoch, index = self.position()
        if epoch == 0:
            if index == 0:
                self.recorded = []
            self.recorded.append(fresh())
            return self.recorded[-1]
        if index == 0:
            self._order = list(range(len(self.recorded)))
            self._rng.shuffle(self._order)
        return self.recorded[self._order[index]]

    def advance(self) -> None:
        """The step was trained."""
        self.step += 1

    def at_round_end(self) -> bool:
        """True right after a round's last step (time to push weights)."""
        return self.step > 0 and self.step % self.steps_per_round == 0


class CoatiTrainerCore(TrainerCore):
    """`TrainerCore` whose batches follow `CoatiRounds` during a coati `fit` (or one given to
    `training_step`), pushing weights only at round ends and calling coati's callbacks."""

    def __init__(self, *args: Any, callbacks: Callbacks | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.callbacks = callbacks or Callbacks([])
        self.rounds: CoatiRounds | None = None
        self.injected: list[Any] | None = None
        self.last_batch: list[Any] | None = None

    def next_batch(self) -> tuple[list[Any], dict[str, float]]:
        """The injected batch, the rounds' next batch, or the buffer's."""
        if self.injected is not None:
            batch, self.injected = self.injected, None
        elif self.rounds is not None:
            fresh = super().next_batch
            batch = self.rounds.next_batch(lambda: fresh()[0])
        else:
            return super().next_batch()
        self.last_batch = batch
        return batch, {}

    def train_step(self) -> dict[str, float]:
        """One coati training step, with coati's episode, epoch and batch callbacks."""
        if self.rounds is None:
            return coati_metrics(super().train_step())
        episode, epoch, index = self.rounds.position()
        if epoch == 0 and index == 0:
            self.callbacks.on_episode_start(episode)
        if index == 0:
            self.callbacks.on_epoch_start(epoch)
        self.callbacks.on_batch_start()
        metrics = coati_metrics(super().train_step())
        self.callbacks.on_batch_end(metrics, self.last_batch)
        self.rounds.advance()
        if index == self.rounds.update_steps - 1:
            self.callbacks.on_epoch_end(epoch)
        return metrics

    def sync_weights(self, put: Any, send_update: Any) -> dict[str, float]:
        """Push weights at the end of a round only (coati's `_update_remote_makers` after each round)."""
        if self.rounds is None:
            return super().sync_weights(put, send_update)
        if not self.rounds.at_round_end():
            return {}
        self.callbacks.on_update_start()
        metrics = super().sync_weights(put, send_update)
        self.callbacks.on_update_end()
        self.callbacks.on_episode_end(self.rounds.step // self.rounds.steps_per_round - 1)
        return metrics
