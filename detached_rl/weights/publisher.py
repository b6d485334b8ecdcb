"""The trainer side of the weight path: `WeightPublisher` registers makers, offers each the version it should
start from, publishes new versions to them through a push queue, and knows who is behind or lost.

It is built from explicit dependencies (`weights.source`): where the tensors come from and under which lock,
the policy version, the run id, the ranks, its settings and where its errors go. It snapshots the synced
models into updates (full, or LoRA-only with the base's fingerprints, in each maker's wire dtype:
`WireVariants`) and hands them to a `WeightPushQueue`; a caller with a plain
`send_update(update, makers) -> {maker: result}` function gets a queue over it (`push_queue_over`). Nothing
else builds or sends an update.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from detached_rl.core.text import first_line
from detached_rl.models.lora import lora_backend, lora_config_dict
from detached_rl.weights.push_queue import SendUpdate, WeightPushQueue, push_queue_over
from detached_rl.weights.source import ErrorReport, PublishConfig, RankGroup, WeightSource
from detached_rl.weights.trainer_base import TrainerBase
from detached_rl.weights.update import Put, SendStats, WeightUpdate, state_fingerprint
from detached_rl.weights.wire_variants import WireVariants

logger = logging.getLogger(__name__)


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


class WeightPublisher:
    """One trainer rank's side of the weight path: registered makers, the update each starts from, and the
    pushes of new versions to them."""

    def __init__(self, name: str, run_id: str, source: WeightSource, ranks: RankGroup,
                 config: PublishConfig | None = None, report_error: ErrorReport | None = None) -> None:
        self.name = name  # the trainer's, for messages
        self.run_id = run_id  # every update carries it: makers follow one trainer run
        self.source = source
        self.ranks = ranks
        self.config = config or PublishConfig()
        self.report_error = report_error or (lambda shown, replaced: None)
        self.makers: set[str] = set()
        self.registered_versions: dict[str, int] = {}
        self.latest_update: WeightUpdate | None = None
        self.fingerprints: dict[int, str] = {}
        lora = self.config.weight_sync == "lora"
        if lora and lora_backend(source.policy()) is None:
            raise ValueError("TrainerConfig.weight_sync='lora' needs a LoRA policy "
                             "(see detached_rl.models.apply_lora)")
        # The frozen base LoRA-only updates are made against, as makers check it (None: full updates only).
        self.base: TrainerBase | None = TrainerBase(source.policy) if lora else None
        # Synced models without LoRA that training changes (a trained critic): LoRA-only updates carry them
        # whole.
        self.synced_in_full = models_synced_in_full(self.synced_models()) if lora else {}
        # LoRA-only from version 0 on: what a LoRA-only update leaves out is then the policy's base alone,
        # which a maker proves it holds (its base fingerprint, checked before anything is fetched).
        self.adapter_only = lora and adapters_complete(self.synced_models())
        # Makers that serve a lower precision get updates in it, full ones as sparse deltas where they fit.
        self.wire = WireVariants(self.synced_models(), deltas=self.config.sparse_deltas and not lora)
        self.variant_bytes: dict[str, int] = {}  # the latest update's bytes per wire variant (metrics)
        self.queue: WeightPushQueue | None = None  # the latest push's
        self._adapted: WeightPushQueue | None = None  # the queue over plain `send_update` functions
        # Held while a maker registers and while a resume replaces the update makers start from, so a maker
        # registering during a resume gets the update before or after it, and the resume then reaches it.
        self.registration_lock = threading.Lock()
        self.errors: dict[str, str] = {}  # maker -> its failed weight update, as reported
        # Makers whose latest weight update failed (dead, unreachable, restarting): maker -> why. A later
        # acknowledgement or a registration under that name (a restarted or replacing maker) clears it.
        self.lost: dict[str, str] = {}
        self.hosts: dict[str, str] = {}  # maker -> its node IP, as it said when it registered
        self.pulls: dict[str, tuple[int, float]] = {}  # maker -> (bytes, seconds) of its registration answer

    # ------------------------------------------------------------------ the weights
    def synced_models(self) -> dict[str, torch.nn.Module]:
        """The models makers mirror (PPO: policy and critic; GRPO: the policy)."""
        return self.source.models()

    def synced_tensors(self, trainable_only: bool) -> dict[str, Iterator[tuple[str, torch.Tensor]]]:
        """(name, tensor) streams of the synced models, gathered shard by shard."""
        return self.source.tensors(trainable_only)

    def synced_state(self, trainable_only: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """State dicts of the synced models; with `trainable_only`, just what training changes (LoRA)."""
        return {name: dict(tensors) for name, tensors in self.synced_tensors(trainable_only).items()}

    @property
    def pushes_weights(self) -> bool:
        """False on ranks other than 0 of a strategy that shards the weights (rank 0 pushes for all)."""
        return not self.ranks.shards_weights or self.ranks.is_rank_zero

    # ------------------------------------------------------------------ building updates
    def snapshot(self, put: Put, kind: str | None = None) -> tuple[WeightUpdate, SendStats]:
        """Snapshot the current weights into an update ("full", or "lora": trainable tensors only), the one
        makers registering from now on start from.

        A LoRA trainer's updates are LoRA-only from version 0 on (`adapter_only`; makers with another base get
        a full one when they register), else from the version after its first full one."""
        lora = self.adapter_only or (self.config.weight_sync == "lora" and self.latest_update is not None)
        update, stats, self.variant_bytes, _ = self._build(put, kind or ("lora" if lora else "full"))
        self.latest_update = update
        return update, stats

    def _build(self, put: Put, kind: str, wires: set[str] | None = None, every: bool = True
               ) -> tuple[WeightUpdate, SendStats, dict[str, int], dict[str, WeightUpdate]]:
        """Build an update, in the trainer's dtype and each of `wires` (default: every registered maker's;
        recorded as the newest version's unless it is built for one maker: see `WireVariants.build`)."""
        metadata: dict[str, Any] = {"trainer_run": self.run_id}
        if self.base is not None:
            metadata.update(self.base.metadata(), lora=lora_config_dict(self.synced_models()["actor"]))
        # `put` copies each chunk (ray.put serialises it), so the lock covers the snapshot only.
        with self.source.lock:
            version = self.source.version()
            tensors = self.synced_tensors(trainable_only=kind == "lora")
            if not self.pushes_weights:
                for stream in tensors.values():  # take part in the gather; rank 0 builds the update
                    for _ in stream:
                        pass
                put = _discard
            built = self.wire.build(tensors, version, put, self.config.weight_chunk_bytes, kind,
                                    metadata, (self.wire.wires() if wires is None else wires)
                                    if self.pushes_weights else (), record=wires is None or not every,
                                    every=every)
            if self.config.record_weights_fingerprint:
                self.fingerprints[version] = state_fingerprint(self.synced_state())
        return built

    def reload(self, put: Put) -> None:
        """The weights were replaced (a checkpoint was loaded): fingerprint the base again and snapshot them,
        as the update makers start from (full unless LoRA-only updates leave out nothing but the base)."""
        with self.registration_lock:
            # The loaded base may be another than the one fingerprinted at the start: makers holding that one
            # refuse the next LoRA update and register for a full one.
            if self.base is not None:
                self.base.refresh()
            self.snapshot(put, None if self.adapter_only else "full")

    # ------------------------------------------------------------------ subscribers
    def register(self, name: str, base_fingerprint: str | None = None, put: Put | None = None,
                 serving_dtype: str | None = None, host: str | None = None) -> WeightUpdate | None:
        """Record a maker; returns the update it should start from.

        With LoRA sync, a maker that holds the same base weights (equal fingerprint; for a maker that
        casts weights, equal after casting both bases to its dtype) gets the latest LoRA-only update;
        any other maker gets a full update of the current weights. `serving_dtype` (or the cast prefix of its
        fingerprint, "bfloat16:..."): the dtype the maker stores weights in; a narrower one than the trainer's
        gets updates in it (`WireVariants`). `host`: the maker's node IP, as it says (`weights.relay`).
        """
        with self.registration_lock:
            wire = self.wire.note(name, base_fingerprint, serving_dtype)
            answer = self._register(name, base_fingerprint, put, wire)
            if host:
                self.hosts[name] = host
                if self.queue is not None:
                    self.queue.relays.tell(name, host)
            return answer

    def pulled(self, name: str, nbytes: int, seconds: float) -> None:
        """`name` pulled its registration answer, `nbytes` from this trainer in `seconds`: how fast its link
        is, which ranks it for relays before any push (`RelayPlanner.record`)."""
        self.pulls[name] = (nbytes, float(seconds))
        if self.queue is not None:
            self.queue.relays.record(name, nbytes, float(seconds))

    def add_makers(self, names: Iterable[str]) -> None:
        """Add makers by name, without an update to start from (they take the next push)."""
        with self.registration_lock:
            self.makers.update(names)

    def _answer(self, name: str, update: WeightUpdate | None, wire: str | None, put: Put | None
                ) -> WeightUpdate | None:
        """`update` in the registering maker's wire dtype, with the current cast base fingerprints; built now
        for a dtype no maker had (while the weights are still `update`'s: else the maker casts it)."""
        if update is not None and wire is not None and put is not None and self.wire.offered(name, update) \
                is update and update.version == self.source.version() and not self.ranks.shards_weights:
            self._build(put, update.manifest.kind, {wire}, every=False)
        variant = self.wire.answer(name, update)
        if variant is None or self.base is None:
            return variant
        return self.base.stamp(variant)

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
        if base_fingerprint is not None and self.base is not None and base_fingerprint == self.base.like(
                base_fingerprint):
            return self._answer(name, latest, wire, put)
        if put is None:
            raise ValueError("register_maker: this maker needs a full update but no `put` was given")
        if self.ranks.shards_weights:
            # Gathering sharded weights is a collective all ranks must join; one RPC cannot start it.
            raise ValueError(
                f"maker {name!r} holds other base weights (fingerprint {base_fingerprint}) than trainer "
                f"{self.name!r} ({self.base_fingerprint}), which shards its weights (strategy "
                f"{self.ranks.name!r}) and sends LoRA-only updates; start the maker from the "
                "trainer's base model"
            )
        update, _, _, cast = self._build(put, "full", set() if wire is None else {wire})
        return cast.get(wire, update) if wire is not None else update

    @property
    def base_fingerprint(self) -> str | None:
        """The exact fingerprint of the base LoRA-only updates are made against (None without LoRA sync)."""
        return None if self.base is None else self.base.fingerprint

    @property
    def cast_base_fingerprints(self) -> dict[str, str]:
        """dtype name -> the base's fingerprint cast to it (empty without LoRA sync)."""
        return {} if self.base is None else dict(self.base.cast)

    def makers_of_this_rank(self) -> list[str]:
        """This rank's share of every maker registered with any rank (same answer on every rank)."""
        ranks = self.ranks
        every = sorted({m for names in ranks.all_gather_object(sorted(self.makers)) for m in names})
        if ranks.shards_weights:  # only rank 0 holds a whole update
            return every if ranks.is_rank_zero else []
        return every[ranks.rank :: ranks.world_size]

    # ------------------------------------------------------------------ publishing
    def use(self, send_update: SendUpdate | WeightPushQueue) -> WeightPushQueue:
        """The queue pushes go through from now on (`push_queue_over`)."""
        if isinstance(send_update, WeightPushQueue):
            self.queue = send_update
        else:
            self.queue = self._adapted = push_queue_over(send_update, self.config.weight_push_timeout_s,
                                                         self._adapted)
        if getattr(self.queue.send, "wire_variants", None) is not self.wire:  # a delta only on its base
            self.queue.send = self.wire.dispatch(self.queue, self.queue.send, self.registered_versions)
        for name, host in self.hosts.items():
            self.queue.relays.tell(name, host)
        for name, (nbytes, seconds) in self.pulls.items():
            self.queue.relays.record(name, nbytes, seconds)
        return self.queue

    def offer(self, queue: WeightPushQueue, update: WeightUpdate, makers: list[str]) -> None:
        """Offer each maker its variant of `update` (its wire dtype's, a delta where one was built)."""
        groups: dict[int, tuple[WeightUpdate, list[str]]] = {}
        for maker in makers:
            variant = self.wire.offered(maker, update)
            groups.setdefault(id(variant), (variant, []))[1].append(maker)
        for variant, group in groups.values():
            queue.offer(variant, group)

    def publish(self, put: Put, send_update: SendUpdate | WeightPushQueue) -> dict[str, float]:
        """Snapshot the current weights and offer them to this rank's makers through the push queue; metrics.

        The update is offered to every maker and the caller goes on: each maker acknowledges once it has
        verified it (and swaps it in between two of its batches), a maker still busy with the previous one
        gets this one next. Without `overlap_weight_push`, it then waits (up to `weight_push_timeout_s`) for
        those acknowledgements. A plain `send_update` function is wrapped into a queue (`push_queue_over`).
        """
        queue = self.use(send_update)
        update, stats = self.snapshot(put)
        makers = self.makers_of_this_rank()
        start = time.perf_counter()
        self.offer(queue, update, makers)
        if not self.config.overlap_weight_push:
            queue.wait(self.config.weight_push_timeout_s, makers)
        push_seconds = time.perf_counter() - start
        metrics = self._publish_metrics(update, stats, push_seconds, self.record(queue.take_results()))
        metrics.update({f"weight_sync/bytes/wire/{name}": float(size)
                        for name, size in self.variant_bytes.items()})
        lag = queue.lag(update.manifest.version, makers, self.registered_versions)
        behind = self.makers_behind(lag)
        metrics.update({"weight_sync/superseded": float(queue.superseded),
                        "weight_sync/makers_lost": float(len(self.lost)),
                        "weight_sync/max_maker_lag": float(max(lag.values(), default=0)),
                        "weight_sync/makers_behind": float(len(behind))})
        return metrics

    def offer_latest(self, send_update: SendUpdate | WeightPushQueue) -> None:
        """Offer the latest snapshot to every maker registered so far (after a resume: they started from the
        version this trainer had before loading); results come with the next publish's."""
        update, makers = self.latest_update, self.makers_of_this_rank()
        if update is None or not makers:
            return
        self.offer(self.use(send_update), update, makers)

    def makers_behind(self, lag: Mapping[str, int]) -> dict[str, int]:
        """Makers whose newest acknowledged weights trail by more than `max_staleness` versions (none without
        one)."""
        bound = self.config.max_staleness
        return {} if bound is None else {maker: behind for maker, behind in lag.items() if behind > bound}

    def _publish_metrics(self, update: WeightUpdate, stats: SendStats, push_seconds: float,
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
        self.queue.wait(None if self.queue.watched else self.config.weight_push_timeout_s)
        return self.record(self.queue.take_results())

    # ------------------------------------------------------------------ who is behind or lost
    def record(self, results: Mapping[str, Any]) -> Mapping[str, Any]:
        """Note the makers' results: stop pushing to makers that are gone, report the failures and the makers
        they leave without weights in `lost` (logged once each)."""
        failures = {name: result for name, result in results.items() if isinstance(result, BaseException)}
        for name in results.keys() - failures.keys():
            self.lost.pop(name, None)
        for name, error in failures.items():
            if name not in self.lost:
                logger.warning("trainer %s: maker %s lost (training goes on with the others): %s",
                               self.name, name, first_line(error))
            self.lost[name] = f"{type(error).__name__}: {first_line(error)}"
            if isinstance(error, LookupError):  # no actor by that name any more: stop paying for it
                self.makers.discard(name)
                if self.queue is not None:
                    self.queue.forget(name)
        if failures:
            self.errors = {name: f"weight update to {name}: {error}" for name, error in failures.items()}
            self.report_error("; ".join(self.errors.values()), None)
        return results

    def forget_error(self, maker: str) -> None:
        """Stop showing `maker`'s failed weight update: a maker registering under that name (a replacement)
        holds what its registration gives it."""
        shown = "; ".join(self.errors.values())
        if self.errors.pop(maker, None) is not None:
            self.report_error("; ".join(self.errors.values()) or None, shown)

    def status(self) -> dict[str, Any]:
        """Weight-push counters and the makers that trail by more than `max_staleness` versions (not waited
        for)."""
        queue = self.queue
        if queue is None:
            return {"weight_push": None, "makers_behind": {}, "makers_lost": dict(self.lost),
                    "makers_silent": {}}
        makers = queue.acked.keys() | set(self.makers)
        lag = queue.lag(self.source.version(), makers, self.registered_versions)
        push = dict(queue.stats())
        push["wire"] = self.wire.stats()
        return {"weight_push": push, "makers_behind": self.makers_behind(lag), "makers_lost": dict(self.lost),
                "makers_silent": push.get("silent", {})}
