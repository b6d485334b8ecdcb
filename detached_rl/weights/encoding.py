"""Compact encodings of weight updates, exact with respect to what a maker stores (docs/design.md §3.4).

* **Wire dtype.** A maker that stores its weights in a lower precision than the trainer's (a casting maker,
  e.g. bf16) would cast every floating tensor on arrival; the trainer casts them before sending instead
  (`wire_tensor`), so half the bytes travel and the maker stores the same bits (`Tensor.to` rounds the same
  everywhere). Such an update says so in its metadata ("wire_dtype").
* **Sparse deltas.** A full update of a model served in bf16 changes few bf16 values after a small step: a
  "delta" update carries, per tensor, the indices and new values of the elements whose bits changed since a
  base version (`encode_sparse`), or the tensor whole where that is not larger. It names its base (version
  and, per model, the fingerprint of the base's tensors as the maker stores them); a receiver that holds
  another base refuses it before fetching anything, and rebuilds each tensor on a copy of its base
  (`apply_sparse`), whose checksum must be the manifest's checksum of the new tensor: exact by construction.

`build_variants` builds, in one pass over the trainer's tensors, the update in the trainer's dtype, one per
wire dtype, and a delta per wire dtype that has a base.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from detached_rl.weights.sink import WeightSink
from detached_rl.weights.update import (
    DEFAULT_CHUNK_BYTES,
    OffTrainerError,
    Put,
    SendStats,
    TensorEntry,
    TensorSpec,
    UpdateBuilder,
    WeightManifest,
    WeightUpdate,
    WeightUpdateError,
    check_finite,
    fingerprint_of_entries,
    qualified_tensors,
)

INDICES, MASK, VALUES = "@indices", "@mask", "@values"
_INDEX_DTYPES = (torch.int32, torch.int64)
# Integer types of each element size: elements compared by their bits (-0.0 and 0.0 differ, as they should).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16."""
    return str(dtype).removeprefix("torch.")


def parse_wire_dtype(name: str) -> torch.dtype:
    """The floating dtype a wire-dtype name says ("bfloat16"); ValueError naming it otherwise."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"serving_dtype {name!r} is not a floating torch dtype")
    return dtype


def wire_tensor(tensor: Tensor, wire: torch.dtype | None) -> Tensor:
    """`tensor` as sent to a maker storing `wire`: floating tensors wider than it cast (on their device, then
    to the CPU), everything else as it is; contiguous, on the CPU."""
    tensor = tensor.detach()
    if wire is not None and tensor.is_floating_point() and tensor.element_size() > wire.itemsize:
        tensor = tensor.to(wire)
    return tensor.cpu().contiguous()


def changed_indices(new: Tensor, old: Tensor) -> Tensor:
    """Flat indices (ascending) of the elements of `new` whose bits differ from `old` (same shape, dtype)."""
    bits = _BITS[new.element_size()]
    differs = new.reshape(-1).view(bits) != old.reshape(-1).view(bits)
    return torch.nonzero(differs).reshape(-1)


def encode_sparse(new: Tensor, old: Tensor) -> dict[str, Tensor] | None:
    """The elements that changed from `old` to `new`, in the smaller of two forms: `{"@indices": flat
    positions, "@values": ...}` (few changed) or `{"@mask": one bit per element (little-endian within each
    byte, numpy's `packbits`), "@values": ...}` (many); None where neither is smaller than `new` whole (or
    the two differ in shape or dtype)."""
    if new.shape != old.shape or new.dtype != old.dtype or new.element_size() not in _BITS:
        return None
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    indices = changed_indices(new, old)
    dense, changed = new.numel() * new.element_size(), indices.numel()
    by_index = changed * (index_dtype.itemsize + new.element_size())
    by_mask = -(-new.numel() // 8) + changed * new.element_size()
    if min(by_index, by_mask) >= dense:
        return None
    values = new.reshape(-1)[indices].contiguous()
    if by_index <= by_mask:
        return {INDICES: indices.to(index_dtype), VALUES: values}
    bits = torch.zeros(new.numel(), dtype=torch.bool)
    bits[indices] = True
    return {MASK: torch.from_numpy(np.packbits(bits.numpy(), bitorder="little")), VALUES: values}


def apply_sparse(where: str, spec: TensorSpec, base: Tensor, indices: object, values: object) -> Tensor:
    """A copy of `base` (on the CPU) with `values` at flat `indices`; `WeightUpdateError` naming the tensor
    and the field if the parts are malformed: indices must be a 1-D int32/int64 tensor, strictly ascending (no
    duplicates), within the tensor; values a 1-D tensor of the spec's dtype, one per index."""
    name = spec.name
    if not isinstance(indices, Tensor) or indices.dim() != 1 or indices.dtype not in _INDEX_DTYPES:
        got = (f"{indices.dtype} of shape {tuple(indices.shape)}" if isinstance(indices, Tensor)
               else type(indices).__name__)
        raise WeightUpdateError(
            f"{where}: {name!r} field 'indices': must be a 1-D int32/int64 tensor, got {got}")
    if not isinstance(values, Tensor) or values.dim() != 1 or str(values.dtype) != spec.dtype:
        got = (f"{values.dtype} of shape {tuple(values.shape)}" if isinstance(values, Tensor)
               else type(values).__name__)
        raise WeightUpdateError(
            f"{where}: {name!r} field 'values': must be a 1-D {spec.dtype} tensor, got {got}")
    if values.numel() != indices.numel():
        raise WeightUpdateError(f"{where}: {name!r} field 'values': {values.numel()} values for "
                                f"{indices.numel()} indices")
    if tuple(base.shape) != spec.shape or str(base.dtype) != spec.dtype:
        raise WeightUpdateError(f"{where}: {name!r}: the base holds {tuple(base.shape)} {base.dtype}, the "
                                f"delta is for {spec.shape} {spec.dtype}")
    numel = base.numel()
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= numel:
            raise WeightUpdateError(f"{where}: {name!r} field 'indices': index {lo if lo < 0 else hi} out of "
                                    f"range for {numel} elements")
        if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise WeightUpdateError(f"{where}: {name!r} field 'indices': not strictly ascending "
                                    "(duplicate or unsorted indices)")
    out = base.detach().to("cpu", copy=True).contiguous()
    out.reshape(-1)[indices.to(torch.int64)] = values
    return out


def apply_mask(where: str, spec: TensorSpec, base: Tensor, mask: object, values: object) -> Tensor:
    """A copy of `base` with `values` where `mask` has its bits set; `WeightUpdateError` naming the tensor and
    the field if malformed: mask a 1-D uint8 tensor of one bit per element (padding bits clear), values a
    1-D tensor of the spec's dtype, one per set bit."""
    numel = base.numel()
    if not isinstance(mask, Tensor) or mask.dim() != 1 or mask.dtype != torch.uint8 \
            or mask.numel() != -(-numel // 8):
        got = (f"{mask.dtype} of shape {tuple(mask.shape)}" if isinstance(mask, Tensor)
               else type(mask).__name__)
        raise WeightUpdateError(f"{where}: {spec.name!r} field 'mask': must be a 1-D uint8 tensor of "
                                f"{-(-numel // 8)} bytes, got {got}")
    bits = np.unpackbits(mask.numpy(), bitorder="little")
    if bits[numel:].any():
        raise WeightUpdateError(f"{where}: {spec.name!r} field 'mask': bits set beyond its {numel} elements")
    indices = torch.from_numpy(np.flatnonzero(bits[:numel]))
    return apply_sparse(where, spec, base, indices, values)


def model_fingerprints(entries: Mapping[str, TensorEntry], names: Iterable[str]) -> dict[str, str]:
    """Per model, the fingerprint of `entries` restricted to the qualified `names` (a delta's base)."""
    by_model: dict[str, dict[str, TensorEntry]] = {}
    for name in names:
        if name in entries:
            by_model.setdefault(name.partition("/")[0], {})[name] = entries[name]
    return {model: fingerprint_of_entries(held) for model, held in by_model.items()}


def manifest_entries(manifest: WeightManifest) -> dict[str, TensorEntry]:
    """The fingerprint entries a maker storing the manifest's dtypes holds after taking this update whole."""
    return {spec.name: (spec.shape, spec.dtype, spec.checksum) for spec in manifest.tensors}


def check_delta_base(manifest: WeightManifest, held: Mapping[str, TensorEntry] | None, held_version: int,
                     names: Iterable[str]) -> None:
    """`OffTrainerError` unless the receiver's `held` entries are the delta's base, model by model (before
    anything is fetched: registering again gets a full update)."""
    base = manifest.metadata.get("delta_base")
    v = f"v{manifest.version}"
    if not isinstance(base, Mapping) or not isinstance(base.get("fingerprints"), Mapping):
        raise WeightUpdateError(f"{v}: a delta update must name its base (metadata 'delta_base' with "
                                "'version' and 'fingerprints')")
    wanted: Mapping[str, str] = base["fingerprints"]
    mine = {} if held is None else model_fingerprints(held, names)
    for model in sorted({name.partition("/")[0] for name in names}):
        if mine.get(model) != wanted.get(model):
            raise OffTrainerError(
                f"{v}: a delta against v{base.get('version')} (model {model!r} base fingerprint "
                f"{str(wanted.get(model))[:16]}) does not apply: this maker holds v{held_version} "
                f"({'no known weights' if model not in mine else 'fingerprint ' + mine[model][:16]}); "
                "it needs a full update")


def base_lookup(staged: Mapping[str, Mapping[str, Tensor]], sinks: Mapping[str, WeightSink]
                ) -> Callable[[str], Tensor]:
    """A delta's base tensor by qualified name: the `staged` one (model -> key -> tensor of a waiting update
    the delta supersedes) where there is one, else the one its sink serves."""
    served: dict[str, Mapping[str, Tensor]] = {}

    def base(name: str) -> Tensor:
        model_name, _, key = name.partition("/")
        tensor = staged.get(model_name, {}).get(key)
        if tensor is None:
            if model_name not in served:
                served[model_name] = sinks[model_name].state()
            tensor = served[model_name][key]
        return tensor

    return base


def widest_stored_dtype(sinks: Mapping[str, WeightSink]) -> str | None:
    """The widest floating dtype the sinks store ("bfloat16"), or None if they store no floating tensor."""
    dtypes = [layout.dtype for sink in sinks.values() for layout in sink.layout().values()
              if layout.dtype.is_floating_point]
    return dtype_name(max(dtypes, key=lambda d: d.itemsize)) if dtypes else None


@dataclass
class Snapshot:
    """A version's tensors as sent in one wire dtype (the next delta's base) and their per-model
    fingerprints."""

    version: int
    tensors: dict[str, Tensor]
    fingerprints: dict[str, str]


@dataclass
class Variants:
    """What `build_variants` built: the update in the trainer's dtype (`native`), one per wire dtype (`cast`),
    the deltas against each wire dtype's base (`deltas`), and the new bases (`snapshots`)."""

    native: tuple[WeightUpdate, SendStats]
    cast: dict[str, tuple[WeightUpdate, SendStats]] = field(default_factory=dict)
    deltas: dict[str, tuple[WeightUpdate, SendStats]] = field(default_factory=dict)
    snapshots: dict[str, Snapshot] = field(default_factory=dict)


def build_variants(models: Mapping[str, Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]], version: int,
                   put: Put, chunk_bytes: int = DEFAULT_CHUNK_BYTES, kind: str = "full",
                   metadata: dict | None = None, wires: Iterable[str] = (),
                   bases: Mapping[str, Snapshot] | None = None, snapshot: bool = False) -> Variants:
    """Build, in one pass over `models` (each tensor gathered and checked once), the update in the trainer's
    dtype, one cast to each wire dtype in `wires` (metadata "wire_dtype"), and, for each wire dtype with a
    base in `bases` (full updates only), a "delta" against it. `snapshot`: keep each wire dtype's tensors as
    the next delta's base (`Variants.snapshots`)."""
    bases = dict(bases or {})
    wires = sorted(set(wires))
    native = UpdateBuilder(version, put, chunk_bytes, kind, metadata)
    cast = {w: UpdateBuilder(version, put, chunk_bytes, kind, {**(metadata or {}), "wire_dtype": w})
            for w in wires}
    deltas = {}
    if kind == "full":
        for w in wires:
            base = bases.get(w)
            if base is not None:
                deltas[w] = UpdateBuilder(version, put, chunk_bytes, "delta", {
                    **(metadata or {}), "wire_dtype": w,
                    "delta_base": {"version": base.version, "fingerprints": dict(base.fingerprints)}})
    kept: dict[str, dict[str, Tensor]] = {w: {} for w in wires}
    for name, original in qualified_tensors(models):
        if native.alias(name, original):
            for w in wires:
                cast[w].alias(name, original)
                if w in deltas:
                    deltas[w].alias(name, original)
            continue
        check_finite(name, original, version)
        native.add(name, original, check=False)
        for w in wires:
            host = wire_tensor(original, parse_wire_dtype(w))
            cast[w].add(name, original, host=host, check=False)
            if w in deltas:
                old = bases[w].tensors.get(name)
                parts = None if old is None else encode_sparse(host, old)
                encoding = "mask" if parts is not None and MASK in parts else "sparse"
                if parts is not None:
                    parts = {name + suffix: tensor for suffix, tensor in parts.items()}
                deltas[w].add(name, original, host=host, check=False, parts=parts, encoding=encoding)
            if snapshot:
                kept[w][name] = host
    out = Variants(native.finish())
    for w in wires:
        out.cast[w] = cast[w].finish()
        if w in deltas:
            out.deltas[w] = deltas[w].finish()
        if snapshot:
            manifest = out.cast[w][0].manifest
            entries = manifest_entries(manifest)
            out.snapshots[w] = Snapshot(version, kept[w], model_fingerprints(entries, entries))
    return out


__all__ = [
    "INDICES", "MASK", "VALUES", "Snapshot", "Variants", "apply_sparse", "base_lookup", "build_variants",
    "changed_indices", "widest_stored_dtype",
    "apply_mask", "check_delta_base", "dtype_name", "encode_sparse", "manifest_entries", "model_fingerprints",
    "parse_wire_dtype", "wire_tensor",
]
