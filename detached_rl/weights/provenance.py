"""Where a maker's weights may come from: one trainer run, forward by bounded steps, unless reset.

A `WeightReceiver` follows one trainer run (the `trainer_run` of the first update it takes with a run
id). Updates of that run move it forward by at most `max_version_jump` versions; another run, a
rollback or a bigger jump is taken only as an explicit reset (what a maker does when it registers
with its trainers); a reset may be LoRA-only when the maker proves it holds the base. These
refusals are `OffTrainerError`s: registering again fixes them.
"""

from __future__ import annotations

from detached_rl.weights.update import OffTrainerError, WeightManifest, WeightUpdateError


def check_version(version: object) -> int:
    """`version` if it is a non-negative integer; `WeightUpdateError` otherwise."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise WeightUpdateError(f"version must be a non-negative integer, got {version!r}")
    return version


def check_provenance(manifest: WeightManifest, *, reset: bool, followed: str | None, newest: int,
                     waiting: bool, dirty: bool, max_version_jump: int) -> bool:
    """Refuse an update from another trainer run, a rollback or a jump (unless `reset`); True: nothing to do.

    `followed` and `newest` are the run and version of the newest update received: the one `waiting` for a
    safe point, else the one served. `dirty`: a failed in-place update left some model half-written.
    """
    version, run = manifest.version, manifest.metadata.get("trainer_run")
    v = f"v{version}"
    other_run = followed is not None and run != followed
    if other_run and not reset:
        raise OffTrainerError(
            f"{v}: trainer_run {run!r} is not the trainer run this maker follows ({followed!r}); "
            "only an explicit reset (registering with the trainer again) changes it"
        )
    # A LoRA update of a new run (a reset) is complete only with the base it was computed against: the
    # receiver checks that (`weight_verify.check_complete`, the base fingerprint) before fetching anything.
    if version == newest and not dirty and not other_run:
        return True
    if reset or (dirty and manifest.kind == "full"):
        return False  # half-written models serve nothing: any full update of the run may repair them
    if version < newest:
        what = "received" if waiting else "current"
        raise OffTrainerError(f"stale version {version} < {what} {newest} "
                              "(a rollback needs an explicit reset)")
    if newest >= 0 and version - newest > max_version_jump:
        raise OffTrainerError(
            f"{v}: version {version} jumps {version - newest} beyond current {newest} "
            f"(max_version_jump {max_version_jump}); a jump that large needs an explicit reset"
        )
    return False
