"""Actor groups: named workers of one actor class in one detached placement group, started and stopped as a
whole.

An `ActorGroup` `<prefix>` of size n is the detached, named actors `<prefix>_0` … `<prefix>_{n-1}`,
one per bundle of the detached placement group `<prefix>-placement`. Trainer groups (data-parallel
ranks, `actors/trainer_group.py`) and scorer groups (`actors/scorer.py`) are ActorGroups; this module is
the only place that creates or removes placement groups.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ray

from detached_rl.actors.transport import get_all, resolve_namespace

logger = logging.getLogger(__name__)


def worker_names(prefix: str, size: int) -> list[str]:
    """Names of the workers of group `prefix`: prefix_0 … prefix_{size-1}."""
    return [f"{prefix}_{index}" for index in range(size)]


def placement_group_name(prefix: str) -> str:
    """Name of the placement group that holds the workers of group `prefix`."""
    return f"{prefix}-placement"


def group_prefix(name: str) -> str | None:
    """The group prefix of a worker name `<prefix>_<index>`; None for a name of another shape."""
    prefix, _, index = name.rpartition("_")
    return prefix if prefix and index.isdigit() else None


def remove_placement_group_of(prefix: str) -> None:
    """Remove the placement group of group `prefix` (nothing if there is none)."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    with contextlib.suppress(ValueError):
        remove_placement_group(get_placement_group(placement_group_name(prefix)))


def remove_placement_groups_left_empty(stopped: Iterable[str], live: Iterable[str]) -> None:
    """Remove the placement group of each group with a worker in `stopped` and none in `live` any more."""
    emptied = {group_prefix(name) for name in stopped} - {group_prefix(name) for name in live} - {None}
    for prefix in sorted(emptied):
        remove_placement_group_of(prefix)


class ActorGroup:
    """`size` detached, named workers `<prefix>_<index>` of one actor class in the placement
    group `<prefix>-placement`."""

    def __init__(self, prefix: str, size: int, namespace: str | None = None,
                 kind: str = "actor group") -> None:
        if not prefix:
            raise ValueError("ActorGroup: prefix is empty")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"ActorGroup {prefix!r}: size must be an int >= 1, got {size!r}")
        self.prefix = prefix
        self.size = size
        self.namespace = resolve_namespace(namespace)
        self.kind = kind  # how errors and warnings name the group, e.g. "trainer group"
        self.names = worker_names(prefix, size)
        self.placement_group_name = placement_group_name(prefix)

    def start(
        self,
        actor_class: Any,
        arguments: Callable[[int, str], Sequence[Any]],
        bundle: dict[str, float],
        placement_strategy: str = "PACK",
        timeout: float = 300.0,
        options: dict[str, Any] | None = None,
        ready: Callable[[list[Any]], Any] | None = None,
        detached: bool = True,
        label_selector: dict[str, str] | None = None,
    ) -> list[Any]:
        """Place one `bundle` per worker, create the workers (`arguments(index, name)` are each one's
        constructor arguments, `options` extra actor options) and wait until `ready(handles)` returns; returns
        the handles. `detached=False`: the workers and the placement group end with the driver that creates
        them. `label_selector`: every bundle on a node carrying these labels.

        If the bundles cannot be placed within `timeout` s, or a worker or `ready` fails, every
        worker and the placement group are removed and the error is raised.
        """
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        lifetime = "detached" if detached else None
        selectors = [dict(label_selector) for _ in range(self.size)] if label_selector else None
        group = placement_group([dict(bundle) for _ in range(self.size)], strategy=placement_strategy,
                                name=self.placement_group_name, lifetime=lifetime,
                                bundle_label_selector=selectors)
        handles: list[Any] = []
        try:
            if not group.wait(timeout_seconds=timeout):
                on = f" on nodes labelled {label_selector}" if label_selector else ""
                raise TimeoutError(
                    f"{self.kind} {self.prefix!r}: {self.size} bundles of {bundle} "
                    f"({placement_strategy}){on} could not be placed within {timeout:.0f} s; the cluster has "
                    f"{ray.available_resources()} available"
                )
            for index, name in enumerate(self.names):
                worker_options = {
                    "lifetime": lifetime, "namespace": self.namespace, "name": name,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(
                        group, placement_group_bundle_index=index),
                    **(options or {}),
                }
                handles.append(actor_class.options(**worker_options).remote(*arguments(index, name)))
            if ready is not None:
                ready(handles)
        except BaseException:
            for handle in handles:
                ray.kill(handle)
            remove_placement_group(group)
            raise
        return handles

    def find(self) -> dict[str, Any]:
        """The live workers of this group by name (missing ones are left out)."""
        found = {}
        for name in self.names:
            try:
                found[name] = ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                continue
        return found

    def stop(self, shutdown: str | None = None, timeout: float = 60.0) -> None:
        """Call the workers' `shutdown` method (all at once; if given), kill them and remove the placement
        group.

        Missing workers and a missing placement group are skipped; a shutdown that fails or takes
        longer than `timeout` s is logged, and the workers are killed anyway.
        """
        handles = list(self.find().values())
        if shutdown is not None and handles:
            try:
                get_all([getattr(handle, shutdown).remote() for handle in handles], timeout=timeout)
            except Exception as error:  # noqa: BLE001 - killing them below is what matters
                logger.warning("%s %s did not shut down cleanly: %s", self.kind, self.prefix, error)
        for handle in handles:
            ray.kill(handle, no_restart=True)
        remove_placement_group_of(self.prefix)
