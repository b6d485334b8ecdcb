"""The trainer's logic: replay buffer, training loop, versioned weight updates to its share of the makers.

`TrainerCore` is the plain class inside `DetachedPPOTrainer` and `DetachedGRPOTrainer`; it uses nothing of
its learner (`PPOLearner`, `GRPOLearner`, any `Learner`) beyond the `Learner` protocol. Transport is
injected (`put` stores a weight chunk once; updates go out through `core.weights`, the rank's
`WeightPublisher` of `detached_rl.weights`), so the whole loop runs in unit tests without Ray. Versions: the
weights after step k are version k; a sample's staleness is `policy_version - sample.policy_version`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from detached_rl.algorithms.learner import Learner
from detached_rl.core.replay_buffer import AppendResult, RejectedPushError, ReplayBuffer
from detached_rl.core.staleness import GenerationLedger
from detached_rl.strategies import check_strategy
from detached_rl.trainer.batches import BatchSource, TrainingStopped, next_batch, wait_for_batch
from detached_rl.trainer.checkpointing import load_checkpoint, save_checkpoint
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.quarantine import ProvenanceWatch, served_refusal, trainer_probe_book
from detached_rl.trainer.steps import (  # noqa: F401 - info_means and TrainerCallback re-exported
    PushWhen,
    TrainerCallback,
    info_means,
    samples_per_step,
    skip_message,
    skipped_steps,
)
from detached_rl.weights.publisher import WeightPublisher
from detached_rl.weights.push_queue import SendUpdate, WeightPushQueue
from detached_rl.weights.served_probe import PROBE_KEY
from detached_rl.weights.source import PublishConfig, WeightSource
from detached_rl.weights.update import Put

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TrainerCore:
    """Owns the learner, the replay buffer and the policy version; runs `fit`.

    Public hooks: `batch_source` (`set_batch_source`) replaces where batches come from, `add_callbacks` adds
    step callbacks (`TrainerCallback`), `step()` is one step with `fit`'s bookkeeping, `weights.add_makers`
    adds makers by name, `update_reference` and `with_learner` touch the weights under the weights lock.
    """

    def __init__(self, name: str, learner: Learner, config: TrainerConfig | None = None,
                 batch_source: BatchSource | None = None) -> None:
        self.name = name
        self.batch_source = batch_source
        self.callbacks: list[Any] = []
        self.last_batch: list[Any] = []  # the batch of the latest step
        self.learner = learner
        self.strategy = check_strategy(getattr(learner, "strategy", None),
                                       f"TrainerCore {name!r}: learner.strategy")
        self.config = config or TrainerConfig()
        model_config = self.strategy.unwrap(learner.actor).model.config
        vocab_size = int(model_config.vocab_size)
        max_positions = getattr(model_config, "max_position_embeddings", None)
        # A learner that trains on whole groups says how big (optional, beyond the `Learner` protocol).
        group_size = getattr(learner, "group_size", None)
        if group_size is not None and self.config.train_batch_size % group_size:
            raise ValueError(f"TrainerCore {name!r}: train_batch_size {self.config.train_batch_size} is not "
                             f"a multiple of the learner's group_size {group_size}: batches would split "
                             "groups")
        self.buffer = ReplayBuffer(
            max_sequence_length=(int(max_positions) if isinstance(max_positions, int) and max_positions > 1
                                 else None),
            max_samples=self.config.buffer_max_samples, max_bytes=self.config.buffer_max_bytes,
            max_staleness=self.config.max_staleness, max_reuse=self.config.max_reuse,
            overflow=self.config.buffer_overflow, vocab_size=vocab_size,
            max_abs_reward=self.config.max_abs_reward,
            group_size=group_size,
        )
        self.policy_version = 0
        # Identifies this trainer process (all ranks share rank 0's): makers accept a full update from a new
        # run even at an older version, which is how they follow a trainer resumed from a checkpoint.
        self.run_id = self.strategy.broadcast_object(uuid.uuid4().hex)
        self.state = "idle"
        self.last_error: str | None = None
        # Optimizer steps skipped for a non-finite loss or gradient norm (`algorithms.step_guard`), by reason.
        self.skipped_steps = 0
        self.skip_reasons: Counter[str] = Counter()
        self.last_skip: str | None = None
        self.history: deque[dict[str, float]] = deque(maxlen=self.config.metrics_history)
        # On-version samples checked against the recompute; makers whose samples keep failing, quarantined.
        self.provenance = ProvenanceWatch(self.config.provenance)
        if hasattr(learner, "provenance"):
            learner.provenance = self.config.provenance
        # What each recent version's weights give on the probe text: makers' engines prove what they serve.
        self.served = trainer_probe_book(self.strategy, learner, self.config.provenance.check)
        # Held while the weights change (a training step) and while they are snapshotted for an update.
        self.weights_lock = threading.Lock()
        # Held by a push and while a resume swaps the buffer: no push is acknowledged into a buffer being
        # replaced.
        self.push_lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self.samples_trained = 0
        # a batch has left the buffer and its step has not advanced the version yet
        self._step_in_progress = False
        self._update_steps = 1  # `fit`'s: makers only ever receive versions that are multiples of it
        # The batches acknowledgements told makers to generate next, counted by later ones (paces the makers).
        self._generation = GenerationLedger(self.config.train_batch_size, self.config.max_staleness or 0)
        self.weights = WeightPublisher(
            name, self.run_id,
            WeightSource(models=learner.synced_models, tensors=self._synced_tensors,
                         policy=lambda: self.strategy.unwrap(learner.actor).model, lock=self.weights_lock,
                         version=lambda: self.policy_version),
            self.strategy, PublishConfig.of(self.config), self._report_weight_error)
        for model_name, size in self.weights.synced_in_full.items():
            logger.warning("trainer %s: weight_sync='lora' but the %s has no LoRA; every update carries its "
                           "trainable tensors in full (%d bytes; see weight_sync/bytes/%s). Give it LoRA "
                           "(apply_lora) or freeze it to ship less.", name, model_name, size, model_name)

    def push_experience(self, experiences: list[Any]) -> AppendResult:
        """Append one push to the buffer, tagged against the current version (all-or-nothing).

        Refused (`RejectedPushError`, counted) when oversized, malformed or, for a grouped learner, not whole
        groups.
        """
        with self.push_lock:
            makers = {getattr(e, "maker", None) for e in experiences}
            refusal = self.provenance.refusal(makers, len(experiences))
            if refusal is not None:
                raise RejectedPushError(refusal, field="maker")
            refusal = served_refusal(self.served, experiences, self.config.provenance, self.learner)
            if refusal is not None:
                raise RejectedPushError(refusal, field=f"info.{PROBE_KEY}")
            result = self.buffer.append(experiences, current_version=self.policy_version)
            hint = self.oldest_useful_version(experiences, result)
        return dataclasses.replace(result, oldest_useful_version=hint)

    def admit_generation(self, maker: str, samples: int, batches: int = 1,
                         pulled: tuple[int, float] | None = None) -> list[int] | None:
        """The oldest weights each of the first `batches` batches of `samples` a maker is about to make may
        come from and be trained; they are counted as promised (`GenerationLedger.admit`). None where no
        bound applies (`_paces`). `pulled`: (bytes, seconds) the maker took to pull its registration answer
        from this trainer, which ranks its host for relays before any push (`WeightPublisher.pulled`)."""
        for field, value in (("samples", samples), ("batches", batches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"admit_generation: {field} must be an int >= 1, got {value!r}")
        if pulled is not None:
            pair = isinstance(pulled, (tuple, list)) and len(pulled) == 2
            nbytes, seconds = pulled if pair else (None, None)
            if type(nbytes) is not int or nbytes < 0 or not isinstance(seconds, (int, float)) \
                    or not 0 <= seconds < math.inf:
                raise ValueError("admit_generation: pulled must be (bytes >= 0, seconds >= 0 and finite), "
                                 f"got {pulled!r}")
            self.weights.pulled(maker, nbytes, float(seconds))
        if not self._paces():
            return None
        with self.push_lock:
            return self._generation.admit(maker, samples, batches, *self._ledger_state())

    def _ledger_state(self) -> tuple[int, bool, list[int], int, int]:
        """What the ledger's answers count from: the version, a step under way, the buffered samples'
        versions (in sampling order), the versions makers receive (a multiple of) and a step's samples."""
        return (self.policy_version, self._step_in_progress, self.buffer.sampling_versions(),
                self._update_steps, self._samples_per_step())

    def _paces(self) -> bool:
        """Whether makers are told which weights their next batches need: with a staleness bound, before and
        during `fit` (once it ended, nothing is trained, so no wait would end)."""
        return self.config.max_staleness is not None and self.state in ("idle", "training")

    def oldest_useful_version(self, experiences: list[Any], result: AppendResult) -> int | None:
        """The oldest weights the next batch of the maker of `experiences` can come from and still be trained.

        Counts the buffered samples that will not go stale and the batches other makers were told to
        generate (`GenerationLedger`). None where no bound applies (`_paces`).
        """
        if not self._paces():
            return None
        maker = getattr(experiences[0], "maker", None) if experiences else None
        pushed = max((e.policy_version for e in experiences), default=0)
        return self._generation.acknowledge(maker, len(experiences), result.full, *self._ledger_state(),
                                            pushed)

    def _samples_per_step(self) -> int:
        """What a step took from the buffer lately (`samples_per_step` of the recent history)."""
        return samples_per_step(self.history, self.config.train_batch_size)

    # ---------------------------------------------------------------- weights out (`WeightPublisher`)
    def _synced_tensors(self, trainable_only: bool) -> dict[str, Iterator[tuple[str, torch.Tensor]]]:
        """(name, tensor) streams of the synced models, gathered by the strategy shard by shard."""
        return {
            name: self.strategy.named_tensors(model, prefix, only_trainable=trainable_only)
            for name, (model, prefix) in self.learner.synced_sources().items()
        }

    def _report_weight_error(self, shown: str | None, replaced: str | None) -> None:
        """Show the publisher's error in `last_error` (with `replaced`: only if that one is still shown)."""
        if replaced is None or self.last_error == replaced:
            self.last_error = shown

    def wait_for_batch(self) -> None:
        """Block until every rank holds a full batch; all ranks give up together when one times out."""
        wait_for_batch(self)

    def next_batch(self) -> tuple[list[Any], dict[str, float]]:
        """The next training batch: the batch source's, else learner-defined (e.g. whole groups, dynamic
        sampling) or plain FIFO."""
        if self.batch_source is not None:
            return self.batch_source.next_batch(self)
        return next_batch(self)

    def set_batch_source(self, source: BatchSource | None) -> None:
        """Take batches from `source` (None: from the buffer again)."""
        self.batch_source = source

    def add_callbacks(self, *callbacks: Any) -> None:
        """Call these `TrainerCallback`s (in order, after those added before) at every step and push."""
        self.callbacks.extend(callbacks)

    def _notify(self, hook: str, *args: Any) -> None:
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)

    def update_reference(self, alpha: float) -> bool:
        """Polyak update of the learner's reference model: ref <- alpha * policy + (1 - alpha) * ref, under
        the weights lock; False (nothing done) without a reference or with alpha <= 0."""
        if alpha <= 0 or getattr(self.learner, "reference", None) is None:
            return False
        with self.weights_lock:
            self.learner.update_ref_policy(alpha)  # type: ignore[attr-defined]
        return True

    def with_learner(self, use: Callable[[Learner], T]) -> T:
        """`use(learner)` while the weights do not change (e.g. to save or export them)."""
        with self.weights_lock:
            return use(self.learner)

    def step(self, record: bool = True) -> dict[str, float]:
        """One training step with `fit`'s bookkeeping and no weight push: callbacks, `history` (unless
        `record` is False: the caller adds the row), skip counters, `state` ("training"; "failed" with
        `last_error` when the step raises)."""
        self.state = "training"
        try:
            self._notify("on_step_start", self.policy_version)
            metrics = self.train_step()
            self._notify("on_step_end", self.policy_version, metrics, self.last_batch)
        except TrainingStopped:
            raise
        except BaseException as error:
            self.state = "failed"
            self.last_error = f"{type(error).__name__}: {error}"
            raise
        if record:
            self.history.append(metrics)
        return metrics

    def train_step(self) -> dict[str, float]:
        """Sample a batch, train on it, advance the version; returns metrics reduced across ranks.

        `time/wait_for_batch` is how long the step waited for samples (the trainer's idle time).
        """
        wait_start = time.perf_counter()
        experiences, batch_metrics = self.next_batch()
        self.last_batch = experiences
        batch_metrics = {**batch_metrics, "time/wait_for_batch": time.perf_counter() - wait_start}
        self._step_in_progress = True
        try:
            with self.weights_lock:
                metrics = self.learner.train_step(experiences, policy_version=self.policy_version)
                self.policy_version += 1
                if self.served is not None:
                    self.served.record(self.policy_version)
        finally:
            self._step_in_progress = False
        metrics.update(batch_metrics)
        self._count_skips(metrics)
        self._quarantine(getattr(self.learner, "last_provenance", None))
        self.samples_trained += len(experiences)
        metrics = self.strategy.reduce_metrics(metrics, weight=metrics["tokens"])
        metrics.update(info_means(experiences))  # this rank's samples (ranks may see different info keys)
        for version, count in Counter(e.policy_version for e in experiences).items():
            # this rank's samples
            metrics[f"staleness/hist_{self.policy_version - 1 - version}"] = float(count)
        stats = self.buffer.stats()
        metrics.update({
            "policy_version": float(self.policy_version),
            "buffer/size": float(stats["size"]),
            "buffer/dropped_stale": float(stats["dropped"].get("stale", 0)),
            "buffer/duplicates": float(stats["duplicates"]),
        })
        return metrics

    def _quarantine(self, verdicts: Any) -> None:
        """Count a step's provenance verdicts; quarantine the makers they condemn and drop their samples."""
        for maker in self.provenance.observe(verdicts, self.policy_version - 1):
            with self.push_lock:
                dropped = self.buffer.drop_maker(maker, "quarantined")
            logger.warning("trainer %s: maker %s %s; %d of its samples dropped from the buffer", self.name,
                           maker, self.provenance.quarantined[maker], dropped)

    def _count_skips(self, metrics: Mapping[str, float]) -> None:
        """Add a step's skipped optimizer steps (`skipped_steps` of its metrics) to the counters."""
        reasons = skipped_steps(metrics)
        if reasons:
            self.skipped_steps += sum(reasons.values())
            self.skip_reasons.update(reasons)
            self.last_skip = skip_message(self.policy_version, reasons)
            logger.warning("trainer %s: %s", self.name, self.last_skip)

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Save learner, buffer, RNG states and counters atomically (each rank to its own `rank_<r>`
        folder)."""
        return save_checkpoint(self, directory)

    def load_checkpoint(self, directory: str | Path, put: Put | None = None) -> None:
        """Restore a checkpoint of this rank; with `put`, rebuild the update new makers start from."""
        load_checkpoint(self, directory, put)
        if self.served is not None:
            self.served.restart(self.policy_version)

    def fit(
        self,
        total_steps: int,
        put: Put,
        send_update: SendUpdate | WeightPushQueue,
        update_steps: int = 1,
        train_epochs: int | None = None,
        stop_makers: Callable[[list[str]], None] | None = None,
        checkpoint_every: int = 0,
        checkpoint_dir: str | Path | None = None,
        resume_from: str | Path | None = None,
        push_when: PushWhen | None = None,
    ) -> dict[str, Any]:
        """Train up to step `total_steps`; push weights every `update_steps` steps and at the end (with
        `push_when`, after the steps it returns True for; it gets the policy version after the step).

        With `resume_from`, training continues from a checkpoint (its step counts towards
        `total_steps`); with `checkpoint_every` > 0, a checkpoint is saved to `checkpoint_dir`
        every that many steps and at the end.
        """
        self.state = "training"
        start = time.perf_counter()
        try:
            if checkpoint_every and checkpoint_dir is None:
                raise ValueError("fit: checkpoint_every needs a checkpoint_dir")
            if total_steps < 1 or update_steps < 1:
                raise ValueError(f"fit: total_steps and update_steps must be >= 1, got {total_steps}, "
                                 f"{update_steps}")
            if train_epochs is not None:
                if train_epochs < 1:
                    raise ValueError(f"fit: train_epochs must be >= 1, got {train_epochs}")
                self.learner.train_epochs = train_epochs
            if resume_from is not None:
                self.load_checkpoint(resume_from, put)
                # Makers that registered before the load started from the version it left behind.
                self.weights.offer_latest(send_update)
            self._update_steps = update_steps
            while self.policy_version < total_steps and not self._stop.is_set():
                # Its `history` row is added once the push's metrics are in it: a reader (`run`'s driver polls
                # `metrics`) never sees a step's row without them.
                metrics = self.step(record=False)
                step = self.policy_version
                last = step >= total_steps
                pushed: dict[str, float] = {}
                try:
                    if push_when(step) if push_when is not None else step % update_steps == 0 or last:
                        self._notify("on_push_start", step)
                        pushed = self.weights.publish(put, send_update)
                        self._notify("on_push_end", step, pushed)
                finally:
                    self.history.append({**metrics, **pushed})
                if checkpoint_every and (step % checkpoint_every == 0 or last):
                    self.save_checkpoint(checkpoint_dir)
            self.weights.finish()  # makers hold the last version before they are stopped
        except TrainingStopped:
            # asked to stop while waiting for data: end like a finished run, at this step
            self.weights.finish()
        except BaseException as error:
            self.state = "failed"
            self.last_error = f"{type(error).__name__}: {error}"
            raise
        finally:
            self._stop.clear()  # a stop request ends this run only; a later fit starts fresh
        self.state = "stopped" if self.policy_version < total_steps else "done"
        if stop_makers is not None and self.config.stop_makers_at_end:
            stop_makers(self.weights.makers_of_this_rank())
        return {"steps": len(self.history), "policy_version": self.policy_version,
                "seconds": time.perf_counter() - start, "buffer": self.buffer.stats()}

    def stop(self) -> None:
        """Ask a running `fit` to end after the current step."""
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        """Whether `stop()` asked the running `fit` to end."""
        return self._stop.is_set()

    def status(self) -> dict[str, Any]:
        """Counters for `detached-rl status`."""
        stats = self.buffer.stats()
        elapsed = time.monotonic() - self._started
        return {
            "name": self.name,
            "role": "trainer",
            "rank": self.strategy.rank,
            "world_size": self.strategy.world_size,
            "state": self.state,
            "policy_version": self.policy_version,
            "steps": self.policy_version,
            "buffer_size": stats["size"],
            "buffer_max_samples": stats["max_samples"],
            "samples_trained": self.samples_trained,
            "samples_per_s": self.samples_trained / elapsed if elapsed > 0 else 0.0,
            "makers": sorted(self.weights.makers),
            "stops_makers_at_end": self.config.stop_makers_at_end,
            "skipped_steps": self.skipped_steps,
            "skip_reasons": dict(self.skip_reasons),
            "last_skip": self.last_skip,
            "last_error": self.last_error,
            "provenance": {**self.provenance.status(),
                           "served_mismatch": self.served.mismatches if self.served is not None else {}},
            **self.weights.status(),
        }
