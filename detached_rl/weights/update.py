"""Versioned, chunked, checksummed weight updates from a trainer to its makers (docs/design.md §3.4).

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
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import xxhash
from torch import Tensor

from detached_rl.core.limits import WEIGHT_SYNC_KINDS

KINDS = WEIGHT_SYNC_KINDS  # what a trainer syncs (`TrainerConfig.weight_sync`)
# What an update may be: a "delta" is a full update sent as the elements changed since a base version
# (`weights.encoding`).
UPDATE_KINDS = (*KINDS, "delta")
# How a tensor travels: whole, or as the indices and values of the elements that differ from its base.
ENCODINGS = ("dense", "sparse", "mask")
DEFAULT_CHUNK_BYTES = 64 * 2**20

Put = Callable[[dict[str, Tensor]], Any]
Fetch = Callable[[Any], Mapping[str, Tensor]]
# (shape, dtype, checksum) of one tensor: what a fingerprint is made of.
TensorEntry = tuple[tuple[int, ...], str, int]


class NonFiniteWeightsError(ValueError):
    """The trainer refused to build an update: a tensor (named in the message and `tensor`) holds NaN/inf."""

    def __init__(self, tensor: str, message: str) -> None:
        super().__init__(message)
        self.tensor = tensor


def count_nonfinite(t: Tensor) -> int:
    """How many NaN/inf values a tensor holds (0 for integer and bool tensors)."""
    if not (t.is_floating_point() or t.is_complex()):
        return 0
    # A sum is NaN/inf whenever an element is; it is cheap (isfinite over every element is ~50x slower on a
    # CPU). Only a sum that is not finite (or overflowed: huge finite values) pays for the exact count.
    total = t.sum(dtype=torch.float32) if t.is_floating_point() and t.element_size() <= 4 else t.sum()
    if bool(torch.isfinite(total)):
        return 0
    return int((~torch.isfinite(t)).sum())


class WeightUpdateError(ValueError):
    """A refused weight update; `reason` says why (naming the key, chunk or version)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class OffTrainerError(WeightUpdateError):
    """A refused update that shows the maker's weights are not where its trainer's updates start from (the
    maker is ahead of the update, follows another run or holds another base): registering again fixes it."""


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
    # "sparse" / "mask" (delta updates only): the chunk holds "<name>@indices" (or a bit mask, "<name>@mask")
    # and "<name>@values" instead of "<name>", the elements that differ from the tensor of the update's
    # base; `nbytes` and `checksum` are the whole new tensor's, `wire_nbytes` what travels (None: `nbytes`).
    encoding: str = "dense"
    wire_nbytes: int | None = None

    @property
    def sent_nbytes(self) -> int:
        """Bytes this tensor puts on the wire (0 for an alias)."""
        if self.alias_of is not None:
            return 0
        return self.nbytes if self.wire_nbytes is None else self.wire_nbytes


@dataclass(frozen=True)
class WeightManifest:
    """What an update carries: version, kind ("full" | "lora" | "delta"), tensor specs and chunk count."""

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
    """Outcome of `WeightReceiver.receive`; `swap_seconds` is how long the generation lock was held.

    `staged`: received and verified, waiting for the next safe point between two generation batches
    (`receive(..., swap="at_safe_point")` acknowledges then; `applied` is False until the swap).
    """

    applied: bool
    version: int
    reason: str = ""
    staged: bool = False
    bytes: int = 0
    chunks: int = 0
    fetch_seconds: float = 0.0  # fetch + verify + stage (in_place: + copy), checksums included
    checksum_seconds: float = 0.0
    lock_wait_seconds: float = 0.0
    swap_seconds: float = 0.0
    seconds: float = 0.0


def qualified_tensors(
    models: Mapping[str, Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]],
) -> Iterator[tuple[str, Tensor]]:
    """Yield ("<model>/<key>", tensor) for every tensor of every model, lazily."""
    for model_name, tensors in models.items():
        check_model_name(model_name)
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        for key, tensor in pairs:
            yield f"{model_name}/{key}", tensor


def check_model_name(name: str) -> None:
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
    A tensor holding NaN or inf raises `NonFiniteWeightsError` naming it: no such update is ever built.
    """
    builder = UpdateBuilder(version, put, chunk_bytes, kind, metadata)
    for name, tensor in qualified_tensors(models):
        builder.add(name, tensor)
    return builder.finish()


def check_finite(name: str, tensor: Tensor, version: int) -> None:
    """`NonFiniteWeightsError` naming `name` if the tensor holds NaN or inf."""
    nonfinite = count_nonfinite(tensor)
    if nonfinite:
        raise NonFiniteWeightsError(
            name, f"weight update v{version} not built: tensor {name!r} holds {nonfinite} NaN/inf values "
                  f"(of {tensor.numel()})")


class UpdateBuilder:
    """Builds one update as its tensors come: cuts them into chunks of at most `chunk_bytes` and `put`s each
    chunk once (see `build_weight_update`); `add` each tensor, then `finish`."""

    def __init__(self, version: int, put: Put, chunk_bytes: int = DEFAULT_CHUNK_BYTES, kind: str = "full",
                 metadata: dict | None = None) -> None:
        if kind not in UPDATE_KINDS:
            raise ValueError(f"kind must be one of {UPDATE_KINDS}, got {kind!r}")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.version, self.put, self.chunk_bytes, self.kind = version, put, chunk_bytes, kind
        self.metadata = dict(metadata or {})
        self.start = time.perf_counter()
        self.specs: list[TensorSpec] = []
        self.names: set[str] = set()
        self.refs: list = []
        self.chunk: dict[str, Tensor] = {}
        self.used = self.total = 0
        self.checksum_seconds = self.put_seconds = 0.0
        # Storage identity -> (weak reference to the tensor, its spec). The weak reference guards
        # against address reuse: a freed tensor's address may come back for a different tensor.
        self.seen: dict[tuple, tuple[weakref.ref, TensorSpec]] = {}

    def flush(self) -> None:
        """`put` the chunk being filled (if any) and start a new one."""
        if not self.chunk:
            return
        put_start = time.perf_counter()
        self.refs.append(self.put(self.chunk))
        self.put_seconds += time.perf_counter() - put_start
        self.chunk, self.used = {}, 0

    def alias(self, name: str, original: Tensor) -> bool:
        """Record `name` as an alias if `original` shares storage with a tensor added before; True if so."""
        if name in self.names:
            raise ValueError(f"duplicate tensor name {name!r}")
        tensor = original.detach()
        identity = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if tensor.numel() and identity in self.seen:
            ref, source = self.seen[identity]
            if ref() is not None:
                self.names.add(name)
                self.specs.append(replace(source, name=name, alias_of=source.name))
                return True
        return False

    def add(self, name: str, original: Tensor, host: Tensor | None = None, check: bool = True,
            parts: Mapping[str, Tensor] | None = None, encoding: str = "sparse") -> TensorSpec | None:
        """Add one tensor (None: it was an alias of one added before).

        `host`: what to send for it, if not `original` itself on the CPU (e.g. a cast copy); `check`: refuse
        NaN/inf (skip when done already). `parts`: send these tensors instead (a sparse encoding of `host`,
        see `weights.encoding`; `encoding` names it); the spec keeps `host`'s shape, dtype, size and
        checksum.
        """
        if self.alias(name, original):
            return None
        self.names.add(name)
        if check:
            check_finite(name, original, self.version)
        if host is None:
            host = original.detach().cpu().contiguous()
        nbytes = host.numel() * host.element_size()
        sent = {name: host} if parts is None else dict(parts)
        wire = sum(t.numel() * t.element_size() for t in sent.values())
        if self.chunk and self.used + wire > self.chunk_bytes:
            self.flush()
        checksum_start = time.perf_counter()
        checksum = tensor_checksum(host)
        self.checksum_seconds += time.perf_counter() - checksum_start
        spec = TensorSpec(name, tuple(host.shape), str(host.dtype), nbytes, checksum, len(self.refs),
                          encoding="dense" if parts is None else encoding,
                          wire_nbytes=None if parts is None else wire)
        self.specs.append(spec)
        if original.numel():
            tensor = original.detach()
            identity = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            self.seen[identity] = (weakref.ref(original), spec)
        self.chunk.update(sent)
        self.used += wire
        self.total += wire
        return spec

    def finish(self) -> tuple[WeightUpdate, SendStats]:
        """Put the last chunk; the update and what building it cost."""
        self.flush()
        manifest = WeightManifest(self.version, self.kind, tuple(self.specs), len(self.refs), self.total,
                                  self.metadata)
        stats = SendStats(self.total, len(self.refs), time.perf_counter() - self.start, self.checksum_seconds,
                          self.put_seconds)
        return WeightUpdate(manifest, self.refs), stats


def chunk_key_tensor(key: str) -> str:
    """The tensor a chunk's key belongs to ("<name>@indices", "<name>@mask", "<name>@values": of "<name>")."""
    for suffix in ("@indices", "@mask", "@values"):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


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
        total_bytes=sum(spec.sent_nbytes for spec in specs),
    )

    def fetch_kept(ref: Any) -> Mapping[str, Tensor]:
        chunk = fetch(ref)
        if not isinstance(chunk, Mapping):
            return chunk  # the receiver refuses it, naming the type
        return {key: tensor for key, tensor in chunk.items() if chunk_key_tensor(key) in names}

    return WeightUpdate(manifest, [update.chunk_refs[index] for index in used]), fetch_kept


def tensor_entries(
    models: Mapping[str, Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]],
) -> dict[str, TensorEntry]:
    entries = {}
    for name, tensor in qualified_tensors(models):
        entries[name] = (tuple(tensor.shape), str(tensor.dtype), tensor_checksum(tensor))
    return entries


def fingerprint_of_entries(entries: Mapping[str, TensorEntry]) -> str:
    digest = hashlib.sha256()
    for name in sorted(entries):
        shape, dtype, checksum = entries[name]
        digest.update(f"{name}\t{','.join(map(str, shape))}\t{dtype}\t{checksum:08x}\n".encode())
    return digest.hexdigest()


def state_fingerprint(models: Mapping[str, Mapping[str, Tensor] | Iterable[tuple[str, Tensor]]]) -> str:
    """One sha256 hex digest over the qualified names, shapes, dtypes and checksums of all tensors.

    A model's tensors may come as a lazy stream of (key, tensor) pairs: each is checksummed and dropped in
    turn.
    """
    return fingerprint_of_entries(tensor_entries(models))


def parse_dtype(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


__all__ = [
    "ENCODINGS", "UPDATE_KINDS", "ApplyResult", "NonFiniteWeightsError", "SendStats", "TensorSpec",
    "UpdateBuilder", "WeightManifest", "WeightUpdate", "WeightUpdateError", "build_weight_update",
    "chunk_key_tensor", "count_nonfinite", "restrict_update", "state_fingerprint", "tensor_checksum",
]
