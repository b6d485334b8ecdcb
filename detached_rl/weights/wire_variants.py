"""Which encoding of each update each maker gets: the trainer's dtype, its serving dtype, or a sparse delta.

A maker that stores its weights in a lower precision than the trainer's (bf16) is sent every update in that
dtype (`weights.encoding`): the trainer learns it when the maker registers (`serving_dtype`, or the cast
prefix of its base fingerprint, "bfloat16:<digest>"). With `trainer.sparse_deltas` and full updates, such a
maker gets each new version as a delta against the version before it, when that is the version it
acknowledged; else the full update in its dtype. That choice is made when the push queue sends (`dispatch`),
so a maker that fell behind, restarted or re-registered never gets a delta it cannot apply.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from detached_rl.weights.base_fingerprint import fingerprint_cast_dtype
from detached_rl.weights.encoding import Snapshot, build_variants, dtype_name, parse_wire_dtype
from detached_rl.weights.push_queue import Send, WeightPushQueue
from detached_rl.weights.update import Put, SendStats, WeightUpdate

# Full updates kept per wire dtype for makers a delta does not fit (the newest versions only).
_FULLS_KEPT = 2


class WireVariants:
    """Per maker, the dtype it is sent weights in; per wire dtype, the latest update in it, the full updates
    of the last versions, and the base of the next delta."""

    def __init__(self, models: Mapping[str, torch.nn.Module], deltas: bool) -> None:
        # A wire dtype is used only where it is narrower than some floating tensor the trainer holds.
        self.widest = max((p.element_size() for m in models.values() for p in m.state_dict().values()
                           if p.is_floating_point()), default=0)
        self.deltas = deltas
        self.dtypes: dict[str, str] = {}  # maker -> wire dtype name (makers sent the trainer's dtype: absent)
        self.latest: dict[str, WeightUpdate] = {}  # wire dtype -> newest update in it (full, LoRA or delta)
        self.fulls: dict[tuple[str, int], WeightUpdate] = {}  # (wire dtype, version) -> full update in it
        self.snapshots: dict[str, Snapshot] = {}  # wire dtype -> the next delta's base
        self.sent_deltas = self.sent_fulls_for_deltas = 0
        self._lock = threading.Lock()

    def note(self, maker: str, base_fingerprint: str | None, serving_dtype: str | None) -> str | None:
        """Record the dtype `maker` serves (its `serving_dtype`, else the cast prefix of its base
        fingerprint); the wire dtype it will be sent, or None for the trainer's own."""
        dtype = parse_wire_dtype(serving_dtype) if serving_dtype is not None else (
            fingerprint_cast_dtype(base_fingerprint) if base_fingerprint is not None else None)
        with self._lock:
            if dtype is None or dtype.itemsize >= self.widest:
                self.dtypes.pop(maker, None)
                return None
            self.dtypes[maker] = dtype_name(dtype)
            return self.dtypes[maker]

    def wires(self) -> set[str]:
        """Wire dtypes of the registered makers."""
        with self._lock:
            return set(self.dtypes.values())

    def build(self, tensors: Mapping[str, Any], version: int, put: Put, chunk_bytes: int, kind: str,
              metadata: dict, wires: Iterable[str], record: bool = True, every: bool = True
              ) -> tuple[WeightUpdate, SendStats, dict[str, int], dict[str, WeightUpdate]]:
        """Build the update in the trainer's dtype and in each of `wires` (plus deltas; see `build_variants`):
        the first, what building it cost, the bytes each variant carries by name ("bfloat16",
        "delta/bfloat16") and the variants in each wire dtype. `record`: they are the newest version's (not
        a full update built for one registering maker); `every`: `wires` are all the registered makers' (the
        others are dropped)."""
        wires = sorted(wires)
        with self._lock:
            bases = dict(self.snapshots) if self.deltas and kind == "full" and record else {}
        variants = build_variants(tensors, version, put, chunk_bytes, kind, metadata, wires, bases,
                                  snapshot=self.deltas and kind == "full" and record)
        update, stats = variants.native
        cast = {wire: variant for wire, (variant, _) in variants.cast.items()}
        if not record:
            return update, stats, {}, cast
        sizes = {}
        with self._lock:
            for wire, variant in cast.items():
                self.latest[wire] = variant
                sizes[wire] = variant.manifest.total_bytes
                if kind == "full":
                    self.fulls.pop((wire, version), None)  # (re)inserted last: the newest built
                    self.fulls[(wire, version)] = variant
            for wire, (delta, _) in variants.deltas.items():
                self.latest[wire] = delta
                sizes[f"delta/{wire}"] = delta.manifest.total_bytes
            self.snapshots.update(variants.snapshots)
            # A dtype no maker takes any more
            for wire in self.latest.keys() - set(wires) if every else ():
                del self.latest[wire]
                self.snapshots.pop(wire, None)
            for wire in cast:  # the last ones built (by build order: a resume may go back in versions)
                for key in [key for key in self.fulls if key[0] == wire][:-_FULLS_KEPT]:
                    del self.fulls[key]
        return update, stats, sizes, cast

    def offered(self, maker: str, update: WeightUpdate) -> WeightUpdate:
        """What to offer `maker` for `update` (built in the trainer's dtype): its dtype's variant of that
        version (a delta where one was built), else `update` itself (the maker casts it: exact too)."""
        with self._lock:
            wire = self.dtypes.get(maker)
            variant = None if wire is None else self.latest.get(wire)
        if variant is None or variant.manifest.version != update.manifest.version \
                or (variant.manifest.kind == "lora") != (update.manifest.kind == "lora"):
            return update
        return variant

    def answer(self, maker: str, update: WeightUpdate | None) -> WeightUpdate | None:
        """What a registering maker starts from: `offered`, but never a delta (its base is unknown)."""
        if update is None:
            return None
        variant = self.offered(maker, update)
        return self.full_of(variant) if variant.manifest.kind == "delta" else variant

    def full_of(self, delta: WeightUpdate) -> WeightUpdate:
        """The full update (in the same wire dtype) of a delta's version; the delta itself if none is kept
        (the maker refuses it, naming its base, and registers again)."""
        key = (delta.manifest.metadata.get("wire_dtype"), delta.manifest.version)
        with self._lock:
            return self.fulls.get(key, delta)

    def stats(self) -> dict[str, Any]:
        """Makers by wire dtype, deltas sent and full updates sent where a delta did not fit (`status`)."""
        with self._lock:
            return {"dtypes": dict(self.dtypes), "deltas_sent": self.sent_deltas,
                    "fulls_for_deltas": self.sent_fulls_for_deltas}

    def dispatch(self, queue: WeightPushQueue, send: Send, registered: Mapping[str, int]) -> Send:
        """`send` that gives a maker the full update instead of a delta unless the version it acknowledged (or
        was answered at registration) is the delta's base."""

        def send_variant(maker: str, update: WeightUpdate) -> Any:
            if update.manifest.kind == "delta":
                held = queue.acked.get(maker, registered.get(maker))
                if held != update.manifest.metadata["delta_base"]["version"]:
                    update = self.full_of(update)
                    self.sent_fulls_for_deltas += 1
                else:
                    self.sent_deltas += 1
            return send(maker, update)

        send_variant.wire_variants = self  # type: ignore[attr-defined]  # marks a queue already wrapped
        return send_variant
