"""`WeightReceiver`: a maker's side of the weight-update protocol (`weights.update`).

One way in, `receive`: it checks where a `WeightUpdate` comes from (`weights.provenance`), checks
its manifest against its models' `WeightSink`s, pulls the chunks one at a time and verifies them
(`weights.verify`), and then has the sinks swap the new weights in under the generation lock,
`now` or at the next safe point. One safe point, `serving`: generation holds the lock per batch
through it, and waiting updates are swapped in just before and just after. A refused update changes
nothing; the previous version keeps serving.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from detached_rl.core.limits import DEFAULT_MAX_VERSION_JUMP, DEFAULT_MAX_WEIGHT_CHANGE
from detached_rl.weights.encoding import base_lookup, check_delta_base, widest_stored_dtype
from detached_rl.weights.provenance import check_provenance, check_version
from detached_rl.weights.sink import WeightSink, commit_update, left_unchanged, sinks_of
from detached_rl.weights.update import (
    ApplyResult,
    Fetch,
    TensorEntry,
    WeightManifest,
    WeightUpdate,
    WeightUpdateError,
    fingerprint_of_entries,
    tensor_entries,
)
from detached_rl.weights.verify import (
    Progress,
    StagedUpdate,
    UpdatePlan,
    check_complete,
    check_receiver_settings,
    check_sinks,
    fetch_and_stage,
    plan_update,
    stored_entry,
    write_in_place,
)

__all__ = ["DEFAULT_MAX_VERSION_JUMP", "DEFAULT_MAX_WEIGHT_CHANGE", "SWAPS", "WeightReceiver"]

# When `receive` swaps a verified update in: "now" (waits for the generation lock), or "at_safe_point" (the
# next `serving` boundary, at once if no batch is being generated; the caller does not wait for a batch).
SWAPS = ("now", "at_safe_point")


class WeightReceiver:
    """Maker side: takes `WeightUpdate`s for named models (`receive`), swapped in at safe points (`serving`).

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
    that is not a reset may make to any floating tensor; None: unbounded. `version` and `trainer_run`: what
    the weights it starts with are (None: no run yet; the first update that names one sets it).
    `lock_timeout`: the longest wait for the generation lock (None: `receive`'s timeout only).
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
        trainer_run: str | None = None,
        lock_timeout: float | None = None,
    ) -> None:
        check_receiver_settings(mode, cast_dtype, max_version_jump, max_weight_change)
        self.sinks = sinks_of(models)
        self.models = dict(models)
        self.cast_dtype = cast_dtype
        self.mode = mode
        self.max_version_jump = max_version_jump
        self.max_weight_change = max_weight_change
        self.lock = lock if lock is not None else threading.Lock()
        # Bounds each wait for the generation lock from its start (a `receive` timeout bounds the whole
        # update; a progress-based fetch has none).
        self.lock_timeout = lock_timeout
        # Called under the lock with the qualified names just written (e.g. re-merge LoRA weights).
        self.after_swap = after_swap
        self.last_error: WeightUpdateError | None = None
        self._version = version
        self._trainer_run = trainer_run  # the trainer run this receiver follows (`weights.provenance`)
        self._dirty: set[str] = set()  # models left half-written by a failed update
        self._holds_trainer_weights = False  # an update was swapped in: later ones are bounded against it
        self._receive_lock = threading.Lock()  # one update received at a time
        # The verified update waiting for the next safe point (mode "staged"); swapped in under `lock`.
        self._pending: StagedUpdate | None = None
        self._pending_lock = threading.Lock()
        self.received = 0  # updates verified and acknowledged
        self.swapped = 0  # of those, swapped in
        self.superseded = 0  # dropped unswapped for a newer one
        self.swap_failures = 0
        self.last_full_version: int | None = None  # version of the last full update swapped in
        # Runs of trainers this maker registered with while they had no weights to offer (a trainer that is
        # about to resume from a checkpoint): their first full update is taken as the registration's reset.
        self._expected_runs: set[str] = set()
        # Guards the weights against the lazy fingerprint computation. Lock order: `lock`, then this.
        self._state_lock = threading.Lock()
        self._entries: dict[str, TensorEntry] | None = None
        self._fingerprint: str | None = None

    @property
    def version(self) -> int:
        """Version of the last update applied in full (see `consistent`)."""
        return self._version

    @property
    def trainer_run(self) -> str | None:
        """The trainer run this receiver follows (None until it takes an update that names one)."""
        return self._trainer_run

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
    def pending_version(self) -> int | None:
        """Version of the verified update waiting for the next safe point, or None."""
        pending = self._pending
        return None if pending is None else pending.manifest.version

    def expect_runs(self, runs: Iterable[str | None]) -> None:
        """Registered with trainers of these runs that had no weights yet: their first update is a reset."""
        self._expected_runs.update(run for run in runs if run is not None)

    @property
    def serving_dtype(self) -> str | None:
        """The dtype a trainer may send this receiver's floating tensors in ("bfloat16"): the widest floating
        dtype its models store, when it casts incoming weights (`cast_dtype`); None when it does not."""
        return None if self.cast_dtype is None else widest_stored_dtype(self.sinks)

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

    def receive(self, update: WeightUpdate, fetch: Fetch, *, timeout: float | None = None,
                reset: bool = False, swap: str = "now") -> ApplyResult:
        """The one way in: check `update`, pull its chunks with `fetch`, verify them, swap it in per `swap`.

        Raises `WeightUpdateError` (`OffTrainerError` where registering again fixes it) if refused; then
        nothing changed. `swap` "now": swapped in before returning (waits for the generation lock).
        "at_safe_point" (mode "staged"): acknowledged once verified (`ApplyResult.staged`) and swapped in at
        the next `serving` boundary, or at once if no batch holds the lock; a newer update received before
        then supersedes it (`superseded`), unless it writes fewer tensors (a LoRA update behind a full one):
        then the waiting one is swapped in first, and the newer one checked against it. Mode "in_place"
        always swaps now. `timeout` bounds the whole update (fetches and waiting for the lock); `fetch`
        itself is not interrupted: give it its own deadline (a maker's is progress-based, so it passes no
        `timeout` and bounds the lock waits with `lock_timeout`). `reset`: an
        explicit reset (the maker registered with its trainers and takes what they offer): the update may
        come from another trainer run (a full update then) and go back or jump ahead any number of versions;
        the receiver follows its run from then on.
        """
        if swap not in SWAPS:
            raise ValueError(f"swap must be one of {SWAPS}, got {swap!r}")
        with self._receive_lock:
            try:
                result = self._receive(update, fetch, timeout, reset, wait_for_swap=swap == "now")
            except WeightUpdateError as error:
                self.last_error = error
                raise
            self.last_error = None
            return result

    @contextmanager
    def serving(self) -> Iterator[int]:
        """The one safe point: hold the generation lock for one batch; yields the version it is generated
        with.

        A waiting update is swapped in before and after the batch; `WeightUpdateError` while not `consistent`.
        """
        with self.lock:
            self._swap_pending()
            try:
                yield self.servable_version
            finally:
                self._swap_pending()
        # An update staged after the swap above whose `receive` found the lock still held: nobody else
        # would swap it in before the next batch (and there may be none, e.g. the maker is being stopped).
        if self._pending is not None:
            self._swap_if_idle()

    def _receive(self, update: WeightUpdate, fetch: Fetch, timeout: float | None, reset: bool,
                 wait_for_swap: bool) -> ApplyResult:
        start = time.perf_counter()
        manifest = update.manifest
        version = check_version(manifest.version)
        run = manifest.metadata.get("trainer_run")
        if run is not None and run in self._expected_runs and run != self._followed_run:
            reset = True  # the first update of a trainer run this maker registered with before it had weights
        pending = self.pending_version
        if check_provenance(manifest, reset=reset, followed=self._followed_run,
                            newest=self._version if pending is None else pending, waiting=pending is not None,
                            dirty=bool(self._dirty), max_version_jump=self.max_version_jump):
            return ApplyResult(applied=False, version=version, reason="same version")
        plan = plan_update(update, self.sinks, self.cast_dtype)
        plan.trainer_run = run if reset else (run or self._followed_run)
        plan.reset = reset
        deadline = None if timeout is None else start + timeout
        with self._pending_lock:
            waiting = self._pending
        if waiting is not None and not plan.names >= waiting.plan.names:
            # The waiting update writes tensors this one does not (a full update, then a LoRA-only one):
            # dropping it would lose them, and this one is checked against what it leaves (a LoRA update's
            # base), so it is swapped in first.
            self._swap_now(deadline, version)
        if manifest.kind == "delta":
            plan.base = self._delta_base(manifest, plan)
        check_sinks(manifest, plan, self.sinks)  # a LoRA update's config and base (fingerprint), if named
        if reset or self._version < 0 or self._dirty:
            check_complete(manifest, plan, self.sinks)  # a start from a LoRA update: all but the proven base
            plan.complete = True
        if self.max_weight_change is not None and not reset and self._holds_trainer_weights \
                and not self._dirty:
            plan.served = {}  # an update of the run this maker follows: bounded against what it serves
        if self.mode == "in_place":
            return self._apply_in_place(update, plan, fetch, start, deadline)
        staged = self._stage(update, plan, fetch, start, deadline)
        with self._pending_lock:
            if self._pending is not None:
                self.superseded += 1
            self._pending = staged
        self.received += 1
        if wait_for_swap:
            try:
                return self._swap_now(deadline, version) or ApplyResult(
                    applied=False, version=version, reason="superseded")
            except WeightUpdateError:
                with self._pending_lock:  # refused: it is not swapped in later either
                    if self._pending is staged:
                        self._pending = None
                raise
        swapped = self._swap_if_idle(raise_errors=True)
        if swapped is False:  # a batch is being generated: it swaps at its end
            return staged.acknowledgement()
        return swapped or ApplyResult(applied=False, version=version, reason="superseded")

    def _delta_base(self, manifest: WeightManifest, plan: UpdatePlan) -> Callable[[str], Tensor]:
        """Where a delta's base tensors are: the waiting update's (it supersedes it), or with none waiting
        the served ones; `OffTrainerError` (before anything is fetched) if that is not the delta's base."""
        with self._pending_lock:
            waiting = self._pending
        if waiting is not None:
            check_delta_base(manifest, waiting.entries, waiting.manifest.version, plan.names)
            return base_lookup(waiting.tensors, self.sinks)
        with self._state_lock:
            entries = None if self._dirty else dict(self._current_entries())
        check_delta_base(manifest, entries, self._version, plan.names)
        return base_lookup({}, self.sinks)

    @property
    def _followed_run(self) -> str | None:
        """The trainer run of the newest update received (waiting or swapped in)."""
        pending = self._pending
        return pending.plan.trainer_run if pending is not None else self._trainer_run

    def _swap_if_idle(self, raise_errors: bool = False) -> ApplyResult | None | bool:
        """Swap the waiting update in if the generation lock is free now; False if a batch holds it."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            return self._swap_pending(raise_errors)
        finally:
            self.lock.release()

    def _swap_now(self, deadline: float | None, version: int) -> ApplyResult | None:
        """Take the generation lock (within the deadline) and swap the waiting update in."""
        lock_wait = self._acquire(deadline, version)
        try:
            result = self._swap_pending(raise_errors=True)
        finally:
            self.lock.release()
        return None if result is None else dataclasses.replace(result, lock_wait_seconds=lock_wait)

    def _swap_pending(self, raise_errors: bool = False) -> ApplyResult | None:
        """Swap the waiting update in; the caller holds the generation lock (a safe point); None: none waits.

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

    def _acquire(self, deadline: float | None, version: int) -> float:
        """Take the generation lock within the deadline; return the seconds waited."""
        wait_start = time.perf_counter()
        bounds = [] if deadline is None else [max(0.0, deadline - wait_start)]
        bounds += [] if self.lock_timeout is None else [self.lock_timeout]
        if not self.lock.acquire(timeout=min(bounds, default=-1)):
            raise WeightUpdateError(f"v{version}: timed out waiting for the generation lock")
        return time.perf_counter() - wait_start

    def _stage(self, update: WeightUpdate, plan: UpdatePlan, fetch: Fetch, start: float,
               deadline: float | None) -> StagedUpdate:
        """Fetch, verify and stage every chunk (on the target devices) and work out the new fingerprint."""
        manifest = update.manifest
        progress = Progress()
        tensors = fetch_and_stage(update, plan, fetch, deadline, progress, self.sinks, self.max_weight_change)
        # Entries of the tensors this update leaves alone are those served now: an update only ever
        # supersedes a waiting one that writes a subset of its tensors, so those are not in flux.
        with self._state_lock:
            entries = {} if plan.covers_all else dict(self._current_entries())
        for spec in manifest.tensors:
            model_name, _, key = spec.name.partition("/")
            entries[spec.name] = stored_entry(spec, plan.layouts[spec.name], tensors[model_name][key])
        return StagedUpdate(manifest, plan, tensors, entries, fingerprint_of_entries(entries), progress,
                            start, time.perf_counter())

    def _swap(self, staged: StagedUpdate) -> ApplyResult:
        """Write a staged update into the models; the caller holds the generation lock."""
        manifest, plan = staged.manifest, staged.plan
        swap_start = time.perf_counter()
        with self._state_lock, torch.no_grad():
            try:
                for model_name, tensors in staged.tensors.items():
                    self.sinks[model_name].write(tensors)
                self._commit(manifest)
            except Exception as error:
                if not left_unchanged(error, plan.models):
                    self._mark_dirty(plan)
                    self._entries = self._fingerprint = None
                raise WeightUpdateError(f"v{manifest.version}: swap failed: {error}") from error
            self._follow(manifest, plan)
            self._entries, self._fingerprint = staged.entries, staged.fingerprint
        return staged.progress.result(manifest.version, staged.start, staged.fetched - staged.start, 0.0,
                                      swap_start)

    def _apply_in_place(
        self, update: WeightUpdate, plan: UpdatePlan, fetch: Fetch, start: float, deadline: float | None
    ) -> ApplyResult:
        manifest = update.manifest
        progress = Progress()
        lock_wait = self._acquire(deadline, manifest.version)
        swap_start = time.perf_counter()
        try:
            with self._state_lock, torch.no_grad():
                entries = self._entries
                try:
                    write_in_place(update, plan, fetch, deadline, progress, self.sinks,
                                   self.max_weight_change, entries)
                    self._commit(manifest)
                except Exception as error:
                    if left_unchanged(error, plan.models):
                        # `entries` took the refused chunks: recompute
                        self._entries = self._fingerprint = None
                    else:
                        if progress.chunks:  # a chunk was verified, so its writes began
                            self._mark_dirty(plan)
                        if entries is not None:
                            self._fingerprint = fingerprint_of_entries(entries)
                    if isinstance(error, WeightUpdateError):
                        raise
                    raise WeightUpdateError(f"v{update.version}: in-place update failed: {error}") from error
                self._follow(manifest, plan)
                self._fingerprint = None if entries is None else fingerprint_of_entries(entries)
        finally:
            self.lock.release()
        # In place, fetching and swapping are one pass under the lock.
        return progress.result(manifest.version, start, None, lock_wait, swap_start)

    def _follow(self, manifest: WeightManifest, plan: UpdatePlan) -> None:
        """Serve the update's version of the plan's run (whole again where it was complete); a reset ends
        every earlier registration's claim to one."""
        if plan.complete:
            self._dirty -= plan.models
        if manifest.kind in ("full", "delta"):
            self.last_full_version = manifest.version
        self._version = manifest.version
        self._trainer_run = plan.trainer_run
        self._holds_trainer_weights = True
        if plan.reset:
            self._expected_runs.clear()

    def _mark_dirty(self, plan: UpdatePlan) -> None:
        """Record models left half-written; after a reset, they belong to the run it was resetting to."""
        self._dirty |= plan.models
        if plan.reset:  # the old run's weights are partly gone: its repair is a full update of the new run
            self._trainer_run = plan.trainer_run

    def _commit(self, manifest: WeightManifest) -> None:
        """Tell each sink its part of the update is written, then run `after_swap` (under the lock)."""
        commit_update(self.sinks, manifest)
        if self.after_swap is not None:
            self.after_swap({spec.name for spec in manifest.tensors})
