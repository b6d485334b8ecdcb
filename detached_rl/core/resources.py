"""Checks of the Ray resources a config asks for, how `run` shares GPUs, and which
device an actor uses (Ray-free)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Ray counts fractions of a resource in units of 1/10000 and places a GPU fraction only on one GPU.
RESOURCE_PRECISION = 1e-4
_TOLERANCE = 1e-9


class UnplaceableError(RuntimeError):
    """The cluster can never place what a command asks for; the message names the role and the resources."""


def check_resources(resources: Any, where: str) -> None:
    """Refuse custom resources that are not a mapping of names to amounts > 0, naming `where`."""
    if not isinstance(resources, dict):
        raise ValueError(f"{where} must be a mapping of resource names to amounts, got {resources!r}")
    for key, amount in resources.items():
        if (not isinstance(key, str) or isinstance(amount, bool) or not isinstance(amount, int | float)
                or amount <= 0):
            raise ValueError(f"{where}: {key!r} must map to a number > 0, got {amount!r}")
        if key in ("CPU", "GPU", "memory"):
            raise ValueError(f"{where}: {key!r} is not a custom resource (set the CPU/GPU counts instead)")


def check_amount(amount: Any, where: str, gpu: bool = False) -> None:
    """Refuse a CPU or GPU count Ray cannot take, naming `where`: not a number >= 0, finer than 1/10000, or
    (`gpu`) a fraction above 1 (Ray places a GPU fraction on one GPU: 0.5 or 2, never 1.5)."""
    if (isinstance(amount, bool) or not isinstance(amount, int | float) or not math.isfinite(amount)
            or amount < 0):
        raise ValueError(f"{where} must be a number >= 0, got {amount!r}")
    if 0 < amount < RESOURCE_PRECISION:
        raise ValueError(f"{where} must be 0 or at least {RESOURCE_PRECISION:g} (Ray's precision), "
                         f"got {amount!r}")
    if gpu and amount > 1 and amount != int(amount):
        raise ValueError(f"{where} must be a fraction up to 1 or a whole number of GPUs, got {amount!r}")


def resource_request(num_cpus: float, num_gpus: float, resources: Mapping[str, float] | None = None
                     ) -> dict[str, float]:
    """What one actor asks Ray for, as Ray names it ({"CPU": …, "GPU": …, custom…}); zero amounts left out."""
    request = {"CPU": float(num_cpus), "GPU": float(num_gpus),
               **{k: float(v) for k, v in (resources or {}).items()}}
    return {key: amount for key, amount in request.items() if amount > 0}


def describe(request: Mapping[str, float]) -> str:
    """A request as text: "1 GPU, 0.5 CPU" ("no resources" when empty)."""
    return ", ".join(f"{amount:g} {key}" for key, amount in request.items()) or "no resources"


def unplaceable(requests: Mapping[str, Mapping[str, float]], cluster: Mapping[str, float]) -> str | None:
    """Why the actors `requests` (label, e.g. "maker run-maker-0" -> resources) can never all be placed on a
    cluster whose total resources are `cluster` (`ray.cluster_resources()`), or None when they can be.

    One actor that asks for more of a resource than the whole cluster has is named first; then the
    sum of all of them. Whether free resources suffice now is not judged here: busy clusters free up.
    """
    for label, request in requests.items():
        for key, amount in request.items():
            have = float(cluster.get(key, 0.0))
            if amount > have + _TOLERANCE:
                return f"{label} asks for {amount:g} {key}; the cluster has {have:g}"
    totals: dict[str, float] = {}
    for request in requests.values():
        for key, amount in request.items():
            totals[key] = totals.get(key, 0.0) + amount
    for key, total in totals.items():
        have = float(cluster.get(key, 0.0))
        if total > have + _TOLERANCE:
            askers = [label for label, request in requests.items() if request.get(key, 0) > 0]
            return f"{', '.join(askers)} ask for {total:g} {key} together; the cluster has {have:g}"
    return None


def gpu_shares(cluster_gpus: float, makers: int, trainer_share: float = 0.5) -> tuple[float, float]:
    """GPUs for one trainer and for each of `makers` makers on a cluster with `cluster_gpus` GPUs: (trainer,
    per maker).

    No GPU: (0, 0). One GPU: the trainer takes `trainer_share` of it and the makers split the
    rest. More: the trainer takes one GPU and the makers share the others, each GPU holding the
    same number of makers (so every share packs onto a GPU: Ray places a fraction on one GPU).
    Shares are rounded down to Ray's precision of 1/10000.
    """
    if isinstance(makers, bool) or not isinstance(makers, int) or makers < 1:
        raise ValueError(f"gpu_shares: makers must be an int >= 1, got {makers!r}")
    if not 0 < trainer_share < 1:
        raise ValueError(f"gpu_shares: trainer_share must be in (0, 1), got {trainer_share!r}")
    whole = math.floor(cluster_gpus + _TOLERANCE)
    if whole < 1:
        return 0.0, 0.0
    if whole == 1:
        return trainer_share, _round_down((1 - trainer_share) / makers)
    makers_per_gpu = math.ceil(makers / (whole - 1))
    return 1.0, _round_down(1 / makers_per_gpu)


def _round_down(share: float) -> float:
    units = round(1 / RESOURCE_PRECISION)
    return math.floor(share * units + _TOLERANCE) / units


def device_for(assigned_gpus: float, cuda_available: bool) -> str:
    """The device of the models in an actor Ray gave `assigned_gpus` GPUs: "cuda" when it got some and CUDA is
    visible, else "cpu" (an actor that asked for no GPU must not use one: Ray 2.60 leaves CUDA_VISIBLE_DEVICES
    as it is for such actors, so every GPU of the node would be visible to it)."""
    return "cuda" if assigned_gpus > 0 and cuda_available else "cpu"
