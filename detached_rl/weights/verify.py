"""Checking a `WeightUpdate` before it is written: its manifest against the sinks, then each chunk.

`plan_update` checks the manifest against the `WeightSink`s' layouts before anything is fetched;
`check_sinks` asks each named sink what the tensors cannot show (its optional `check_update` hook);
`verify_chunk` fetches one chunk and checks its names, shapes, dtypes and checksums, that it holds no NaN
or Inf (nor values its stored dtype cannot hold: checksums cannot tell, a trainer's NaN weights checksum
fine), and, for an update that is bounded, that no tensor moves further than an optimizer step would.
A `StagedUpdate` is what passed all of it, waiting for a safe point.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from detached_rl.weights.encoding import INDICES, MASK, VALUES, apply_mask, apply_sparse
from detached_rl.weights.sink import TensorLayout, WeightSink
from detached_rl.weights.update import (
    ENCODINGS,
    UPDATE_KINDS,
    ApplyResult,
    Fetch,
    OffTrainerError,
    TensorEntry,
    TensorSpec,
    WeightManifest,
    WeightUpdate,
    WeightUpdateError,
    parse_dtype,
    tensor_checksum,
)

# The largest change an update of the followed run may make to a tensor (`limits.DEFAULT_MAX_WEIGHT_CHANGE`)
# is the RMS of the change over the tensor's RMS, floored at this, so tensors that start at zero (LoRA's B)
# can move. An optimizer step changes weights by about its learning rate; 10x the whole tensor is no training.
CHANGE_FLOOR_RMS = 1e-2
# Float8 tensors have no min/max kernel: they are widened this many elements at a time to be checked.
_WIDEN_ELEMENTS = 2**22


@dataclass
class Progress:
    """Bytes, chunks and checksum time of an update being received."""

    bytes: int = 0
    chunks: int = 0
    checksum_seconds: float = 0.0

    def result(self, version: int, start: float, fetch_seconds: float | None, lock_wait: float,
               swap_start: float) -> ApplyResult:
        """The `ApplyResult` of an update whose swap began at `swap_start` and ends now."""
        end = time.perf_counter()
        fetch_seconds = end - swap_start if fetch_seconds is None else fetch_seconds
        return ApplyResult(applied=True, version=version, bytes=self.bytes, chunks=self.chunks,
                           fetch_seconds=fetch_seconds, checksum_seconds=self.checksum_seconds,
                           lock_wait_seconds=lock_wait, swap_seconds=end - swap_start, seconds=end - start)


@dataclass
class UpdatePlan:
    """A validated update: target layout per name, tensors to expect per chunk, aliases per chunk."""

    layouts: dict[str, TensorLayout]
    by_chunk: list[list[TensorSpec]]
    aliases: list[list[TensorSpec]]
    models: set[str]
    covers_all: bool  # every key of every receiver model is in the update
    # The models it names hold a whole version once it is written: a full update, or a LoRA-only one over a
    # verified base (`check_complete`). Repairs models a failed update left half-written.
    complete: bool = False
    trainer_run: str | None = None  # the run the receiver follows once this update is applied
    reset: bool = False
    # Tensors served now, by model (filled on first use), when the update's change to them is bounded.
    served: dict[str, Mapping[str, Tensor]] | None = None
    # A delta update's base tensor by qualified name (set by the receiver once it checked the base).
    base: Callable[[str], Tensor] | None = None

    @property
    def names(self) -> set[str]:
        """Qualified names of every tensor the update writes."""
        return set(self.layouts)


@dataclass
class StagedUpdate:
    """A verified update waiting for a safe point: its tensors staged on the target devices."""

    manifest: WeightManifest
    plan: UpdatePlan
    tensors: dict[str, dict[str, Tensor]]
    entries: dict[str, TensorEntry]
    fingerprint: str
    progress: Progress
    start: float
    fetched: float

    def acknowledgement(self) -> ApplyResult:
        """What receiving it answers while it waits for its swap (`ApplyResult.staged`)."""
        progress = self.progress
        return ApplyResult(applied=False, staged=True, version=self.manifest.version, bytes=progress.bytes,
                           chunks=progress.chunks, fetch_seconds=self.fetched - self.start,
                           checksum_seconds=progress.checksum_seconds,
                           seconds=time.perf_counter() - self.start)


def plan_update(update: WeightUpdate, sinks: Mapping[str, WeightSink], cast_dtype: torch.dtype | None
                ) -> UpdatePlan:
    """Check the manifest against the sinks' layouts before anything is fetched."""
    manifest = update.manifest
    v = f"v{manifest.version}"
    if manifest.kind not in UPDATE_KINDS:
        raise WeightUpdateError(f"{v}: unknown update kind {manifest.kind!r}")
    if len(update.chunk_refs) != manifest.num_chunks:
        raise WeightUpdateError(
            f"{v}: manifest has {manifest.num_chunks} chunks but {len(update.chunk_refs)} chunk refs"
        )
    layouts = {name: dict(sink.layout()) for name, sink in sinks.items()}
    targets: dict[str, TensorLayout] = {}
    specs: dict[str, TensorSpec] = {}
    by_chunk: list[list[TensorSpec]] = [[] for _ in range(manifest.num_chunks)]
    aliases: list[list[TensorSpec]] = [[] for _ in range(manifest.num_chunks)]
    for spec in manifest.tensors:
        model_name, _, key = spec.name.partition("/")
        if model_name not in layouts:
            raise WeightUpdateError(
                f"{v}: tensor {spec.name!r} names unknown model {model_name!r} (known: {sorted(layouts)})"
            )
        if key not in layouts[model_name]:
            raise WeightUpdateError(f"{v}: unknown key {spec.name!r} (not in model {model_name!r})")
        if spec.name in specs:
            raise WeightUpdateError(f"{v}: key {spec.name!r} listed twice")
        if spec.encoding not in ENCODINGS or (spec.encoding != "dense" and manifest.kind != "delta"):
            raise WeightUpdateError(f"{v}: {spec.name!r} has encoding {spec.encoding!r}, which a "
                                    f"{manifest.kind} update cannot carry")
        if not 0 <= spec.chunk < manifest.num_chunks:
            raise WeightUpdateError(
                f"{v}: key {spec.name!r} in chunk {spec.chunk} of {manifest.num_chunks}"
            )
        target = layouts[model_name][key]
        if spec.shape != target.shape:
            raise WeightUpdateError(
                f"{v}: shape mismatch for {spec.name!r}: update {spec.shape} vs model {target.shape}"
            )
        dtype = parse_dtype(spec.dtype)
        if dtype is None:
            raise WeightUpdateError(f"{v}: unknown dtype {spec.dtype!r} for {spec.name!r}")
        expected_bytes = math.prod(spec.shape) * dtype.itemsize
        if spec.nbytes != expected_bytes:
            raise WeightUpdateError(f"{v}: {spec.name!r} lists {spec.nbytes} bytes; shape {spec.shape} of "
                                    f"{spec.dtype} is {expected_bytes}")
        castable = cast_dtype is not None and dtype.is_floating_point and target.dtype.is_floating_point
        if dtype != target.dtype and not castable:
            raise WeightUpdateError(
                f"{v}: dtype mismatch for {spec.name!r}: update {spec.dtype} vs model {target.dtype}"
                + ("" if cast_dtype is not None else " (no cast_dtype set)")
            )
        wire = manifest.metadata.get("wire_dtype")
        if ((wire is not None and spec.dtype.removeprefix("torch.") == wire) or manifest.kind == "delta") \
                and target.dtype != dtype:
            # Cast by the trainer for a maker storing `wire`: exact only where this maker stores exactly that.
            raise WeightUpdateError(
                f"{v}: {spec.name!r} is stored here as {target.dtype}: an update sent in {spec.dtype} "
                f"(wire_dtype {wire}) would not give the weights a full update gives")
        if spec.alias_of is None:
            by_chunk[spec.chunk].append(spec)
        else:
            source = specs.get(spec.alias_of)
            if (
                source is None
                or source.alias_of is not None
                or (source.shape, source.dtype, source.chunk) != (spec.shape, spec.dtype, spec.chunk)
            ):
                raise WeightUpdateError(
                    f"{v}: {spec.name!r} is an alias of {spec.alias_of!r}, which does not match"
                )
            aliases[spec.chunk].append(spec)
        specs[spec.name] = spec
        targets[spec.name] = target
    named = {name.partition("/")[0] for name in specs}
    if manifest.kind in ("full", "delta"):
        for model_name in sorted(named):
            missing = [key for key in layouts[model_name] if f"{model_name}/{key}" not in specs]
            if missing:
                more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                raise WeightUpdateError(
                    f"{v}: {manifest.kind} update lacks key {model_name + '/' + missing[0]!r}{more}"
                )
    covers_all = sum(map(len, layouts.values())) == len(specs)
    return UpdatePlan(targets, by_chunk, aliases, named, covers_all,
                      complete=manifest.kind in ("full", "delta"))


def check_receiver_settings(mode: str, cast_dtype: torch.dtype | None, max_version_jump: int,
                            max_weight_change: float | None) -> None:
    """A `WeightReceiver`'s settings, each refused with a ValueError naming it."""
    if max_version_jump < 1:
        raise ValueError(f"max_version_jump must be >= 1, got {max_version_jump}")
    if max_weight_change is not None and not (max_weight_change > 0 and math.isfinite(max_weight_change)):
        raise ValueError(
            f"max_weight_change must be a positive finite number or None, got {max_weight_change}")
    if mode not in ("staged", "in_place"):
        raise ValueError(f"mode must be 'staged' or 'in_place', got {mode!r}")
    if cast_dtype is not None and not cast_dtype.is_floating_point:
        raise ValueError(f"cast_dtype must be a floating dtype, got {cast_dtype}")


def fetch_and_stage(update: WeightUpdate, plan: UpdatePlan, fetch: Fetch, deadline: float | None,
                    progress: Progress, sinks: Mapping[str, WeightSink], max_weight_change: float | None
                    ) -> dict[str, dict[str, Tensor]]:
    """Every chunk fetched, verified (`verify_chunk`) and staged by its sink (model -> key -> tensor)."""
    tensors: dict[str, dict[str, Tensor]] = {}
    for index in range(update.manifest.num_chunks):
        chunk = verify_chunk(update, index, fetch, plan, deadline, progress, sinks, max_weight_change)
        for model_name, by_key in by_model(plan, index, chunk).items():
            tensors.setdefault(model_name, {}).update(sinks[model_name].stage(by_key))
    return tensors


def write_in_place(update: WeightUpdate, plan: UpdatePlan, fetch: Fetch, deadline: float | None,
                   progress: Progress, sinks: Mapping[str, WeightSink], max_weight_change: float | None,
                   entries: dict[str, TensorEntry] | None) -> None:
    """Each chunk fetched and verified whole, then written by its sinks; `entries` (fingerprint entries of the
    served tensors, if kept) updated as it goes. A failure after a chunk was verified may leave it
    half-written."""
    for index in range(update.manifest.num_chunks):
        chunk = verify_chunk(update, index, fetch, plan, deadline, progress, sinks, max_weight_change)
        for model_name, tensors in by_model(plan, index, chunk).items():
            sinks[model_name].write(tensors)
        if entries is not None:
            for spec in plan.by_chunk[index] + plan.aliases[index]:
                tensor = chunk[spec.alias_of or spec.name]
                entries[spec.name] = stored_entry(spec, plan.layouts[spec.name], tensor)


def check_sinks(manifest: WeightManifest, plan: UpdatePlan, sinks: Mapping[str, WeightSink]) -> None:
    """Ask each model the update names whether it can take it (the sink's optional `check_update` hook).

    What the tensors cannot show (a LoRA update's alpha, the base it was computed against) is checked here.
    A sink's `WeightUpdateError` keeps its type (an `OffTrainerError` says registering again fixes it).
    """
    v = f"v{manifest.version}"
    for model_name in sorted(plan.models):
        check_update = getattr(sinks[model_name], "check_update", None)
        if check_update is None:
            continue
        try:
            check_update(manifest.kind, manifest.metadata)
        except WeightUpdateError as error:
            raise type(error)(f"{v}: model {model_name!r}: {error}") from error
        except Exception as error:
            raise WeightUpdateError(f"{v}: model {model_name!r}: {error}") from error


def check_complete(manifest: WeightManifest, plan: UpdatePlan, sinks: Mapping[str, WeightSink]) -> None:
    """Refuse a LoRA-only update that would not leave a whole version: one a maker takes as its start (a
    reset, its first weights) must write every tensor of every model except a base the model's sink checks
    against the update's base fingerprint (`verified_base_keys`, e.g. `BaseCheckedSink`; `check_sinks` checks
    the fingerprint itself)."""
    if manifest.kind in ("full", "delta"):
        return
    v = f"v{manifest.version}"
    for model_name in sorted(sinks):
        sink = sinks[model_name]
        base = frozenset(getattr(sink, "verified_base_keys", None) or ())
        missing = [key for key in sink.layout()
                   if key not in base and f"{model_name}/{key}" not in plan.layouts]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise OffTrainerError(
                f"{v}: a {manifest.kind} update cannot start this maker's weights: it lacks "
                f"{model_name + '/' + missing[0]!r}{more}, which no verified base provides; it needs a full "
                "update")


def verify_chunk(update: WeightUpdate, index: int, fetch: Fetch, plan: UpdatePlan, deadline: float | None,
                 progress: Progress, sinks: Mapping[str, WeightSink], max_weight_change: float | None
                 ) -> Mapping[str, Tensor]:
    """Fetch chunk `index` and verify its names, shapes, dtypes, checksums, values and (if bounded) change."""
    manifest = update.manifest
    where = f"v{manifest.version}: chunk {index} (of {manifest.num_chunks})"
    check_deadline(deadline, f"{where}: timed out before fetching it")
    try:
        chunk = fetch(update.chunk_refs[index])
    except Exception as error:  # any transport failure refuses the update
        raise WeightUpdateError(f"{where}: fetch failed: {type(error).__name__}: {error}") from error
    check_deadline(deadline, f"{where}: timed out while fetching it")
    if not isinstance(chunk, Mapping):
        raise WeightUpdateError(f"{where}: fetched a {type(chunk).__name__}, not a mapping of tensors")
    expected = {key for spec in plan.by_chunk[index] for key in chunk_keys(spec)}
    extra, missing = sorted(set(chunk) - expected), sorted(expected - set(chunk))
    if extra:
        raise WeightUpdateError(f"{where}: unexpected tensor {extra[0]!r}")
    if missing:
        raise WeightUpdateError(f"{where}: lacks tensor {missing[0]!r}")
    if any(spec.encoding != "dense" for spec in plan.by_chunk[index]):
        chunk = decode_sparse(where, chunk, plan, index)
    for spec in plan.by_chunk[index]:
        tensor = chunk[spec.name]
        want = (spec.shape, spec.dtype)
        if not isinstance(tensor, Tensor) or (tuple(tensor.shape), str(tensor.dtype)) != want:
            got = ((tuple(tensor.shape), str(tensor.dtype)) if isinstance(tensor, Tensor)
                   else type(tensor).__name__)
            raise WeightUpdateError(f"{where}: {spec.name!r} is {got}, manifest says {want}")
        checksum_start = time.perf_counter()
        checksum = tensor_checksum(tensor)
        progress.checksum_seconds += time.perf_counter() - checksum_start
        if checksum != spec.checksum:
            raise WeightUpdateError(
                f"{where}: checksum mismatch for {spec.name!r}: got {checksum:08x}, "
                f"manifest {spec.checksum:08x}"
            )
        target = plan.layouts[spec.name].dtype
        if not finite_in(tensor, target):
            raise WeightUpdateError(f"{where}: tensor {spec.name!r} holds NaN or Inf"
                                    + ("" if str(target) == spec.dtype else f" or values beyond {target}"))
        if plan.served is not None and max_weight_change is not None:
            _check_change(where, spec, tensor, plan.served, sinks, max_weight_change)
        progress.bytes += spec.sent_nbytes
    progress.chunks += 1
    return chunk


def chunk_keys(spec: TensorSpec) -> tuple[str, ...]:
    """The keys a chunk holds for a tensor: its name, or the parts of its sparse encoding."""
    if spec.encoding == "dense":
        return (spec.name,)
    return (spec.name + (INDICES if spec.encoding == "sparse" else MASK), spec.name + VALUES)


def decode_sparse(where: str, chunk: Mapping[str, Tensor], plan: UpdatePlan, index: int) -> dict[str, Tensor]:
    """Chunk `index` with each sparse tensor rebuilt whole on a copy of its base (checked like any other)."""
    if plan.base is None:
        raise WeightUpdateError(f"{where}: sparse tensors but no base to apply them to")
    out = {}
    for spec in plan.by_chunk[index]:
        if spec.encoding == "sparse":
            out[spec.name] = apply_sparse(where, spec, plan.base(spec.name), chunk[spec.name + INDICES],
                                          chunk[spec.name + VALUES])
        elif spec.encoding == "mask":
            out[spec.name] = apply_mask(where, spec, plan.base(spec.name), chunk[spec.name + MASK],
                                        chunk[spec.name + VALUES])
        else:
            out[spec.name] = chunk[spec.name]
    return out


def _check_change(where: str, spec: TensorSpec, tensor: Tensor, served: dict[str, Mapping[str, Tensor]],
                  sinks: Mapping[str, WeightSink], max_weight_change: float) -> None:
    """Refuse a tensor that changes what is served by more than `max_weight_change` (relative RMS)."""
    model_name, _, key = spec.name.partition("/")
    if model_name not in served:
        served[model_name] = sinks[model_name].state()
    current = served[model_name].get(key)
    if current is None or not tensor.is_floating_point() or not current.is_floating_point():
        return
    change = relative_change(tensor, current)
    if change > max_weight_change:
        raise WeightUpdateError(
            f"{where}: tensor {spec.name!r} would change by {change:.3g}x its size (relative RMS), over "
            f"max_weight_change {max_weight_change:g}: no optimizer step does that"
        )


def stored_entry(spec: TensorSpec, layout: TensorLayout, tensor: Tensor) -> TensorEntry:
    """Fingerprint entry of a verified tensor as stored: the manifest's, unless the sink stores it cast."""
    if str(layout.dtype) == spec.dtype:
        return spec.shape, spec.dtype, spec.checksum
    return spec.shape, str(layout.dtype), tensor_checksum(tensor.to(layout.dtype))


def by_model(plan: UpdatePlan, index: int, chunk: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """The tensors of verified chunk `index` (tied keys included) as model -> key -> tensor."""
    out: dict[str, dict[str, Tensor]] = {}
    for spec in plan.by_chunk[index] + plan.aliases[index]:
        model_name, _, key = spec.name.partition("/")
        out.setdefault(model_name, {})[key] = chunk[spec.alias_of or spec.name]
    return out


def finite_in(tensor: Tensor, stored: torch.dtype) -> bool:
    """False if `tensor` holds NaN or Inf, or a value beyond the largest of `stored` (the dtype kept in).

    One min/max pass (as fast as the checksum; `isfinite` is ~20x slower on CPU): NaN propagates into
    both, an infinity becomes one of them.
    """
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype.itemsize == 1:  # float8: widened (exactly) a slice at a time
        flat = tensor.reshape(-1)
        return all(finite_in(flat[i:i + _WIDEN_ELEMENTS].float(), stored)
                   for i in range(0, flat.numel(), _WIDEN_ELEMENTS))
    lo, hi = torch.aminmax(tensor)
    lowest, highest = float(lo), float(hi)
    limit = torch.finfo(stored).max if stored.is_floating_point else math.inf
    return math.isfinite(lowest) and math.isfinite(highest) and max(-lowest, highest) <= limit


def relative_change(new: Tensor, old: Tensor) -> float:
    """RMS of `new - old` over the RMS of `old` (floored at `CHANGE_FLOOR_RMS`), computed in float32."""
    if new.numel() == 0:
        return 0.0
    old32 = old.detach().to(torch.float32)
    new32 = new.detach().to(device=old32.device, dtype=torch.float32)
    scale = math.sqrt(new.numel())
    change = float(torch.linalg.vector_norm(new32 - old32)) / scale
    size = float(torch.linalg.vector_norm(old32)) / scale
    return change / max(size, CHANGE_FLOOR_RMS)


def check_deadline(deadline: float | None, message: str) -> None:
    """`WeightUpdateError(message)` once `deadline` (a `time.perf_counter` time) has passed."""
    if deadline is not None and time.perf_counter() > deadline:
        raise WeightUpdateError(message)
