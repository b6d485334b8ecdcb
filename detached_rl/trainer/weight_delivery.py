"""A trainer's weight delivery: builds versioned updates and delivers them to its makers, through a push
queue only.

`WeightDelivery` belongs to one `TrainerCore`: it records the makers that registered (and the update each
starts from), snapshots the synced models into updates (full, or LoRA-only with the base's fingerprints) and
hands them to a `WeightPushQueue`. A caller with a plain `send_update(update, makers) -> {maker: result}`
function gets a queue over it (`push_queue_over`); nothing else delivers weights.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from detached_rl.core.text import first_line
from detached_rl.core.weight_sync import Put, SendStats, WeightUpdate, state_fingerprint
from detached_rl.models.base_fingerprint import (
    base_fingerprint,
    cast_base_fingerprints,
    dtype_name,
    fingerprint_cast_dtype,
)
from detached_rl.models.lora import lora_backend, lora_config_dict
from detached_rl.trainer.weight_push import Send, WeightPushQueue
from detached_rl.trainer.wire_variants import WireVariants

if TYPE_CHECKING:
    from detached_rl.trainer.core import TrainerCore

logger = logging.getLogger(__name__)

# Delivers an update to the named makers and returns each one's result (an `ApplyResult` or the error).
SendUpdate = Callable[[WeightUpdate, list[str]], Mapping[str, Any]]


def models_synced_in_full(models: Mapping[str, torch.nn.Module]) -> dict[str, int]:
    """Synced models without LoRA that have trainable parameters, with the bytes of those parameters: what
    every LoRA-only update carries whole (a frozen model without LoRA carries nothing after the first full
    update)."""
    out = {}
    for name, model in models.items():
        if lora_backend(model) is not None:
            continue
        size = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        if size:
            out[name] = size
    return out


def adapters_complete(models: Mapping[str, torch.nn.Module]) -> bool:
    """Whether LoRA-only updates leave out nothing but the policy's ("actor") base: every other synced model
    has no LoRA and only trainable tensors (carried whole), so a maker that proves it holds the base holds
    the rest of a version once it has one LoRA-only update."""
    for name, model in models.items():
        if name == "actor":
            if lora_backend(model) is None:
                return False
            continue
        if lora_backend(model) is not None:
            return False
        trainable = {key for key, tensor in model.state_dict(keep_vars=True).items()
                     if isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad}
        if trainable != set(model.state_dict()):
            return False
    return True


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


def synchronous_send(send_update: SendUpdate) -> Send:
    """A queue's `send` over a plain `send_update`: delivers to one maker at a time, in the caller's
    thread."""

    def send(maker: str, update: WeightUpdate) -> Future:
        future: Future = Future()
        result = send_update(update, [maker]).get(maker)
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
        return future

    return send


def push_queue_over(send_update: SendUpdate | WeightPushQueue, timeout: float,
                    reuse: WeightPushQueue | None = None) -> WeightPushQueue:
    """The queue to deliver through: `send_update` itself when it is one, else a queue over it (`reuse`'s
    state kept: what makers acknowledged), sending synchronously (the one adapter for plain functions)."""
    if isinstance(send_update, WeightPushQueue):
        return send_update
    if reuse is None:
        return WeightPushQueue(synchronous_send(send_update), timeout)
    reuse.send = synchronous_send(send_update)
    return reuse


class WeightDelivery:
    """Registered makers, the update each starts from, and the pushes of new versions to them
    (`TrainerCore`'s)."""

    def __init__(self, core: TrainerCore) -> None:
        self.core = core
        self.makers: set[str] = set()
        self.registered_versions: dict[str, int] = {}
        self.latest_update: WeightUpdate | None = None
        self.fingerprints: dict[int, str] = {}
        self.base_fingerprint: str | None = None
        # dtype name -> the base's fingerprint cast to it, for makers that cast weights (bf16/fp16 makers).
        # Every update carries these, so a maker registered with any rank can check a LoRA update from rank 0.
        self.cast_base_fingerprints: dict[str, str] = {}
        self._base_fingerprint_lock = threading.Lock()
        config, strategy = core.config, core.strategy
        if config.weight_sync == "lora":
            actor_model = strategy.unwrap(core.learner.actor).model
            if lora_backend(actor_model) is None:
                raise ValueError("TrainerConfig.weight_sync='lora' needs a LoRA policy "
                                 "(see detached_rl.models.apply_lora)")
            self.base_fingerprint = base_fingerprint(actor_model)
            self.cast_base_fingerprints = cast_base_fingerprints(actor_model)
        # Synced models without LoRA that training changes (a trained critic): LoRA-only updates carry them
        # whole.
        self.synced_in_full = (models_synced_in_full(self.synced_models()) if config.weight_sync == "lora"
                               else {})
        # LoRA-only from version 0 on: what a LoRA-only update leaves out is then the policy's base alone,
        # which a maker proves it holds (its base fingerprint, checked before anything is fetched).
        self.adapter_only = config.weight_sync == "lora" and adapters_complete(self.synced_models())
        # Makers that serve a lower precision get updates in it, full ones as sparse deltas where they fit.
        self.wire = WireVariants(self.synced_models(),
                                 deltas=config.sparse_deltas and config.weight_sync == "full")
        self.variant_bytes: dict[str, int] = {}  # the latest update's bytes per wire variant (metrics)
        self.queue: WeightPushQueue | None = None  # the latest push's
        self._adapted: WeightPushQueue | None = None  # the queue over plain `send_update` functions
        # Held while a maker registers and while a resume replaces the update makers start from, so a maker
        # registering during a resume gets the update before or after it, and the resume then reaches it.
        self.registration_lock = threading.Lock()
        self.errors: dict[str, str] = {}  # maker -> its failed weight update, as the core's `last_error` says
        # Makers whose latest weight update failed (dead, unreachable, restarting): maker -> why. A later
        # acknowledgement or a registration under that name (a restarted or replacing maker) clears it.
        self.lost: dict[str, str] = {}

    def synced_models(self) -> dict[str, torch.nn.Module]:
        """The models makers mirror (PPO: policy and critic; GRPO: the policy)."""
        return self.core.learner.synced_models()

    def synced_tensors(self, trainable_only: bool) -> dict[str, Iterator[tuple[str, torch.Tensor]]]:
        """(name, tensor) streams of the synced models, gathered by the strategy shard by shard."""
        return {
            name: self.core.strategy.named_tensors(model, prefix, only_trainable=trainable_only)
            for name, (model, prefix) in self.core.learner.synced_sources().items()
        }

    @property
    def pushes_weights(self) -> bool:
        """False on ranks other than 0 of a strategy that shards the weights (rank 0 pushes for all)."""
        return not self.core.strategy.shards_weights or self.core.strategy.is_rank_zero

    def build_update(self, put: Put, kind: str | None = None) -> tuple[WeightUpdate, SendStats]:
        """Snapshot the current weights into an update ("full", or "lora": trainable tensors only).

        A LoRA trainer's updates are LoRA-only from version 0 on (`adapter_only`; makers with another base get
        a full one when they register), else from the version after its first full one."""
        lora = self.adapter_only or (self.core.config.weight_sync == "lora"
                                     and self.latest_update is not None)
        update, stats, self.variant_bytes, _ = self._build(put, kind or ("lora" if lora else "full"))
        self.latest_update = update
        return update, stats

    def _build(self, put: Put, kind: str, wires: set[str] | None = None, every: bool = True
               ) -> tuple[WeightUpdate, SendStats, dict[str, int], dict[str, WeightUpdate]]:
        """Build an update, in the trainer's dtype and each of `wires` (default: every registered maker's;
        recorded as the newest version's unless it is built for one maker: see `WireVariants.build`)."""
        core = self.core
        metadata: dict[str, Any] = {"trainer_run": core.run_id}
        if self.base_fingerprint is not None:
            with self._base_fingerprint_lock:
                cast = dict(self.cast_base_fingerprints)
            metadata.update({"base_fingerprint": self.base_fingerprint, "base_fingerprints": cast,
                             "lora": lora_config_dict(self.synced_models()["actor"])})
        # `put` copies each chunk (ray.put serialises it), so the lock covers the snapshot only.
        with core.weights_lock:
            tensors = self.synced_tensors(trainable_only=kind == "lora")
            if not self.pushes_weights:
                for stream in tensors.values():  # take part in the gather; rank 0 builds the update
                    for _ in stream:
                        pass
                put = _discard
            built = self.wire.build(tensors, core.policy_version, put, core.config.weight_chunk_bytes, kind,
                                    metadata, (self.wire.wires() if wires is None else wires)
                                    if self.pushes_weights else (), record=wires is None or not every,
                                    every=every)
            if core.config.record_weights_fingerprint:
                self.fingerprints[core.policy_version] = state_fingerprint(core.synced_state())
        return built

    def _answer(self, name: str, update: WeightUpdate | None, wire: str | None, put: Put | None
                ) -> WeightUpdate | None:
        """`update` in the registering maker's wire dtype, with the current cast base fingerprints; built now
        for a dtype no maker had (while the weights are still `update`'s: else the maker casts it)."""
        if update is not None and wire is not None and put is not None and self.wire.offered(name, update) \
                is update and update.version == self.core.policy_version \
                and not self.core.strategy.shards_weights:
            self._build(put, update.manifest.kind, {wire}, every=False)
        variant = self.wire.answer(name, update)
        return None if variant is None else self._with_cast_base_fingerprints(variant)

    def register(self, name: str, base_fingerprint: str | None, put: Put | None,
                 serving_dtype: str | None = None) -> WeightUpdate | None:
        """Record a maker; the update it should start from (see `TrainerCore.register_maker`)."""
        with self.registration_lock:
            wire = self.wire.note(name, base_fingerprint, serving_dtype)
            return self._register(name, base_fingerprint, put, wire)

    def _register(self, name: str, base_fingerprint: str | None, put: Put | None,
                  wire: str | None) -> WeightUpdate | None:
        self.makers.add(name)
        self.forget_error(name)
        self.lost.pop(name, None)
        latest = self.latest_update
        # What the maker will hold once it took the answer (for the lag `status` reports; pushes raise it).
        self.registered_versions[name] = -1 if latest is None else latest.manifest.version
        if self.queue is not None:
            self.queue.forget(name)  # a maker registering again (restarted) holds what this answer gives it
        if latest is None or latest.manifest.kind == "full":
            return self._answer(name, latest, wire, put)
        if base_fingerprint is not None and base_fingerprint == self.base_fingerprint_like(base_fingerprint):
            return self._answer(name, latest, wire, put)
        if put is None:
            raise ValueError("register_maker: this maker needs a full update but no `put` was given")
        if self.core.strategy.shards_weights:
            # Gathering sharded weights is a collective all ranks must join; one RPC cannot start it.
            raise ValueError(
                f"maker {name!r} holds other base weights (fingerprint {base_fingerprint}) than trainer "
                f"{self.core.name!r} ({self.base_fingerprint}), which shards its weights (strategy "
                f"{self.core.strategy.name!r}) and sends LoRA-only updates; start the maker from the "
                "trainer's base model"
            )
        update, _, _, cast = self._build(put, "full", set() if wire is None else {wire})
        return cast.get(wire, update) if wire is not None else update

    def refresh_base_fingerprints(self) -> None:
        """Fingerprint the base again (a checkpoint was loaded: its base may not be the one this trainer
        started from; makers holding the old one then refuse the LoRA updates and register for a full one)."""
        if self.base_fingerprint is None:
            return
        model = self.core.strategy.unwrap(self.core.learner.actor).model
        exact, cast = base_fingerprint(model), cast_base_fingerprints(model)
        with self._base_fingerprint_lock:
            self.base_fingerprint, self.cast_base_fingerprints = exact, cast

    def base_fingerprint_like(self, fingerprint: str) -> str | None:
        """This trainer's base fingerprint in the form of a maker's: exact, or cast to the dtype it names."""
        dtype = fingerprint_cast_dtype(fingerprint)
        if dtype is None or self.base_fingerprint is None:
            return self.base_fingerprint
        with self._base_fingerprint_lock:
            key = dtype_name(dtype)
            # a dtype beyond the common ones (fp64 ...): once, on demand
            if key not in self.cast_base_fingerprints:
                model = self.core.strategy.unwrap(self.core.learner.actor).model
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
        strategy = self.core.strategy
        every = sorted({m for names in strategy.all_gather_object(sorted(self.makers)) for m in names})
        if strategy.shards_weights:  # only rank 0 holds a whole update
            return every if strategy.is_rank_zero else []
        return every[strategy.rank :: strategy.world_size]

    def use(self, send_update: SendUpdate | WeightPushQueue) -> WeightPushQueue:
        """The queue pushes go through from now on (`push_queue_over`)."""
        if isinstance(send_update, WeightPushQueue):
            self.queue = send_update
        else:
            self.queue = self._adapted = push_queue_over(send_update, self.core.config.weight_push_timeout_s,
                                                         self._adapted)
        if getattr(self.queue.send, "wire_variants", None) is not self.wire:  # a delta only on its base
            self.queue.send = self.wire.dispatch(self.queue, self.queue.send, self.registered_versions)
        return self.queue

    def offer(self, queue: WeightPushQueue, update: WeightUpdate, makers: list[str]) -> None:
        """Offer each maker its variant of `update` (its wire dtype's, a delta where one was built)."""
        groups: dict[int, tuple[WeightUpdate, list[str]]] = {}
        for maker in makers:
            variant = self.wire.offered(maker, update)
            groups.setdefault(id(variant), (variant, []))[1].append(maker)
        for variant, group in groups.values():
            queue.offer(variant, group)

    def sync(self, put: Put, send_update: SendUpdate | WeightPushQueue) -> dict[str, float]:
        """Build an update of the current weights and offer it to this rank's makers
        (`TrainerCore.sync_weights`)."""
        queue = self.use(send_update)
        config = self.core.config
        update, stats = self.build_update(put)
        makers = self.makers_of_this_rank()
        start = time.perf_counter()
        self.offer(queue, update, makers)
        if not config.overlap_weight_push:
            queue.wait(config.weight_push_timeout_s, makers)
        push_seconds = time.perf_counter() - start
        metrics = self._sync_metrics(update, stats, push_seconds, self.record(queue.take_results()))
        metrics.update({f"weight_sync/bytes/wire/{name}": float(size)
                        for name, size in self.variant_bytes.items()})
        lag = queue.lag(update.manifest.version, makers, self.registered_versions)
        behind = self.makers_behind(lag)
        metrics.update({"weight_sync/superseded": float(queue.superseded),
                        "weight_sync/makers_lost": float(len(self.lost)),
                        "weight_sync/max_maker_lag": float(max(lag.values(), default=0)),
                        "weight_sync/makers_behind": float(len(behind))})
        return metrics

    def makers_behind(self, lag: Mapping[str, int]) -> dict[str, int]:
        """Makers whose newest acknowledged weights trail by more than `max_staleness` versions (none without
        one)."""
        bound = self.core.config.max_staleness
        return {} if bound is None else {maker: behind for maker, behind in lag.items() if behind > bound}

    def _sync_metrics(self, update: WeightUpdate, stats: SendStats, push_seconds: float,
                      results: Mapping[str, Any]) -> dict[str, float]:
        failed = sum(isinstance(r, BaseException) for r in results.values())
        # Per model, every synced model named (0 when a LoRA-only update carries none of it, e.g. a frozen
        # critic).
        per_model = {f"weight_sync/bytes/{model}": 0.0 for model in self.synced_models()}
        per_model.update({f"weight_sync/bytes/{model}": float(size)
                          for model, size in bytes_per_model(update).items()})
        return {
            **per_model,
            "time/weight_sync": stats.seconds + push_seconds,
            "weight_sync/version": float(update.manifest.version),
            "weight_sync/bytes": float(stats.bytes),
            "weight_sync/chunks": float(stats.chunks),
            "weight_sync/build_s": stats.seconds,
            "weight_sync/push_s": push_seconds,
            # overlapped: acknowledged since the last push
            "weight_sync/makers_updated": float(len(results) - failed),
            "weight_sync/makers_failed": float(failed),
        }

    def finish(self) -> Mapping[str, Any]:
        """Wait for weight updates still in flight; each maker's latest result ({} if none)."""
        if self.queue is None:  # nothing was pushed
            return {}
        # Watched (a Ray trainer): until each maker acknowledged or its transfer stalled; else a fixed bound.
        self.queue.wait(None if self.queue.watched else self.core.config.weight_push_timeout_s)
        return self.record(self.queue.take_results())

    def record(self, results: Mapping[str, Any]) -> Mapping[str, Any]:
        """Note the makers' results: stop pushing to makers that are gone, show the failures in
        `last_error` and the makers they leave without weights in `lost` (logged once each)."""
        failures = {name: result for name, result in results.items() if isinstance(result, BaseException)}
        for name in results.keys() - failures.keys():
            self.lost.pop(name, None)
        for name, error in failures.items():
            if name not in self.lost:
                logger.warning("trainer %s: maker %s lost (training goes on with the others): %s",
                               self.core.name, name, first_line(error))
            self.lost[name] = f"{type(error).__name__}: {first_line(error)}"
            if isinstance(error, LookupError):  # no actor by that name any more: stop paying for it
                self.makers.discard(name)
                if self.queue is not None:
                    self.queue.forget(name)
        if failures:
            self.errors = {name: f"weight update to {name}: {error}" for name, error in failures.items()}
            self.core.last_error = "; ".join(self.errors.values())
        return results

    def forget_error(self, maker: str) -> None:
        """Stop showing `maker`'s failed weight update: a maker registering under that name (a replacement)
        holds what its registration gives it."""
        shown = "; ".join(self.errors.values())
        if self.errors.pop(maker, None) is not None and self.core.last_error == shown:
            self.core.last_error = "; ".join(self.errors.values()) or None

    def offer_resumed(self, send_update: SendUpdate | WeightPushQueue) -> None:
        """Offer the weights a resume loaded to every maker registered so far (`offer_resumed_weights`)."""
        update, makers = self.latest_update, self.makers_of_this_rank()
        if update is None or not makers:
            return
        self.offer(self.use(send_update), update, makers)  # results come with the next push's

    def status(self) -> dict[str, Any]:
        """Weight-push counters and the makers that trail by more than `max_staleness` versions (not waited
        for)."""
        queue = self.queue
        if queue is None:
            return {"weight_push": None, "makers_behind": {}, "makers_lost": dict(self.lost)}
        lag = queue.lag(self.core.policy_version, queue.acked.keys() | set(self.makers),
                        self.registered_versions)
        push = dict(queue.stats())
        push["wire"] = self.wire.stats()
        return {"weight_push": push, "makers_behind": self.makers_behind(lag), "makers_lost": dict(self.lost)}
