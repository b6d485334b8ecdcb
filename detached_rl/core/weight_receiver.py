"""`WeightReceiver`: a maker's side of the weight-update protocol (`core.weight_sync`).

It checks a `WeightUpdate`'s manifest against its models' `WeightSink`s, pulls the chunks one at
a time, verifies names, shapes, dtypes and checksums, and only then has the sinks swap the new
weights in under the generation lock. A refused update changes nothing; the previous version
keeps serving. A receiver follows one trainer run (the `trainer_run` of the first update it takes
with a run id): updates of that run move it forward by at most `max_version_jump` versions; another
run, a rollback or a bigger jump is taken only as an explicit reset (`apply(..., reset=True)`, what a
maker does when it registers with its trainers). A tensor with NaN or Inf, or with values its stored
dtype cannot hold, refuses the update before it is written (checksums cannot tell: a trainer's NaN
weights checksum fine).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from detached_rl.core.weight_sink import ModuleWeightSink, SinkCommit, SinkUnchanged, TensorLayout, WeightSink
from detached_rl.core.weight_sync import (
    KINDS,
    ApplyResult,
    Fetch,
    OffTrainerError,
    TensorEntry,
    TensorSpec,
    WeightManifest,
    WeightUpdate,
    WeightUpdateError,
    check_model_name,
    fingerprint_of_entries,
    parse_dtype,
    tensor_checksum,
    tensor_entries,
)

# Trainers push every `update_steps` steps; a push that skips more versions than this is no push of theirs.
DEFAULT_MAX_VERSION_JUMP = 1000
# The largest change an update of the followed run may make to a tensor, relative to the tensor: RMS of the
# change over the tensor's RMS (floored at `CHANGE_FLOOR_RMS`, so tensors that start at zero, as LoRA's B, can
# move). An optimizer step changes weights by about its learning rate; 10x the whole tensor is no training.
DEFAULT_MAX_WEIGHT_CHANGE = 10.0
CHANGE_FLOOR_RMS = 1e-2
# Float8 tensors have no min/max kernel: they are widened this many elements at a time to be checked.
_WIDEN_ELEMENTS = 2**22


@dataclass
class _Progress:
    bytes: int = 0
    chunks: int = 0
    checksum_seconds: float = 0.0

    def result(self, version: int, start: float, fetch_seconds: float | None, lock_wait: float, swap_start: float
               ) -> ApplyResult:
        """The `ApplyResult` of an applied update whose swap began at `swap_start` and ends now
        (`fetch_seconds=None`: fetching was the swap, as in place)."""
        end = time.perf_counter()
        fetch_seconds = end - swap_start if fetch_seconds is None else fetch_seconds
        return ApplyResult(applied=True, version=version, bytes=self.bytes, chunks=self.chunks,
                           fetch_seconds=fetch_seconds, checksum_seconds=self.checksum_seconds,
                           lock_wait_seconds=lock_wait, swap_seconds=end - swap_start, seconds=end - start)


@dataclass
class _Plan:
    """A validated update: target layout per name, tensors to expect per chunk, aliases per chunk."""

    layouts: dict[str, TensorLayout]
    by_chunk: list[list[TensorSpec]]
    aliases: list[list[TensorSpec]]
    models: set[str]
    covers_all: bool  # every key of every receiver model is in the update
    trainer_run: str | None = None  # the run the receiver follows once this update is applied
    reset: bool = False
    # Tensors served now, by model (filled on first use), when the update's change to them is bounded.
    served: dict[str, Mapping[str, Tensor]] | None = None

    @property
    def names(self) -> set[str]:
        """Qualified names of every tensor the update writes."""
        return set(self.layouts)


@dataclass
class _Staged:
    """A verified update waiting for a safe point: its tensors staged on the target devices."""

    manifest: WeightManifest
    plan: _Plan
    tensors: dict[str, dict[str, Tensor]]
    entries: dict[str, TensorEntry]
    fingerprint: str
    progress: _Progress
    start: float
    fetched: float


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
    `max_version_jump`: how far beyond the current version an update that is not a reset may go.
    `max_weight_change`: the largest relative change (RMS of the change over the tensor's RMS) an update
    that is not a reset may make to any floating tensor; None: unbounded.
    """

    def __init__(
        self,
        models: Mapping[str, nn.Module | WeightSink],
        cast_dtype: torch.dtype | None = None,
        mode: str = "staged",
        lock: threading.Lock | threading.RLock | None = None,
        version: int = 0,
        after_swap: Callable[[set[str]], None] | None = None,
        max_version_jump: int = DEFAULT_MAX_VERSION_JUMP,
        max_weight_change: float | None = DEFAULT_MAX_WEIGHT_CHANGE,
    ) -> None:
        if max_version_jump < 1:
            raise ValueError(f"max_version_jump must be >= 1, got {max_version_jump}")
        if max_weight_change is not None and not (max_weight_change > 0 and math.isfinite(max_weight_change)):
            raise ValueError(f"max_weight_change must be a positive finite number or None, got {max_weight_change}")
        if mode not in ("staged", "in_place"):
            raise ValueError(f"mode must be 'staged' or 'in_place', got {mode!r}")
        if cast_dtype is not None and not cast_dtype.is_floating_point:
            raise ValueError(f"cast_dtype must be a floating dtype, got {cast_dtype}")
        self.sinks: dict[str, WeightSink] = {}
        for name, model in models.items():
            check_model_name(name)
            if isinstance(model, nn.Module):
                self.sinks[name] = ModuleWeightSink(model)
            elif isinstance(model, WeightSink):
                self.sinks[name] = model
            else:
                raise TypeError(f"model {name!r} is a {type(model).__name__}, not a torch module or a WeightSink")
        self.models = dict(models)
        self.cast_dtype = cast_dtype
        self.mode = mode
        self.max_version_jump = max_version_jump
        self.max_weight_change = max_weight_change
        self.lock = lock if lock is not None else threading.Lock()
        # Called under the lock with the qualified names just written (e.g. re-merge LoRA weights).
        self.after_swap = after_swap
        self.last_error: WeightUpdateError | None = None
        self._version = version
        self.trainer_run: str | None = None  # the trainer run this receiver follows (see `_check_provenance`)
        self._dirty: set[str] = set()  # models left half-written by a failed update
        self._holds_trainer_weights = False  # an update was swapped in: later ones are bounded against it
        self._apply_lock = threading.Lock()  # one apply at a time
        # The verified update waiting for the next safe point (mode "staged"); swapped in under `lock`.
        self._pending: _Staged | None = None
        self._pending_lock = threading.Lock()
        self.received = 0  # updates verified and acknowledged
        self.swapped = 0  # of those, swapped in
        self.superseded = 0  # dropped unswapped for a newer one
        self.swap_failures = 0
        self.last_full_version: int | None = None  # version of the last full update swapped in
        # Runs of trainers this maker registered with while they had no weights to offer (a trainer that is
        # about to resume from a checkpoint): their first full update is taken as the registration's reset.
        self.registered_runs: set[str] = set()
        # Guards the weights against the lazy fingerprint computation. Lock order: `lock`, then this.
        self._state_lock = threading.Lock()
        self._entries: dict[str, TensorEntry] | None = None
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
            self._fingerprint = fingerprint_of_entries(self._current_entries())
            return self._fingerprint

    def _current_entries(self) -> dict[str, TensorEntry]:
        """Per-tensor entries of the current weights (computed on first use); hold `_state_lock`."""
        if self._entries is None:
            self._entries = tensor_entries({name: sink.state() for name, sink in self.sinks.items()})
        return self._entries

    def apply(self, update: WeightUpdate, fetch: Fetch, timeout: float | None = None, reset: bool = False
              ) -> ApplyResult:
        """Apply `update`, pulling its chunks with `fetch`, and swap it in before returning; raise
        `WeightUpdateError` if refused.

        `timeout` bounds the whole update (fetches and waiting for the lock). `fetch` itself is
        not interrupted: give it its own timeout (e.g. `ray.get(ref, timeout=...)`). `reset`: an
        explicit reset (the maker registered with its trainers and takes what they offer): the
        update may come from another trainer run (a full update then) and go back or jump ahead
        any number of versions; the receiver follows its run from then on.
        """
        return self._guarded(update, fetch, timeout, reset, wait_for_swap=True)

    def receive(self, update: WeightUpdate, fetch: Fetch, timeout: float | None = None, reset: bool = False
                ) -> ApplyResult:
        """Pull and verify `update`, then acknowledge it without waiting for generation to pause.

        Mode "staged": the verified update waits (`ApplyResult.staged`) for the next safe point,
        `swap_pending` under the generation lock, unless the lock is free now (no batch is being
        generated), in which case it is swapped at once. A newer update received before then
        supersedes the waiting one (counted in `superseded`): only the newest is swapped in. Mode
        "in_place" cannot stage; there `receive` is `apply`.
        """
        return self._guarded(update, fetch, timeout, reset, wait_for_swap=self.mode != "staged")

    def _guarded(self, update: WeightUpdate, fetch: Fetch, timeout: float | None, reset: bool, wait_for_swap: bool
                 ) -> ApplyResult:
        with self._apply_lock:
            try:
                result = self._apply(update, fetch, timeout, reset, wait_for_swap)
            except WeightUpdateError as error:
                self.last_error = error
                raise
            self.last_error = None
            return result

    def _apply(self, update: WeightUpdate, fetch: Fetch, timeout: float | None, reset: bool, wait_for_swap: bool
               ) -> ApplyResult:
        start = time.perf_counter()
        manifest = update.manifest
        version = manifest.version
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise WeightUpdateError(f"version must be a non-negative integer, got {version!r}")
        run = manifest.metadata.get("trainer_run")
        if run is not None and run in self.registered_runs and run != self._followed_run:
            reset = True  # the first update of a trainer run this maker registered with before it had weights
        if self._check_provenance(manifest, reset):
            return ApplyResult(applied=False, version=manifest.version, reason="same version")
        plan = self._validate(update)
        plan.trainer_run = manifest.metadata.get("trainer_run") if reset else (
            manifest.metadata.get("trainer_run") or self._followed_run)
        plan.reset = reset
        if self.max_weight_change is not None and not reset and self._holds_trainer_weights and not self._dirty:
            plan.served = {}  # an update of the run this maker follows: bounded against what it serves
        deadline = None if timeout is None else start + timeout
        if self.mode == "in_place":
            return self._apply_in_place(update, plan, fetch, start, deadline)
        with self._pending_lock:
            pending = self._pending
        if pending is not None and not plan.names >= pending.plan.names:
            # The waiting update writes tensors this one does not (a full update, then a LoRA-only one):
            # dropping it would lose them, so it is swapped in first.
            self._swap_now(deadline, manifest.version)
        staged = self._stage(update, plan, fetch, start, deadline)
        with self._pending_lock:
            if self._pending is not None:
                self.superseded += 1
            self._pending = staged
        self.received += 1
        if wait_for_swap:
            return self._swap_now(deadline, manifest.version) or ApplyResult(
                applied=False, version=manifest.version, reason="superseded")
        swapped = self._swap_if_idle(raise_errors=True)
        if swapped is False:  # a batch is being generated: it swaps at its end
            return ApplyResult(applied=False, staged=True, version=manifest.version, bytes=staged.progress.bytes,
                               chunks=staged.progress.chunks, fetch_seconds=staged.fetched - start,
                               checksum_seconds=staged.progress.checksum_seconds,
                               seconds=time.perf_counter() - start)
        return swapped or ApplyResult(applied=False, version=manifest.version, reason="superseded")

    def _swap_if_idle(self, raise_errors: bool = False) -> ApplyResult | None | bool:
        """Swap the waiting update in if the generation lock is free now; False if a batch holds it."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            return self.swap_pending(raise_errors)
        finally:
            self.lock.release()

    @property
    def _followed_run(self) -> str | None:
        """The trainer run of the newest update received (waiting or swapped in)."""
        pending = self._pending
        return pending.plan.trainer_run if pending is not None else self.trainer_run

    @property
    def pending_version(self) -> int | None:
        """Version of the verified update waiting for the next safe point, or None."""
        pending = self._pending
        return None if pending is None else pending.manifest.version

    @property
    def pending_kind(self) -> str | None:
        """Kind ("full", "lora") of the update waiting for the next safe point, or None."""
        pending = self._pending
        return None if pending is None else pending.manifest.kind

    def flush(self, timeout: float | None = None) -> ApplyResult | None:
        """Swap the waiting update in now, waiting up to `timeout` s for the generation lock; None if none waits."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._apply_lock:
            version = self.pending_version
            return None if version is None else self._swap_now(deadline, version)

    def _swap_now(self, deadline: float | None, version: int) -> ApplyResult | None:
        """Take the generation lock (within the deadline) and swap the waiting update in."""
        lock_wait = self._acquire(deadline, version)
        try:
            result = self.swap_pending(raise_errors=True)
        finally:
            self.lock.release()
        return None if result is None else dataclasses.replace(result, lock_wait_seconds=lock_wait)

    def swap_pending(self, raise_errors: bool = False) -> ApplyResult | None:
        """Swap the waiting update in; the caller holds the generation lock (a safe point). None if none waits.

        A failed swap is recorded in `last_error` and `swap_failures` (and raised with `raise_errors`).
        """
        with self._pending_lock:
            staged, self._pending = self._pending, None
        if staged is None:
            return None
        try:
            result = self._swap(staged)
        except WeightUpdateError as error:
            self.swap_failures += 1
            self.last_error = error
            if raise_errors:
                raise
            return None
        self.swapped += 1
        return result

    @contextmanager
    def serving(self) -> Iterator[int]:
        """Hold the generation lock for one batch; swap a waiting update in before and after it; yields the
        version the batch is generated with (raises `WeightUpdateError` while not `consistent`)."""
        with self.lock:
            self.swap_pending()
            try:
                yield self.servable_version
            finally:
                self.swap_pending()
        # An update staged after the swap above whose `receive` found the lock still held: nobody else
        # would swap it in before the next batch (and there may be none, e.g. the maker is being stopped).
        if self._pending is not None:
            self._swap_if_idle()

    def _check_provenance(self, manifest: WeightManifest, reset: bool) -> bool:
        """Refuse an update from another trainer run, a rollback or a jump (unless `reset`); True: nothing to do.

        Compared with the newest update received: the one waiting for a safe point, else the one served.
        """
        version, run, followed = manifest.version, manifest.metadata.get("trainer_run"), self._followed_run
        pending = self.pending_version
        newest = self._version if pending is None else pending
        v = f"v{version}"
        other_run = followed is not None and run != followed
        if other_run and not reset:
            raise OffTrainerError(
                f"{v}: trainer_run {run!r} is not the trainer run this maker follows ({followed!r}); "
                "only an explicit reset (registering with the trainer again) changes it"
            )
        if other_run and manifest.kind != "full":
            # A LoRA update assumes the adapter and base it was computed against: a new run starts with a full one.
            raise OffTrainerError(f"{v}: a {manifest.kind} update from a new trainer run {run!r} "
                                    f"(this maker follows {followed!r}) needs a full update first")
        if version == newest and not self._dirty and not other_run:
            return True
        if reset or (self._dirty and manifest.kind == "full"):
            return False  # half-written models serve nothing: any full update of the run may repair them
        if version < newest:
            what = "current" if pending is None else "received"
            raise OffTrainerError(f"stale version {version} < {what} {newest} "
                                    "(a rollback needs an explicit reset)")
        if newest >= 0 and version - newest > self.max_version_jump:
            raise OffTrainerError(
                f"{v}: version {version} jumps {version - newest} beyond current {newest} "
                f"(max_version_jump {self.max_version_jump}); a jump that large needs an explicit reset"
            )
        return False

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
            dtype = parse_dtype(spec.dtype)
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
        for model_name in sorted(named):
            # Optional sink hook: what the tensors cannot show (e.g. a LoRA update's alpha) is checked here.
            check_update = getattr(self.sinks[model_name], "check_update", None)
            if check_update is not None:
                try:
                    check_update(manifest.kind, manifest.metadata)
                except Exception as error:
                    raise WeightUpdateError(f"{v}: model {model_name!r}: {error}") from error
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
            target = plan.layouts[spec.name].dtype
            if not _finite_in(tensor, target):
                raise WeightUpdateError(f"{where}: tensor {spec.name!r} holds NaN or Inf"
                                        + ("" if str(target) == spec.dtype else f" or values beyond {target}"))
            if plan.served is not None:
                self._check_change(where, spec, tensor, plan.served)
            progress.bytes += spec.nbytes
        progress.chunks += 1
        return chunk

    def _check_change(self, where: str, spec: TensorSpec, tensor: Tensor,
                      served: dict[str, Mapping[str, Tensor]]) -> None:
        """Refuse a tensor that changes what is served by more than `max_weight_change` (relative RMS)."""
        model_name, _, key = spec.name.partition("/")
        if model_name not in served:
            served[model_name] = self.sinks[model_name].state()
        current = served[model_name].get(key)
        if current is None or not tensor.is_floating_point() or not current.is_floating_point():
            return
        change = relative_change(tensor, current)
        if change > self.max_weight_change:
            raise WeightUpdateError(
                f"{where}: tensor {spec.name!r} would change by {change:.3g}x its size (relative RMS), over "
                f"max_weight_change {self.max_weight_change:g}: no optimizer step does that"
            )

    def _acquire(self, deadline: float | None, version: int) -> float:
        """Take the generation lock within the deadline; return the seconds waited."""
        wait_start = time.perf_counter()
        remaining = -1 if deadline is None else max(0.0, deadline - wait_start)
        if not self.lock.acquire(timeout=remaining):
            raise WeightUpdateError(f"v{version}: timed out waiting for the generation lock")
        return time.perf_counter() - wait_start

    def _stage(self, update: WeightUpdate, plan: _Plan, fetch: Fetch, start: float, deadline: float | None
               ) -> _Staged:
        """Fetch, verify and stage every chunk (on the target devices) and work out the new fingerprint."""
        manifest = update.manifest
        progress = _Progress()
        tensors: dict[str, dict[str, Tensor]] = {}  # model -> key -> staged tensor
        for index in range(manifest.num_chunks):
            chunk = self._receive(update, index, fetch, plan, deadline, progress)
            for model_name, by_key in _by_model(plan, index, chunk).items():
                tensors.setdefault(model_name, {}).update(self.sinks[model_name].stage(by_key))
        # Entries of the tensors this update leaves alone are those served now: an update only ever
        # supersedes a waiting one that writes a subset of its tensors, so those are not in flux.
        with self._state_lock:
            entries = {} if plan.covers_all else dict(self._current_entries())
        for spec in manifest.tensors:
            model_name, _, key = spec.name.partition("/")
            entries[spec.name] = self._entry(spec, plan.layouts[spec.name], tensors[model_name][key])
        return _Staged(manifest, plan, tensors, entries, fingerprint_of_entries(entries), progress, start,
                       time.perf_counter())

    def _swap(self, staged: _Staged) -> ApplyResult:
        """Write a staged update into the models; the caller holds the generation lock."""
        manifest, plan = staged.manifest, staged.plan
        swap_start = time.perf_counter()
        with self._state_lock, torch.no_grad():
            try:
                for model_name, tensors in staged.tensors.items():
                    self.sinks[model_name].write(tensors)
                self._commit(manifest)
            except Exception as error:
                if not _left_unchanged(error, plan):
                    self._mark_dirty(plan)
                    self._entries = self._fingerprint = None
                raise WeightUpdateError(f"v{manifest.version}: swap failed: {error}") from error
            self._follow(manifest.version, plan)
            self._entries, self._fingerprint = staged.entries, staged.fingerprint
            if manifest.kind == "full":
                self._dirty -= plan.models
                self.last_full_version = manifest.version
        return staged.progress.result(manifest.version, staged.start, staged.fetched - staged.start, 0.0, swap_start)

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
                    if _left_unchanged(error, plan):
                        self._entries = self._fingerprint = None  # `entries` took the refused chunks: recompute
                    else:
                        if written:
                            self._mark_dirty(plan)
                        if entries is not None:
                            self._fingerprint = fingerprint_of_entries(entries)
                    if isinstance(error, WeightUpdateError):
                        raise
                    raise WeightUpdateError(
                        f"v{manifest.version}: in-place update failed: {error}"
                    ) from error
                self._follow(manifest.version, plan)
                if manifest.kind == "full":
                    self._dirty -= plan.models
                    self.last_full_version = manifest.version
                self._fingerprint = None if entries is None else fingerprint_of_entries(entries)
        finally:
            self.lock.release()
        # In place, fetching and swapping are one pass under the lock.
        return progress.result(manifest.version, start, None, lock_wait, swap_start)

    def _follow(self, version: int, plan: _Plan) -> None:
        """Serve `version` of the plan's run; a reset ends every earlier registration's claim to one."""
        self._version = version
        self.trainer_run = plan.trainer_run
        self._holds_trainer_weights = True
        if plan.reset:
            self.registered_runs.clear()

    def _mark_dirty(self, plan: _Plan) -> None:
        """Record models left half-written; after a reset, they belong to the run it was resetting to."""
        self._dirty |= plan.models
        if plan.reset:  # the old run's weights are partly gone: its repair is a full update of the new run
            self.trainer_run = plan.trainer_run

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
    def _entry(spec: TensorSpec, layout: TensorLayout, tensor: Tensor) -> TensorEntry:
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


def _left_unchanged(error: Exception, plan: _Plan) -> bool:
    """True when the one model the update named put everything back (`SinkUnchanged`): nothing is half-written."""
    return isinstance(error, SinkUnchanged) and len(plan.models) == 1


def _finite_in(tensor: Tensor, stored: torch.dtype) -> bool:
    """False if `tensor` holds NaN or Inf, or a value beyond the largest of `stored` (the dtype it is kept in).

    One min/max pass (as fast as the checksum; `isfinite` is ~20x slower on CPU): NaN propagates into
    both, an infinity becomes one of them.
    """
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.dtype.itemsize == 1:  # float8: widened (exactly) a slice at a time
        flat = tensor.reshape(-1)
        return all(_finite_in(flat[i:i + _WIDEN_ELEMENTS].float(), stored)
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


def _check_deadline(deadline: float | None, message: str) -> None:
    if deadline is not None and time.perf_counter() > deadline:
        raise WeightUpdateError(message)
