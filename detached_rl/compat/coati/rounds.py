"""coati's `fit` rounds and the trainer core whose batches, callbacks and weight pushes follow them."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from detached_rl.compat.coati.callbacks import Callbacks
from detached_rl.compat.coati.settings import coati_metrics
from detached_rl.core.buffer_door import RejectedPushError, check_push
from detached_rl.core.experience import Experience
from detached_rl.trainer.batches import next_batch as buffer_batch
from detached_rl.trainer.core import TrainerCore

#: Fields of coati's own `Experience` (one batch of padded sequences), which `training_step` does not take.
COATI_EXPERIENCE_FIELDS = ("sequences", "action_log_probs", "attention_mask", "action_mask")


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


class CoatiSession:
    """coati's fit over a `TrainerCore`'s public hooks: its batch source (an injected batch, the rounds' next
    batch, else the buffer's), its step callbacks (coati's episode, epoch, batch and update callbacks, coati's
    metric names) and `push_when` (weights pushed at round ends only). `rounds` is set for a coati `fit`."""

    def __init__(self, callbacks: Callbacks | None = None) -> None:
        self.callbacks = callbacks or Callbacks([])
        self.rounds: CoatiRounds | None = None
        self.injected: list[Any] | None = None

    def install(self, core: TrainerCore) -> TrainerCore:
        """Make `core` take its batches from this session and call its callbacks."""
        core.set_batch_source(self)
        core.add_callbacks(self)
        return core

    def inject(self, batch: list[Any]) -> None:
        """Have the next step train on `batch` (coati's `training_step`)."""
        self.injected = batch

    # ---------------------------------------------------------------- BatchSource
    def next_batch(self, core: TrainerCore) -> tuple[list[Any], dict[str, float]]:
        """The injected batch, the rounds' next batch, or the buffer's."""
        if self.injected is not None:
            batch, self.injected = self.injected, None
            return batch, {}
        if self.rounds is not None:
            return self.rounds.next_batch(lambda: buffer_batch(core)[0]), {}
        return buffer_batch(core)

    def push_when(self, step: int) -> bool:
        """Push weights at the end of a round only (coati's `_update_remote_makers` after each round)."""
        return self.rounds is None or self.rounds.at_round_end()

    # ---------------------------------------------------------------- TrainerCallback
    def on_step_start(self, step: int) -> None:
        """coati's episode, epoch and batch start callbacks."""
        if self.rounds is None:
            return
        episode, epoch, index = self.rounds.position()
        if epoch == 0 and index == 0:
            self.callbacks.on_episode_start(episode)
        if index == 0:
            self.callbacks.on_epoch_start(epoch)
        self.callbacks.on_batch_start()

    def on_step_end(self, step: int, metrics: dict[str, float], batch: list[Any]) -> None:
        """coati's metric names; its batch and epoch end callbacks."""
        metrics.update(coati_metrics(metrics))
        if self.rounds is None:
            return
        _, epoch, index = self.rounds.position()
        self.callbacks.on_batch_end(metrics, batch)
        self.rounds.advance()
        if index == self.rounds.update_steps - 1:
            self.callbacks.on_epoch_end(epoch)

    def on_push_start(self, step: int) -> None:
        """coati's update start callback."""
        if self.rounds is not None:
            self.callbacks.on_update_start()

    def on_push_end(self, step: int, metrics: dict[str, float]) -> None:
        """coati's update end and episode end callbacks."""
        if self.rounds is not None:
            self.callbacks.on_update_end()
            self.callbacks.on_episode_end(self.rounds.step // self.rounds.steps_per_round - 1)


def training_batch(experience: Any, core: TrainerCore) -> list[Experience]:
    """What `training_step(experience)` trains on: one `Experience` or a non-empty list of them, each checked
    as a push to `core` would be; anything else is refused naming the element and the field."""
    items = list(experience) if isinstance(experience, list | tuple) else [experience]
    if not items:
        raise ValueError("training_step: experience is empty; pass a list of Experience (at least one)")
    for index, item in enumerate(items):
        if type(item) is not Experience and all(hasattr(item, name) for name in COATI_EXPERIENCE_FIELDS):
            raise TypeError(
                f"training_step: experience[{index}] is coati's batched Experience ({type(item).__name__} "
                f"with {', '.join(COATI_EXPERIENCE_FIELDS)}), which this trainer does not take: pass a list "
                "of detached_rl.core.experience.Experience, one per sample (prompt_ids, response_ids, "
                "log_probs, reward, values); the trainer computes advantages and returns itself")
    buffer = core.buffer
    try:
        check_push(items, core.policy_version, vocab_size=buffer.vocab_size,
                   max_abs_reward=buffer.max_abs_reward, max_sequence_length=buffer.max_sequence_length,
                   buffered=None)
    except RejectedPushError as error:
        raise ValueError(f"training_step: {error}") from None
    return items


def coati_trainer_core(*args: Any, callbacks: Callbacks | None = None, **kwargs: Any) -> TrainerCore:
    """A `TrainerCore` with a `CoatiSession` installed (as `core.batch_source`)."""
    return CoatiSession(callbacks).install(TrainerCore(*args, **kwargs))


#: The former name (a `TrainerCore` with a `CoatiSession`).
CoatiTrainerCore = coati_trainer_core
