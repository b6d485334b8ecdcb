"""The trainer's logic: replay buffer, training loop, versioned weight updates to its share of the makers.

`TrainerCore` is the plain class inside `DetachedPPOTrainer` and `DetachedGRPOTrainer`; the
learner (any `Learner`: `PPOLearner`, `GRPOLearner`) decides what a step does and which models makers
mirror; the trainer uses nothing of it beyond the `Learner` protocol.
Transport is injected: `put` stores a weight chunk once and returns a reference (`ray.put`
in the actor), `send_update` delivers an update to a list of makers and returns per-maker
results, so the whole loop runs in unit tests without Ray.

Versions: `policy_version` counts completed training steps; the weights after step k are
version k. Makers receive versions at sync points (every `update_steps` steps and at the
end of `fit`), so a sample's staleness is `policy_version - sample.policy_version`.
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
from typing import Any

import torch

from detached_rl.algorithms.learner import Learner
from detached_rl.algorithms.metrics import SKIPPED_STEPS, skipped_steps_key
from detached_rl.algorithms.step_guard import SKIP_REASONS
from detached_rl.core.checkpoint import CheckpointError, load_state, rng_state, save_atomic, set_rng_state
from detached_rl.core.replay_buffer import AppendResult, ReplayBuffer
from detached_rl.core.weight_sync import Put, SendStats, WeightUpdate, build_weight_update, state_fingerprint
from detached_rl.models.lora import lora_backend, lora_config_dict
from detached_rl.models.lora_merge import (
    base_fingerprint,
    cast_base_fingerprints,
    dtype_name,
    fingerprint_cast_dtype,
)
from detached_rl.strategies import check_strategy
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.resume import merge_buffer_states
from detached_rl.trainer.staleness import GenerationLedger
from detached_rl.trainer.weight_push import WeightPushQueue

logger = logging.getLogger(__name__)
# A grouped learner's share of the groups a step drew and dropped (GRPO's dynamic sampling): a step takes more
# than `train_batch_size` samples from the buffer, which pacing the makers counts (`_samples_per_step`).
DYNAMIC_SAMPLING_DROPPED = "dynamic_sampling/dropped_fraction"


class TrainingStopped(Exception):
    """`stop()` was called while `fit` waited for data."""

# Delivers an update to the named makers and returns each one's result (an `ApplyResult` or the error).
SendUpdate = Callable[[WeightUpdate, list[str]], Mapping[str, Any]]


def info_means(experiences: list[Any]) -> dict[str, float]:
    """Batch means of the numeric `info` entries every sample carries (reward components, "finished"), as "info/<key>"."""
    if not experiences:
        return {}
    common = set.intersection(*(set(getattr(e, "info", None) or {}) for e in experiences))
    means = {}
    for key in sorted(common):
        values = [e.info[key] for e in experiences]
        if all(isinstance(v, int | float) for v in values):  # bools count as 0/1
            mean = _finite_mean(values)
            if mean is not None:
                means[f"info/{key}"] = mean
    return means


def _finite_mean(values: list[int | float]) -> float | None:
    """The mean of numbers, or None when one is not a finite float (NaN, inf, an int beyond float's range)."""
    try:
        floats = [float(v) for v in values]
    except OverflowError:
        return None
    if not all(math.isfinite(v) for v in floats):
        return None
    scale = max(abs(v) for v in floats) or 1.0  # scaled: a sum of values near float's limit would overflow
    return math.fsum(v / scale for v in floats) / len(floats) * scale


def models_synced_in_full(models: Mapping[str, torch.nn.Module]) -> dict[str, int]:
    """Synced models without LoRA that have trainable parameters, with the bytes of those parameters: what every
    LoRA-only update carries whole (a frozen model without LoRA carries nothing after the first full update)."""
    out = {}
    for name, model in models.items():
        if lora_backend(model) is not None:
            continue
        size = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if size:
            out[name] = size
    return out


def bytes_per_model(update: WeightUpdate) -> dict[str, int]:
    """Bytes an update carries for each synced model (tied aliases counted once), by model name."""
    sizes: dict[str, int] = {}
    for spec in update.manifest.tensors:
        model = spec.name.partition("/")[0]
        sizes[model] = sizes.get(model, 0) + (spec.nbytes if spec.alias_of is None else 0)
    return sizes


def _discard(chunk: Any) -> None:
    """A `put` that keeps nothing (ranks that do not push)."""
    return None


class TrainerCore:
    """Owns the learner, the replay buffer and the policy version; runs `fit`."""

    def __init__(self, name: str, learner: Learner, config: TrainerConfig | None = None) -> None:
        self.name = name
        self.learner = learner
        self.strategy = check_strategy(getattr(learner, "strategy", None), f"TrainerCore {name!r}: learner.strategy")
        self.config = config or TrainerConfig()
        model_config = self.strategy.unwrap(learner.actor).model.config
        vocab_size = int(model_config.vocab_size)
        max_positions = getattr(model_config, "max_position_embeddings", None)
        # A learner that trains on whole groups says how big (optional, beyond the `Learner` protocol).
        group_size = getattr(learner, "group_size", None)
        if group_size is not None and self.config.train_batch_size % group_size:
            raise ValueError(f"TrainerCore {name!r}: train_batch_size {self.config.train_batch_size} is not a "
                             f"multiple of the learner's group_size {group_size}: batches would split groups")
        self.buffer = ReplayBuffer(
            max_sequence_length=int(max_positions) if isinstance(max_positions, int) and max_positions > 1 else None,
            max_samples=self.config.buffer_max_samples, max_bytes=self.config.buffer_max_bytes,
            max_staleness=self.config.max_staleness, max_reuse=self.config.max_reuse,
            overflow=self.config.buffer_overflow, vocab_size=vocab_size, max_abs_reward=self.config.max_abs_reward,
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
        self.makers: set[str] = set()
        self.registered_versions: dict[str, int] = {}
        self.latest_update: WeightUpdate | None = None
        self.fingerprints: dict[int, str] = {}
        self.base_fingerprint: str | None = None
        # dtype name -> the base's fingerprint cast to it, for makers that cast weights (bf16/fp16 makers). Every
        # update carries these, so a maker registered with any rank can check a LoRA update from rank 0.
        self.cast_base_fingerprints: dict[str, str] = {}
        self._base_fingerprint_lock = threading.Lock()
        if self.config.weight_sync == "lora":
            actor_model = self.strategy.unwrap(learner.actor).model
            if lora_backend(actor_model) is None:
                raise ValueError("TrainerConfig.weight_sync='lora' needs a LoRA policy (see detached_rl.models.apply_lora)")
            self.base_fingerprint = base_fingerprint(actor_model)
            self.cast_base_fingerprints = cast_base_fingerprints(actor_model)
        # Synced models without LoRA that training changes (a trained critic): LoRA-only updates carry them whole.
        self.synced_in_full = models_synced_in_full(self.synced_models()) if self.config.weight_sync == "lora" else {}
        for model_name, size in self.synced_in_full.items():
            logger.warning("trainer %s: weight_sync='lora' but the %s has no LoRA; every update carries its trainable "
                           "tensors in full (%d bytes; see weight_sync/bytes/%s). Give it LoRA (apply_lora) or "
                           "freeze it to ship less.", name, model_name, size, model_name)
        # Held while the weights change (a training step) and while they are snapshotted for an update.
        self.weights_lock = threading.Lock()
        # Held by a push and while a resume swaps the buffer: no push is acknowledged into a buffer being replaced.
        self._push_lock = threading.Lock()
        self._stop = threading.Event()
        self._push_queue: WeightPushQueue | None = None  # the latest `fit`'s, when the shell gives one
        # Held while a maker registers and while a resume replaces the update makers start from, so a maker
        # registering during a resume gets the update before or after it, and the resume then reaches it.
        self._registration_lock = threading.Lock()
        self._started = time.monotonic()
        self.samples_trained = 0
        self._step_in_progress = False  # a batch has left the buffer and its step has not advanced the version yet
        self._update_steps = 1  # `fit`'s: makers only ever receive versions that are multiples of it
        # The batches acknowledgements told makers to generate next, counted by later ones (paces the makers).
        self._generation = GenerationLedger(self.config.train_batch_size, self.config.max_staleness or 0)
        self._weight_errors: dict[str, str] = {}  # maker -> its failed weight update, as `last_error` says

    # ---------------------------------------------------------------- experience in
    def push_experience(self, experiences: list[Any]) -> AppendResult:
        """Append one push to the buffer, tagged against the current version (all-or-nothing).

        Refused (`RejectedPushError`, counted) when oversized, malformed or, for a grouped learner, not whole groups.
        """
        with self._push_lock:
            result = self.buffer.append(experiences, current_version=self.policy_version)
            hint = self.oldest_useful_version(experiences, result)
        return dataclasses.replace(result, oldest_useful_version=hint)

    def oldest_useful_version(self, experiences: list[Any], result: AppendResult) -> int | None:
        """The oldest weights the next batch of the maker of `experiences` can come from and still be trained.

        Counts the buffered samples that will not go stale and the batches other makers were told to
        generate (`GenerationLedger`). None without a staleness bound or outside `fit` (nothing is being
        trained, so no wait would end).
        """
        if self.config.max_staleness is None or self.state != "training":
            return None
        maker = getattr(experiences[0], "maker", None) if experiences else None
        buffered = [e.policy_version for e in self.buffer.experiences()]
        pushed = max((e.policy_version for e in experiences), default=0)
        return self._generation.acknowledge(maker, len(experiences), result.full, self.policy_version,
                                            self._step_in_progress, buffered, self._update_steps,
                                            self._samples_per_step(), pushed)

    def _samples_per_step(self) -> int:
        """What a step took from the buffer lately: `train_batch_size`, more where dynamic sampling dropped
        groups (the mean of its recent steps' dropped fraction, at most 3/4)."""
        recent = [self.history[-i] for i in range(1, min(len(self.history), 8) + 1)]
        dropped = [row.get(DYNAMIC_SAMPLING_DROPPED, 0.0) for row in recent]
        fraction = min(sum(dropped) / len(dropped), 0.75) if dropped else 0.0
        return math.ceil(self.config.train_batch_size / (1.0 - fraction))

    # ---------------------------------------------------------------- weights out
    def synced_models(self) -> dict[str, torch.nn.Module]:
        """The models makers mirror (PPO: policy and critic; GRPO: the policy)."""
        return self.learner.synced_models()

    def synced_state(self, trainable_only: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """State dicts of the synced models; with `trainable_only`, just what training changes (LoRA)."""
        return {name: dict(tensors) for name, tensors in self._synced_tensors(trainable_only).items()}

    def _synced_tensors(self, trainable_only: bool) -> dict[str, Iterator[tuple[str, torch.Tensor]]]:
        """(name, tensor) streams of the synced models, gathered by the strategy shard by shard."""
        return {
            name: self.strategy.named_tensors(model, prefix, only_trainable=trainable_only)
            for name, (model, prefix) in self.learner.synced_sources().items()
        }

    @property
    def pushes_weights(self) -> bool:
        """False on ranks other than 0 of a strategy that shards the weights (rank 0 pushes for all)."""
        return not self.strategy.shards_weights or self.strategy.is_rank_zero

    def build_update(self, put: Put, kind: str | None = None) -> tuple[WeightUpdate, SendStats]:
        """Snapshot the current weights into an update ("full", or "lora": trainable tensors only)."""
        kind = kind or ("lora" if self.config.weight_sync == "lora" and self.latest_update is not None else "full")
        update, stats = self._build(put, kind)
        self.latest_update = update
        return update, stats

    def _build(self, put: Put, kind: str) -> tuple[WeightUpdate, SendStats]:
        metadata: dict[str, Any] = {"trainer_run": self.run_id}
        if self.base_fingerprint is not None:
            with self._base_fingerprint_lock:
                cast = dict(self.cast_base_fingerprints)
            metadata.update({"base_fingerprint": self.base_fingerprint, "base_fingerprints": cast,
                             "lora": lora_config_dict(self.synced_models()["actor"])})
        # `put` copies each chunk (ray.put serialises it), so the lock covers the snapshot only.
        with self.weights_lock:
            tensors = self._synced_tensors(trainable_only=kind == "lora")
            if not self.pushes_weights:
                for stream in tensors.values():  # take part in the gather; rank 0 builds the update
                    for _ in stream:
                        pass
                put = _discard
            update, stats = build_weight_update(
                tensors, self.policy_version, put,
                chunk_bytes=self.config.weight_chunk_bytes, kind=kind, metadata=metadata,
            )
            if self.config.record_weights_fingerprint:
                self.fingerprints[self.policy_version] = state_fingerprint(self.synced_state())
        return update, stats

    def register_maker(self, name: str, base_fingerprint: str | None = None, put: Put | None = None
                       ) -> WeightUpdate | None:
        """Record a maker; returns the update it should start from.

        With LoRA sync, a maker that holds the same base weights (equal fingerprint; for a maker that
        casts weights, equal after casting both bases to its dtype) gets the latest LoRA-only update;
        any other maker gets a full update of the current weights.
        """
        with self._registration_lock:
            return self._register(name, base_fingerprint, put)

    def _register(self, name: str, base_fingerprint: str | None, put: Put | None) -> WeightUpdate | None:
        self.makers.add(name)
        self._forget_weight_error(name)
        latest = self.latest_update
        # What the maker will hold once it took the answer (for the lag `status` reports; pushes raise it).
        self.registered_versions[name] = -1 if latest is None else latest.manifest.version
        if self._push_queue is not None:
            self._push_queue.forget(name)  # a maker registering again (restarted) holds what this answer gives it
        if latest is None or latest.manifest.kind == "full":
            return latest
        if base_fingerprint is not None and base_fingerprint == self.base_fingerprint_like(base_fingerprint):
            return self._with_cast_base_fingerprints(latest)
        if put is None:
            raise ValueError("register_maker: this maker needs a full update but no `put` was given")
        if self.strategy.shards_weights:
            # Gathering sharded weights is a collective all ranks must join; one RPC cannot start it.
            raise ValueError(
                f"maker {name!r} holds other base weights (fingerprint {base_fingerprint}) than trainer "
                f"{self.name!r} ({self.base_fingerprint}), which shards its weights (strategy "
                f"{self.strategy.name!r}) and sends LoRA-only updates; start the maker from the trainer's base model"
            )
        return self._build(put, "full")[0]

    def base_fingerprint_like(self, fingerprint: str) -> str | None:
        """This trainer's base fingerprint in the form of a maker's: exact, or cast to the dtype it names."""
        dtype = fingerprint_cast_dtype(fingerprint)
        if dtype is None or self.base_fingerprint is None:
            return self.base_fingerprint
        with self._base_fingerprint_lock:
            key = dtype_name(dtype)
            if key not in self.cast_base_fingerprints:  # a dtype beyond the common ones (fp64 ...): once, on demand
                model = self.strategy.unwrap(self.learner.actor).model
                self.cast_base_fingerprints[key] = base_fingerprint(model, dtype)
            return self.cast_base_fingerprints[key]

    def _with_cast_base_fingerprints(self, update: WeightUpdate) -> WeightUpdate:
        """`update` with this trainer's current cast base fingerprints in its metadata (same chunks)."""
        metadata = update.manifest.metadata
        if "base_fingerprint" not in metadata:
            return update
        with self._base_fingerprint_lock:
            cast = dict(self.cast_base_fingerprints)
        if metadata.get("base_fingerprints") == cast:
            return update
        manifest = dataclasses.replace(update.manifest, metadata={**metadata, "base_fingerprints": cast})
        return WeightUpdate(manifest, update.chunk_refs)

    def makers_of_this_rank(self) -> list[str]:
        """This rank's share of every maker registered with any rank (same answer on every rank)."""
        every = sorted({m for names in self.strategy.all_gather_object(sorted(self.makers)) for m in names})
        if self.strategy.shards_weights:  # only rank 0 holds a whole update
            return every if self.strategy.is_rank_zero else []
        return every[self.strategy.rank :: self.strategy.world_size]

    def sync_weights(self, put: Put, send_update: SendUpdate | WeightPushQueue) -> dict[str, float]:
        """Build an update of the current weights and deliver it to this rank's makers.

        With a `WeightPushQueue` the update is offered to every maker and the step goes on: each
        maker acknowledges once it has verified it (and swaps it in between two of its batches), a
        maker still busy with the previous one gets this one next. Without `overlap_weight_push`, the
        step then waits (up to `weight_push_timeout_s`) for those acknowledgements. A plain
        `send_update` function delivers synchronously.
        """
        if isinstance(send_update, WeightPushQueue):
            return self._offer_weights(put, send_update)
        update, stats = self.build_update(put)
        makers = self.makers_of_this_rank()
        start = time.perf_counter()
        results = self._record_results(send_update(update, makers) if makers else {})
        return self._sync_metrics(update, stats, time.perf_counter() - start, results)

    def _offer_weights(self, put: Put, queue: WeightPushQueue) -> dict[str, float]:
        self._push_queue = queue
        update, stats = self.build_update(put)
        makers = self.makers_of_this_rank()
        start = time.perf_counter()
        queue.offer(update, makers)
        if not self.config.overlap_weight_push:
            queue.wait(self.config.weight_push_timeout_s, makers)
        push_seconds = time.perf_counter() - start
        metrics = self._sync_metrics(update, stats, push_seconds, self._record_results(queue.take_results()))
        lag = queue.lag(update.manifest.version, makers, self.registered_versions)
        behind = self.makers_behind(lag)
        metrics.update({"weight_sync/superseded": float(queue.superseded),
                        "weight_sync/max_maker_lag": float(max(lag.values(), default=0)),
                        "weight_sync/makers_behind": float(len(behind))})
        return metrics

    def makers_behind(self, lag: Mapping[str, int]) -> dict[str, int]:
        """Makers whose newest acknowledged weights trail by more than `max_staleness` versions (none without one)."""
        bound = self.config.max_staleness
        return {} if bound is None else {maker: behind for maker, behind in lag.items() if behind > bound}

    def _sync_metrics(self, update: WeightUpdate, stats: SendStats, push_seconds: float,
                      results: Mapping[str, Any]) -> dict[str, float]:
        failed = sum(isinstance(r, BaseException) for r in results.values())
        # Per model, every synced model named (0 when a LoRA-only update carries none of it, e.g. a frozen critic).
        per_model = {f"weight_sync/bytes/{model}": 0.0 for model in self.synced_models()}
        per_model.update({f"weight_sync/bytes/{model}": float(size) for model, size in bytes_per_model(update).items()})
        return {
            **per_model,
            "time/weight_sync": stats.seconds + push_seconds,
            "weight_sync/version": float(update.manifest.version),
            "weight_sync/bytes": float(stats.bytes),
            "weight_sync/chunks": float(stats.chunks),
            "weight_sync/build_s": stats.seconds,
            "weight_sync/push_s": push_seconds,
            "weight_sync/makers_updated": float(len(results) - failed),  # overlapped: acknowledged since the last push
            "weight_sync/makers_failed": float(failed),
        }

    def finish_weight_push(self) -> Mapping[str, Any]:
        """Wait for weight updates still in flight; each maker's latest result ({} if none)."""
        queue = self._push_queue
        if queue is None:  # pushes by a plain `send_update` were delivered when made
            return {}
        queue.wait(self.config.weight_push_timeout_s)
        return self._record_results(queue.take_results())

    def _record_results(self, results: Mapping[str, Any]) -> Mapping[str, Any]:
        failures = {name: result for name, result in results.items() if isinstance(result, BaseException)}
        for name, error in failures.items():
            if isinstance(error, LookupError):  # no actor by that name any more: stop paying for it
                self.makers.discard(name)
                if self._push_queue is not None:
                    self._push_queue.forget(name)
        if failures:
            self._weight_errors = {name: f"weight update to {name}: {error}"
                                   for name, error in failures.items()}
            self.last_error = "; ".join(self._weight_errors.values())
        return results

    def _forget_weight_error(self, maker: str) -> None:
        """Stop showing `maker`'s failed weight update: a maker registering under that name (a replacement)
        holds what its registration gives it."""
        shown = "; ".join(self._weight_errors.values())
        if self._weight_errors.pop(maker, None) is not None and self.last_error == shown:
            self.last_error = "; ".join(self._weight_errors.values()) or None

    # ---------------------------------------------------------------- training
    def wait_for_batch(self) -> None:
        """Block until every rank holds a full batch; all ranks give up together when one times out."""
        size = self.config.train_batch_size
        deadline = time.monotonic() + self.config.batch_timeout_s
        while True:
            available = self.buffer.wait_for(size, self.policy_version, timeout=min(0.5, self.config.batch_timeout_s))
            if self.strategy.all_true(available >= size):
                return
            if not self.strategy.all_true(not self._stop.is_set()):
                raise TrainingStopped(f"trainer {self.name!r} was asked to stop")
            if not self.strategy.all_true(time.monotonic() < deadline):
                raise TimeoutError(
                    f"trainer {self.name!r} (rank {self.strategy.rank}): no full batch of {size} samples on every "
                    f"rank within {self.config.batch_timeout_s:.0f} s (this rank holds {available}); "
                    "are the makers running and pushing here?"
                )

    def _sample_waiting(self, count: int) -> list[Any]:
        """`count` samples from this rank's buffer, waiting up to `batch_timeout_s` (no collectives)."""
        deadline = time.monotonic() + self.config.batch_timeout_s
        while True:
            samples = self.buffer.sample(count, current_version=self.policy_version, timeout=0.5)
            if samples:
                return samples
            if self._stop.is_set():
                raise TrainingStopped(f"trainer {self.name!r} was asked to stop")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"trainer {self.name!r} (rank {self.strategy.rank}): fewer than {count} samples arrived within "
                    f"{self.config.batch_timeout_s:.0f} s (buffer holds {len(self.buffer)}); are the makers running?"
                )

    def next_batch(self) -> tuple[list[Any], dict[str, float]]:
        """The next training batch: learner-defined (e.g. whole groups, dynamic sampling) or plain FIFO."""
        if not self.learner.assembles_batches:
            self.wait_for_batch()
            return self.buffer.sample(self.config.train_batch_size, current_version=self.policy_version), {}
        # Assembled per rank without collectives; then every rank learns whether all got a full
        # batch, so no rank enters the gradient all-reduce alone.
        size, error = self.config.train_batch_size, None
        try:
            experiences, stats = self.learner.make_batch(self._sample_waiting, size)
        except (TimeoutError, TrainingStopped) as caught:
            experiences, stats, error = [], {}, caught
        if not self.strategy.all_true(len(experiences) == size):
            if error is not None:
                raise error
            if not experiences:
                raise RuntimeError(
                    f"trainer {self.name!r}: dynamic sampling found no group with different rewards in "
                    f"{self.learner.max_sampling_rounds} draws; the task is too easy or too hard for the policy"
                )
            raise RuntimeError(f"trainer {self.name!r}: a rank could not assemble a full batch of {size} samples")
        return experiences, stats

    def train_step(self) -> dict[str, float]:
        """Sample a batch, train on it, advance the version; returns metrics reduced across ranks.

        `time/wait_for_batch` is how long the step waited for samples (the trainer's idle time).
        """
        wait_start = time.perf_counter()
        experiences, batch_metrics = self.next_batch()
        batch_metrics = {**batch_metrics, "time/wait_for_batch": time.perf_counter() - wait_start}
        self._step_in_progress = True
        try:
            with self.weights_lock:
                metrics = self.learner.train_step(experiences, policy_version=self.policy_version)
                self.policy_version += 1
        finally:
            self._step_in_progress = False
        metrics.update(batch_metrics)
        self._count_skips(metrics)
        self.samples_trained += len(experiences)
        metrics = self.strategy.reduce_metrics(metrics, weight=metrics["tokens"])
        metrics.update(info_means(experiences))  # this rank's samples (ranks may see different info keys)
        for version, count in Counter(e.policy_version for e in experiences).items():
            metrics[f"staleness/hist_{self.policy_version - 1 - version}"] = float(count)  # this rank's samples
        stats = self.buffer.stats()
        metrics.update({
            "policy_version": float(self.policy_version),
            "buffer/size": float(stats["size"]),
            "buffer/dropped_stale": float(stats["dropped"].get("stale", 0)),
            "buffer/duplicates": float(stats["duplicates"]),
        })
        return metrics

    def _count_skips(self, metrics: Mapping[str, float]) -> None:
        """Add a step's skipped optimizer steps (the learner's `train/skipped_steps*` metrics) to the counters."""
        skipped = int(metrics.get(SKIPPED_STEPS, 0))
        if not skipped:
            return
        reasons = {reason: int(metrics.get(skipped_steps_key(reason), 0)) for reason in SKIP_REASONS}
        self.skipped_steps += skipped
        self.skip_reasons.update({reason: n for reason, n in reasons.items() if n})
        self.last_skip = (f"step {self.policy_version}: {skipped} optimizer step(s) skipped ("
                          + ", ".join(f"{reason}: {n}" for reason, n in reasons.items() if n)
                          + "); weights and optimizer state unchanged")
        logger.warning("trainer %s: %s", self.name, self.last_skip)

    def save_checkpoint(self, directory: str | Path) -> Path:
        """Save learner, buffer, RNG states and counters atomically (each rank to its own `rank_<r>` folder)."""
        path = Path(directory) / f"rank_{self.strategy.rank}"
        with self.weights_lock:
            state = {"policy_version": self.policy_version, "samples_trained": self.samples_trained,
                     "learner": self.learner.state_dict(), "buffer": self.buffer.state_dict(), "rng": rng_state()}
        return save_atomic(state, path)

    def load_checkpoint(self, directory: str | Path, put: Put | None = None) -> None:
        """Restore a checkpoint of this rank; with `put`, rebuild the update new makers start from."""
        state = load_state(Path(directory) / f"rank_{self.strategy.rank}")
        steps = self.strategy.all_gather_object(state["policy_version"])
        if len(set(steps)) > 1:  # ranks save separately: a save interrupted on some rank leaves them apart
            raise CheckpointError(f"{directory}: the ranks' checkpoints are of different steps {steps} "
                                  "(a save was interrupted on some rank); resume every rank from one step")
        with self.weights_lock:
            self.learner.load_state_dict(state["learner"])
            with self._push_lock:  # pushes acknowledged since this trainer started are kept, merged after the restored
                self.buffer.load_state_dict(merge_buffer_states(state["buffer"], self.buffer.state_dict()))
                self.policy_version, self.samples_trained = state["policy_version"], state["samples_trained"]
            set_rng_state(state["rng"])
        if put is not None:
            with self._registration_lock:  # the first update after a resume is full
                self.build_update(put, "full")

    def offer_resumed_weights(self, send_update: SendUpdate | WeightPushQueue) -> None:
        """Send the weights a resume loaded to every maker registered so far (they started from the version
        this trainer had before loading, which its training has left behind)."""
        update, makers = self.latest_update, self.makers_of_this_rank()
        if update is None or not makers:
            return
        if isinstance(send_update, WeightPushQueue):
            self._push_queue = send_update
            send_update.offer(update, makers)
        else:
            self._record_results(send_update(update, makers))

    def fit(
        self,
        total_steps: int,
        put: Put,
        send_update: SendUpdate,
        update_steps: int = 1,
        train_epochs: int | None = None,
        stop_makers: Callable[[list[str]], None] | None = None,
        checkpoint_every: int = 0,
        checkpoint_dir: str | Path | None = None,
        resume_from: str | Path | None = None,
    ) -> dict[str, Any]:
        """Train up to step `total_steps`; push weights every `update_steps` steps and at the end.

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
                raise ValueError(f"fit: total_steps and update_steps must be >= 1, got {total_steps}, {update_steps}")
            if train_epochs is not None:
                if train_epochs < 1:
                    raise ValueError(f"fit: train_epochs must be >= 1, got {train_epochs}")
                self.learner.train_epochs = train_epochs
            if resume_from is not None:
                self.load_checkpoint(resume_from, put)
                self.offer_resumed_weights(send_update)
            self._update_steps = update_steps
            while self.policy_version < total_steps and not self._stop.is_set():
                metrics = self.train_step()
                step = self.policy_version
                last = step >= total_steps
                if step % update_steps == 0 or last:
                    metrics.update(self.sync_weights(put, send_update))
                if checkpoint_every and (step % checkpoint_every == 0 or last):
                    self.save_checkpoint(checkpoint_dir)
                self.history.append(metrics)
            self.finish_weight_push()  # makers hold the last version before they are stopped
        except TrainingStopped:
            self.finish_weight_push()  # asked to stop while waiting for data: end like a finished run, at this step
        except BaseException as error:
            self.state = "failed"
            self.last_error = f"{type(error).__name__}: {error}"
            raise
        finally:
            self._stop.clear()  # a stop request ends this run only; a later fit starts fresh
        self.state = "stopped" if self.policy_version < total_steps else "done"
        if stop_makers is not None and self.config.stop_makers_at_end:
            stop_makers(self.makers_of_this_rank())
        return {"steps": len(self.history), "policy_version": self.policy_version,
                "seconds": time.perf_counter() - start, "buffer": self.buffer.stats()}

    def stop(self) -> None:
        """Ask a running `fit` to end after the current step."""
        self._stop.set()

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
            "makers": sorted(self.makers),
            "stops_makers_at_end": self.config.stop_makers_at_end,
            "skipped_steps": self.skipped_steps,
            "skip_reasons": dict(self.skip_reasons),
            "last_skip": self.last_skip,
            "last_error": self.last_error,
            **self._push_status(),
        }

    def _push_status(self) -> dict[str, Any]:
        """Weight-push counters and the makers that trail by more than `max_staleness` versions (not waited for)."""
        queue = self._push_queue
        if queue is None:
            return {"weight_push": None, "makers_behind": {}}
        lag = queue.lag(self.policy_version, queue.acked.keys() | set(self.makers), self.registered_versions)
        return {"weight_push": dict(queue.stats()), "makers_behind": self.makers_behind(lag)}
