"""Versioned, chunked, checksummed weight updates from a trainer to its makers (DESIGN §3.4).

Plain Python, transport-agnostic. The trainer cuts its state dicts into chunks of at most
`chunk_bytes`, hands each chunk to `put` exactly once (the Ray layer: `ray.put`) and sends the
same `WeightUpdate` (manifest + chunk references) to every maker. A maker's `WeightReceiver`
checks the manifest against its models' `WeightSink`s, pulls the chunks one at a time through `fetch`
(the Ray layer: `ray.get(ref, timeout=...)`), verifies names, shapes, dtypes and xxh3
checksums, and only then has the sinks swap the new weights in under the generation lock. A
refused update changes nothing; the previous version keeps serving. A sink is the engine-specific
write (`ModuleWeightSink`: into a torch module's tensors; a generation backend may bring its own).

Tensor names are qualified by model, "<model>/<state-dict key>" (e.g. "actor/lm_head.weight"),
so one update can carry several models. Tied tensors (the same storage under two keys, e.g.
input embeddings and LM head) travel once; the second key is an alias in the manifest.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import torch
import xxhash
from torch import Tensor, nn

KINDS = ("full", "lora")
DEFAULT_CHUNK_BYTES = 64 * 2**20

Put = Callable[[dict[str, Tensor]], Any]
Fetch = Callable[[Any], Mapping[str, Tensor]]
# (shape, dtype, checksum) of one tensor: what a fingerprint is made of.
_Entry = tuple[tuple[int, ...], str, int]


class WeightUpdateError(ValueError):
    """A refused weight update; `reason` says why (naming the key, chunk or version)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def tensor_checksum(t: Tensor) -> int:
    """xxh3-64 of a tensor's raw bytes (any dtype; copied to contiguous CPU memory only if needed)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    # A uint8 view exposes the bytes of any dtype (bfloat16 included) to the buffer protocol.
    # xxh3 runs at ~11 GB/s on one core here, crc32 at ~2 GB/s: verification stays cheap next
    # to the transfer.
    return xxhash.xxh3_64_intdigest(flat.view(torch.uint8).numpy())


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update: qualified name, shape, dtype, size, checksum and chunk index."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    checksum: int
    chunk: int
    # Set for a tied tensor: its data is the tensor `alias_of` (same chunk), sent once.
    alias_of: str | None = None


@dataclass(frozen=True)
class WeightManifest:
    """What an update carries: version, kind ("full" | "lora"), tensor specs and chunk count."""

    version: int
    kind: str
    tensors: tuple[TensorSpec, ...]
    num_chunks: int
    total_bytes: int
    metadata: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class WeightUpdate:
    """A manifest plus one transport reference per chunk, in chunk order."""

    manifest: WeightManifest
    chunk_refs: list = field(hash=False)

    @property
    def version(self) -> int:
        """The manifest's version."""
        return self.manifest.version


@dataclass(frozen=True)
class SendStats:
    """Sender-side cost: bytes and chunks put, total seconds, and the checksum/put parts of it."""

    bytes: int
    chunks: int
    seconds: float
    checksum_seconds: float = 0.0
    put_seconds: float = 0.0


@dataclass(frozen=True)
class ApplyResult:
    """Outcome of `WeightReceiver.apply`; `swap_seconds` is how long the generation lock was held."""

    applied: bool
    version: int
    reason: str = ""
    bytes: int = 0
    chunks: int = 0
    fetch_seconds: float = 0.0  # fetch + verify + stage (in_place: + copy), checksums included
    checksum_seconds: float = 0.0
    lock_wait_seconds: float = 0.0
    swap_seconds: float = 0.0
    seconds: float = 0.0


def _named_tensors(
    models: Mapping[str, Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]],
) -> Iterator[tuple[str, Tensor]]:
    """Yield ("<model>/<key>", tensor) for every tensor of every model, lazily."""
    for model_name, tensors in models.items():
        _check_model_name(model_name)
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        for key, tensor in pairs:
            yield f"{model_name}/{key}", tensor


def _check_model_name(name: str) -> None:
    if not name or "/" in name:
        raise ValueError(f"model name {name!r} must be non-empty and contain no '/'")


def build_weight_update(
    models: Mapping[str, Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]],
    version: int,
    put: Put,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    kind: str = "full",
    metadata: dict | None = None,
) -> tuple[WeightUpdate, SendStats]:
    """Cut state dicts into chunks of at most `chunk_bytes`, `put` each chunk once, return the update.

    A tensor larger than `chunk_bytes` is a chunk of its own. Tensors go to `put` detached,
    contiguous and on the CPU (copied only if they are not already); only the chunk being
    filled is held here, so peak extra memory is one chunk plus what `put` keeps. `put` must
    snapshot the chunk (`ray.put` does) or the weights must not change until every maker fetched.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    start = time.perf_counter()
    specs: list[TensorSpec] = []
    names: set[str] = set()
    refs: list = []
    chunk: dict[str, Tensor] = {}
    used = total = 0
    checksum_seconds = put_seconds = 0.0
    # Storage identity -> (weak reference to the tensor, its spec). The weak reference guards
    # against address reuse: a freed tensor's address may come back for a different tensor.
    seen: dict[tuple, tuple[weakref.ref, TensorSpec]] = {}

    def flush() -> None:
        nonlocal chunk, used, put_seconds
        put_start = time.perf_counter()
        refs.append(put(chunk))
        put_seconds += time.perf_counter() - put_start
        chunk, used = {}, 0

    for name, original in _named_tensors(models):
        if name in names:
            raise ValueError(f"duplicate tensor name {name!r}")
        names.add(name)
        tensor = original.detach()
        identity = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and identity in seen:
            ref, source = seen[identity]
            if ref() is not None:
                specs.append(replace(source, name=name, alias_of=source.name))
                continue
        host = tensor.cpu().contiguous()
        nbytes = host.numel() * host.element_size()
        if chunk and used + nbytes > chunk_bytes:
            flush()
        checksum_start = time.perf_counter()
        checksum = tensor_checksum(host)
        checksum_seconds += time.perf_counter() - checksum_start
        spec = TensorSpec(name, tuple(host.shape), str(host.dtype), nbytes, checksum, len(refs))
        specs.append(spec)
        if tensor.numel():
            seen[identity] = (weakref.ref(original), spec)
        chunk[name] = host
        used += nbytes
        total += nbytes
    if chunk:
        flush()
    manifest = WeightManifest(version, kind, tuple(specs), len(refs), total, dict(metadata or {}))
    stats = SendStats(total, len(refs), time.perf_counter() - start, checksum_seconds, put_seconds)
    return WeightUpdate(manifest, refs), stats


def restrict_update(update: WeightUpdate, models: Iterable[str], fetch: Fetch) -> tuple[WeightUpdate, Fetch]:
    """The part of `update` for `models` only, and a `fetch` that drops the other models' tensors.

    For a receiver that mirrors some of the trainer's models (e.g. a critic scorer that gets
    the `critic/` tensors of a PPO update, not the `actor/` ones). Chunks holding none of
    `models` are never fetched; the version, kind and metadata stay those of the update.
    """
    keep = set(models)
    specs = [spec for spec in update.manifest.tensors if spec.name.partition("/")[0] in keep]
    used = sorted({spec.chunk for spec in specs})
    if any(index >= len(update.chunk_refs) for index in used):
        raise WeightUpdateError(f"v{update.manifest.version}: manifest names chunk {used[-1]} "
                                f"of {len(update.chunk_refs)} chunk refs")
    renumber = {old: new for new, old in enumerate(used)}
    names = {spec.name for spec in specs}
    manifest = replace(
        update.manifest,
        tensors=tuple(replace(spec, chunk=renumber[spec.chunk]) for spec in specs),
        num_chunks=len(used),
        total_bytes=sum(spec.nbytes for spec in specs if spec.alias_of is None),
    )

    def fetch_kept(ref: Any) -> Mapping[str, Tensor]:
        chunk = fetch(ref)
        if not isinstance(chunk, Mapping):
            return chunk  # the receiver refuses it, naming the type
        return {name: tensor for name, tensor in chunk.items() if name in names}

    return WeightUpdate(manifest, [update.chunk_refs[index] for index in used]), fetch_kept


def _entries_of(models: Mapping[str, Mapping[str, Tensor]]) -> dict[str, _Entry]:
    entries = {}
    for name, tensor in _named_tensors(models):
        entries[name] = (tuple(tensor.shape), str(tensor.dtype), tensor_checksum(tensor))
    return entries


def _fingerprint_of(entries: Mapping[str, _Entry]) -> str:
    digest = hashlib.sha256()
    for name in sorted(entries):
        shape, dtype, checksum = entries[name]
        digest.update(f"{name}\t{','.join(map(str, shape))}\t{dtype}\t{checksum:08x}\n".encode())
    return digest.hexdigest()


def state_fingerprint(models: Mapping[str, Mapping[str, Tensor]]) -> str:
    """One sha256 hex digest over the qualified names, shapes, dtypes and checksums of all tensors."""
    return _fingerprint_of(_entries_of(models))


def _parse_dtype(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass(frozen=True)
class TensorLayout:
    """Shape and dtype of one tensor a `WeightSink` takes."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class SinkCommit:
    """What `WeightSink.commit` is told about the update whose tensors it was just given."""

    version: int
    kind: str  # "full" | "lora"
    keys: frozenset[str]  # the keys written to this sink (its own naming, no "<model>/" prefix)
    metadata: Mapping[str, Any]  # the manifest's (LoRA updates: "lora" holds the adapter config)


@runtime_checkable
class WeightSink(Protocol):
    """Where one model's verified weights go: the engine-specific part of applying a `WeightUpdate`.

    The `WeightReceiver` keeps the protocol (versions, manifests, chunk fetching, checksums,
    refusals, the generation lock, fingerprints); a sink only says what it holds and writes.
    Keys are the model's state-dict keys as the trainer names them. Per applied update the
    receiver calls, in order: `layout` (to check the manifest before fetching anything);
    `stage` on each verified chunk (mode "staged", outside the lock); `write` once with every
    staged tensor (mode "staged") or once per verified chunk, unstaged (mode "in_place"); then
    `commit`. `write` and `commit` run under the generation lock, so an update becomes visible
    between two generation batches. If either raises, the receiver refuses the update and marks
    the model half-written until a later full update.
    """

    def layout(self) -> Mapping[str, TensorLayout]:
        """Every key this sink holds, with the shape and dtype it stores it in."""
        ...

    def state(self) -> Mapping[str, Tensor]:
        """The tensors as served, by key (for fingerprints; may copy)."""
        ...

    def stage(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Verified tensors made ready for `write` (e.g. on the serving device, in the stored dtype)."""
        ...

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        """Write tensors (staged, or straight from a chunk) into the served weights; casts as needed."""
        ...

    def commit(self, update: SinkCommit) -> None:
        """Make the written tensors serve (e.g. re-merge LoRA weights, switch to a new adapter)."""
        ...


class ModuleWeightSink:
    """A `WeightSink` over a torch module: writes into the tensors of its `state_dict()` (shared storage)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def layout(self) -> dict[str, TensorLayout]:
        """Shape and dtype of each state-dict tensor."""
        return {key: TensorLayout(tuple(t.shape), t.dtype) for key, t in self.module.state_dict().items()}

    def state(self) -> Mapping[str, Tensor]:
        """The module's state dict (no copies)."""
        return self.module.state_dict()

    def stage(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Each tensor on its target's device and in its dtype (no copy when it already is)."""
        targets = self.module.state_dict()
        return {key: t.to(device=targets[key].device, dtype=targets[key].dtype) for key, t in tensors.items()}

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy each tensor into the module's tensor of that key."""
        targets = self.module.state_dict()
        with torch.no_grad():
            for key, tensor in tensors.items():
                targets[key].copy_(tensor)

    def commit(self, update: SinkCommit) -> None:
        """Nothing to do: the module computes with the written tensors."""


@dataclass
class _Plan:
    """A validated update: target layout per name, tensors to expect per chunk, aliases per chunk."""

    layouts: dict[str, TensorLayout]
    by_chunk: list[list[TensorSpec]]
    aliases: list[list[TensorSpec]]
    models: set[str]
    covers_all: bool  # every key of every receiver model is in the update


@dataclass
class _Progress:
    bytes: int = 0
    chunks: int = 0
    checksum_seconds: float = 0.0


class WeightReceiver:
    """Maker side: validates, fetches, verifies and applies `WeightUpdate`s to named models.

    `models` maps each model name to its `WeightSink`, or to a torch module (written through a
    `ModuleWeightSink`). `lock` is the lock generation holds per batch (a private one if None,
    see `.lock`). mode "staged": everything is fetched, verified and staged (on the target
    devices) first; the lock is held only for the write into the models (costs a second copy of
    the updated tensors in memory). mode "in_place": the lock is held for the whole update and
    each verified chunk is written straight into the models (no second copy, but generation
    pauses for the whole transfer, and a chunk failing after others were written leaves the
    models half-updated: `consistent` turns False until a later full update of those models succeeds).
    """

    def __init__(
        self,
        models: Mapping[str, nn.Module | WeightSink],
        cast_dtype: torch.dtype | None = None,
        mode: str = "staged",
        lock: threading.Lock | threading.RLock | None = None,
        version: int = 0,
        after_swap: Callable[[set[str]], None] | None = None,
    ) -> None:
        if mode not in ("staged", "in_place"):
            raise ValueError(f"mode must be 'staged' or 'in_place', got {mode!r}")
        if cast_dtype is not None and not cast_dtype.is_floating_point:
            raise ValueError(f"cast_dtype must be a floating dtype, got {cast_dtype}")
        self.sinks: dict[str, WeightSink] = {}
        for name, model in models.items():
            _check_model_name(name)
            if isinstance(model, nn.Module):
                self.sinks[name] = ModuleWeightSink(model)
            elif isinstance(model, WeightSink):
                self.sinks[name] = model
            else:
                raise TypeError(f"model {name!r} is a {type(model).__name__}, not a torch module or a WeightSink")
        self.models = dict(models)
        self.cast_dtype = cast_dtype
        self.mode = mode
        self.lock = lock if lock is not None else threading.Lock()
        # Called under the lock with the qualified names just written (e.g. re-merge LoRA weights).
        self.after_swap = after_swap
        self.last_error: WeightUpdateError | None = None
        self._version = version
        self.trainer_run: str | None = None  # `trainer_run` of the last update applied (see `_apply`)
        self._dirty: set[str] = set()  # models left half-written by a failed update
        self._apply_lock = threading.Lock()  # one apply at a time
        # Guards the weights against the lazy fingerprint computation. Lock order: `lock`, then this.
        self._state_lock = threading.Lock()
        self._entries: dict[str, _Entry] | None = None
        self._fingerprint: str | None = None

    @property
    def version(self) -> int:
        """Version of the last update applied in full (see `consistent`)."""
        return self._version

    @property
    def consistent(self) -> bool:
        """False while a failed in-place update has left some model half-written."""
        return not self._dirty

    @property
    def servable_version(self) -> int:
        """The version to tag generations with; raises `WeightUpdateError` while not `consistent`."""
        if self._dirty:
            raise WeightUpdateError(
                f"weights of {sorted(self._dirty)} are half-updated (last full version {self._version}); "
                "waiting for a full update"
            )
        return self._version

    @property
    def fingerprint(self) -> str:
        """`state_fingerprint` of the current weights.

        The first call checksums every weight (one xxh3 pass, about 11 GB/s on a CPU core, plus
        the device-to-host copy); after that updates maintain it from the manifest checksums,
        re-checksumming only tensors that were cast.
        """
        fingerprint = self._fingerprint
        return fingerprint if fingerprint is not None else self._compute_fingerprint()

    def refresh_fingerprint(self) -> str:
        """Recompute the fingerprint from the weights (after changing them outside this receiver)."""
        return self._compute_fingerprint(refresh=True)

    def _compute_fingerprint(self, refresh: bool = False) -> str:
        # Weights are only written under `_state_lock`, so they hold still while this runs.
        with self._state_lock:
            if refresh:
                self._entries = None
            self._fingerprint = _fingerprint_of(self._current_entries())
            return self._fingerprint

    def _current_entries(self) -> dict[str, _Entry]:
        """Per-tensor entries of the current weights (computed on first use); hold `_state_lock`."""
        if self._entries is None:
            self._entries = _entries_of({name: sink.state() for name, sink in self.sinks.items()})
        return self._entries

    def apply(self, update: WeightUpdate, fetch: Fetch, timeout: float | None = None) -> ApplyResult:
        """Apply `update`, pulling its chunks with `fetch`; raise `WeightUpdateError` if refused.

        `timeout` bounds the whole update (fetches and waiting for the lock). `fetch` itself is
        not interrupted: give it its own timeout (e.g. `ray.get(ref, timeout=...)`).
        """
        with self._apply_lock:
            try:
                result = self._apply(update, fetch, timeout)
            except WeightUpdateError as error:
                self.last_error = error
                raise
            self.last_error = None
            return result

    def _apply(self, update: WeightUpdate, fetch: Fetch, timeout: float | None) -> ApplyResult:
        start = time.perf_counter()
        manifest = update.manifest
        version = manifest.version
        run = manifest.metadata.get("trainer_run")
        # A trainer resumed from a checkpoint (a new run id) may legitimately go back to an older version;
        # only a full update can roll back (a LoRA update assumes the adapter it was computed against).
        rollback = run is not None and run != self.trainer_run and self.trainer_run is not None
        if rollback and manifest.kind != "full":
            raise WeightUpdateError(f"v{version}: a {manifest.kind} update from a new trainer run {run!r} "
                                    f"(this maker follows {self.trainer_run!r}) needs a full update first")
        if version == self._version and not self._dirty and not rollback:
            return ApplyResult(applied=False, version=version, reason="same version")
        if version < self._version and not rollback:
            raise WeightUpdateError(f"stale version {version} < current {self._version}")
        plan = self._validate(update)
        deadline = None if timeout is None else start + timeout
        apply = self._apply_staged if self.mode == "staged" else self._apply_in_place
        return apply(update, plan, fetch, start, deadline)

    def _validate(self, update: WeightUpdate) -> _Plan:
        """Check the manifest against the models before anything is fetched."""
        manifest = update.manifest
        v = f"v{manifest.version}"
        if manifest.kind not in KINDS:
            raise WeightUpdateError(f"{v}: unknown update kind {manifest.kind!r}")
        if len(update.chunk_refs) != manifest.num_chunks:
            raise WeightUpdateError(
                f"{v}: manifest has {manifest.num_chunks} chunks but {len(update.chunk_refs)} chunk refs"
            )
        layouts = {name: dict(sink.layout()) for name, sink in self.sinks.items()}
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
            if not 0 <= spec.chunk < manifest.num_chunks:
                raise WeightUpdateError(
                    f"{v}: key {spec.name!r} in chunk {spec.chunk} of {manifest.num_chunks}"
                )
            target = layouts[model_name][key]
            if spec.shape != target.shape:
                raise WeightUpdateError(
                    f"{v}: shape mismatch for {spec.name!r}: update {spec.shape} vs model {target.shape}"
                )
            dtype = _parse_dtype(spec.dtype)
            if dtype is None:
                raise WeightUpdateError(f"{v}: unknown dtype {spec.dtype!r} for {spec.name!r}")
            expected_bytes = math.prod(spec.shape) * dtype.itemsize
            if spec.nbytes != expected_bytes:
                raise WeightUpdateError(f"{v}: {spec.name!r} lists {spec.nbytes} bytes; shape {spec.shape} of "
                                        f"{spec.dtype} is {expected_bytes}")
            castable = (
                self.cast_dtype is not None and dtype.is_floating_point and target.dtype.is_floating_point
            )
            if dtype != target.dtype and not castable:
                raise WeightUpdateError(
                    f"{v}: dtype mismatch for {spec.name!r}: update {spec.dtype} vs model {target.dtype}"
                    + ("" if self.cast_dtype is not None else " (no cast_dtype set)")
                )
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
        if manifest.kind == "full":
            for model_name in sorted(named):
                missing = [key for key in layouts[model_name] if f"{model_name}/{key}" not in specs]
                if missing:
                    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
                    raise WeightUpdateError(
                        f"{v}: full update lacks key {model_name + '/' + missing[0]!r}{more}"
                    )
        covers_all = sum(map(len, layouts.values())) == len(specs)
        return _Plan(targets, by_chunk, aliases, named, covers_all)

    def _receive(
        self,
        update: WeightUpdate,
        index: int,
        fetch: Fetch,
        plan: _Plan,
        deadline: float | None,
        progress: _Progress,
    ) -> Mapping[str, Tensor]:
        """Fetch chunk `index` and verify its names, shapes, dtypes and checksums."""
        manifest = update.manifest
        where = f"v{manifest.version}: chunk {index} (of {manifest.num_chunks})"
        _check_deadline(deadline, f"{where}: timed out before fetching it")
        try:
            chunk = fetch(update.chunk_refs[index])
        except Exception as error:  # any transport failure refuses the update
            raise WeightUpdateError(f"{where}: fetch failed: {type(error).__name__}: {error}") from error
        _check_deadline(deadline, f"{where}: timed out while fetching it")
        if not isinstance(chunk, Mapping):
            raise WeightUpdateError(f"{where}: fetched a {type(chunk).__name__}, not a mapping of tensors")
        expected = {spec.name for spec in plan.by_chunk[index]}
        extra, missing = sorted(set(chunk) - expected), sorted(expected - set(chunk))
        if extra:
            raise WeightUpdateError(f"{where}: unexpected tensor {extra[0]!r}")
        if missing:
            raise WeightUpdateError(f"{where}: lacks tensor {missing[0]!r}")
        for spec in plan.by_chunk[index]:
            tensor = chunk[spec.name]
            if not isinstance(tensor, Tensor) or (tuple(tensor.shape), str(tensor.dtype)) != (
                spec.shape,
                spec.dtype,
            ):
                got = (
                    (tuple(tensor.shape), str(tensor.dtype))
                    if isinstance(tensor, Tensor)
                    else type(tensor).__name__
                )
                raise WeightUpdateError(
                    f"{where}: {spec.name!r} is {got}, manifest says {(spec.shape, spec.dtype)}"
                )
            checksum_start = time.perf_counter()
            checksum = tensor_checksum(tensor)
            progress.checksum_seconds += time.perf_counter() - checksum_start
            if checksum != spec.checksum:
                raise WeightUpdateError(
                    f"{where}: checksum mismatch for {spec.name!r}: got {checksum:08x}, manifest {spec.checksum:08x}"
                )
            progress.bytes += spec.nbytes
        progress.chunks += 1
        return chunk

    def _acquire(self, deadline: float | None, version: int) -> float:
        """Take the generation lock within the deadline; return the seconds waited."""
        wait_start = time.perf_counter()
        remaining = -1 if deadline is None else max(0.0, deadline - wait_start)
        if not self.lock.acquire(timeout=remaining):
            raise WeightUpdateError(f"v{version}: timed out waiting for the generation lock")
        return time.perf_counter() - wait_start

    def _apply_staged(
        self, update: WeightUpdate, plan: _Plan, fetch: Fetch, start: float, deadline: float | None
    ) -> ApplyResult:
        manifest = update.manifest
        progress = _Progress()
        staged: dict[str, dict[str, Tensor]] = {}  # model -> key -> staged tensor
        for index in range(manifest.num_chunks):
            chunk = self._receive(update, index, fetch, plan, deadline, progress)
            for model_name, tensors in _by_model(plan, index, chunk).items():
                staged.setdefault(model_name, {}).update(self.sinks[model_name].stage(tensors))
        fetched = time.perf_counter()
        # Work out the new fingerprint before taking the lock, so the swap is only the write.
        with self._state_lock:
            entries = {} if plan.covers_all else dict(self._current_entries())
        for spec in manifest.tensors:
            model_name, _, key = spec.name.partition("/")
            entries[spec.name] = self._entry(spec, plan.layouts[spec.name], staged[model_name][key])
        fingerprint = _fingerprint_of(entries)
        lock_wait = self._acquire(deadline, manifest.version)
        swap_start = time.perf_counter()
        try:
            with self._state_lock, torch.no_grad():
                try:
                    for model_name, tensors in staged.items():
                        self.sinks[model_name].write(tensors)
                    self._commit(manifest)
                except Exception as error:
                    self._dirty |= plan.models
                    self._entries = self._fingerprint = None
                    raise WeightUpdateError(f"v{manifest.version}: swap failed: {error}") from error
                self._version = manifest.version
                self.trainer_run = manifest.metadata.get("trainer_run", self.trainer_run)
                self._entries, self._fingerprint = entries, fingerprint
                if manifest.kind == "full":
                    self._dirty -= plan.models
        finally:
            self.lock.release()
        end = time.perf_counter()
        return ApplyResult(
            applied=True,
            version=manifest.version,
            bytes=progress.bytes,
            chunks=progress.chunks,
            fetch_seconds=fetched - start,
            checksum_seconds=progress.checksum_seconds,
            lock_wait_seconds=lock_wait,
            swap_seconds=end - swap_start,
            seconds=end - start,
        )

    def _apply_in_place(
        self, update: WeightUpdate, plan: _Plan, fetch: Fetch, start: float, deadline: float | None
    ) -> ApplyResult:
        manifest = update.manifest
        progress = _Progress()
        lock_wait = self._acquire(deadline, manifest.version)
        swap_start = time.perf_counter()
        written = False
        try:
            with self._state_lock, torch.no_grad():
                entries = self._entries
                try:
                    for index in range(manifest.num_chunks):
                        # The whole chunk is verified before any of it is written.
                        chunk = self._receive(update, index, fetch, plan, deadline, progress)
                        for model_name, tensors in _by_model(plan, index, chunk).items():
                            written = True  # a write that fails may have written part of its tensors
                            self.sinks[model_name].write(tensors)
                        if entries is not None:
                            for spec in plan.by_chunk[index] + plan.aliases[index]:
                                tensor = chunk[spec.alias_of or spec.name]
                                entries[spec.name] = self._entry(spec, plan.layouts[spec.name], tensor)
                    self._commit(manifest)
                except Exception as error:
                    if written:
                        self._dirty |= plan.models
                    if entries is not None:
                        self._fingerprint = _fingerprint_of(entries)
                    if isinstance(error, WeightUpdateError):
                        raise
                    raise WeightUpdateError(
                        f"v{manifest.version}: in-place update failed: {error}"
                    ) from error
                self._version = manifest.version
                self.trainer_run = manifest.metadata.get("trainer_run", self.trainer_run)
                if manifest.kind == "full":
                    self._dirty -= plan.models
                self._fingerprint = None if entries is None else _fingerprint_of(entries)
        finally:
            self.lock.release()
        end = time.perf_counter()
        return ApplyResult(
            applied=True,
            version=manifest.version,
            bytes=progress.bytes,
            chunks=progress.chunks,
            fetch_seconds=end - swap_start,
            checksum_seconds=progress.checksum_seconds,
            lock_wait_seconds=lock_wait,
            swap_seconds=end - swap_start,
            seconds=end - start,
        )

    def _commit(self, manifest: WeightManifest) -> None:
        """Tell each sink its part of the update is written, then run `after_swap` (under the lock)."""
        keys: dict[str, set[str]] = {}
        for spec in manifest.tensors:
            model_name, _, key = spec.name.partition("/")
            keys.setdefault(model_name, set()).add(key)
        for model_name, written in keys.items():
            self.sinks[model_name].commit(
                SinkCommit(manifest.version, manifest.kind, frozenset(written), manifest.metadata)
            )
        if self.after_swap is not None:
            self.after_swap({spec.name for spec in manifest.tensors})

    @staticmethod
    def _entry(spec: TensorSpec, layout: TensorLayout, tensor: Tensor) -> _Entry:
        """Fingerprint entry of a tensor as stored: the manifest's, unless the sink stores it cast."""
        if str(layout.dtype) == spec.dtype:
            return spec.shape, spec.dtype, spec.checksum
        return spec.shape, str(layout.dtype), tensor_checksum(tensor.to(layout.dtype))


def _by_model(plan: _Plan, index: int, chunk: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """The tensors of verified chunk `index` (tied keys included) as model -> key -> tensor."""
    out: dict[str, dict[str, Tensor]] = {}
    for spec in plan.by_chunk[index] + plan.aliases[index]:
        model_name, _, key = spec.name.partition("/")
        out.setdefault(model_name, {})[key] = chunk[spec.alias_of or spec.name]
    return out


def _check_deadline(deadline: float | None, message: str) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise WeightUpdateError(message)


__all__ = [
    "ApplyResult",
    "ModuleWeightSink",
    "SendStats",
    "SinkCommit",
    "TensorLayout",
    "TensorSpec",
    "WeightManifest",
    "WeightReceiver",
    "WeightSink",
    "WeightUpdate",
    "WeightUpdateError",
    "build_weight_update",
    "state_fingerprint",
    "tensor_checksum",
]
