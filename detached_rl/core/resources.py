"""Checks of the Ray resources and placement strategies a config asks for (Ray-free)."""

from __future__ import annotations

from typing import Any

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def check_resources(resources: Any, where: str) -> None:
    """Refuse custom resources that are not a mapping of names to amounts > 0, naming `where`."""
    if not isinstance(resources, dict):
        raise ValueError(f"{where} must be a mapping of resource names to amounts, got {resources!r}")
    for key, amount in resources.items():
        if not isinstance(key, str) or isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
            raise ValueError(f"{where}: {key!r} must map to a number > 0, got {amount!r}")
        if key in ("CPU", "GPU", "memory"):
            raise ValueError(f"{where}: {key!r} is not a custom resource (set the CPU/GPU counts instead)")
