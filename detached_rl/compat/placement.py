"""The migration layers' actor classes refuse at once what the cluster can never place (as ppo-on-ray)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Self

import ray

from detached_rl.actors.launch import check_placeable
from detached_rl.core.resources import resource_request


def actor_request(options: Mapping[str, Any]) -> dict[str, float] | None:
    """What an actor created with Ray `options` asks for; None when a placement group's bundle places it."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if options.get("placement_group") not in (None, "default") or isinstance(
            options.get("scheduling_strategy"), PlacementGroupSchedulingStrategy):
        return None
    custom = dict(options.get("resources") or {})
    if options.get("memory"):
        custom["memory"] = float(options["memory"])
    return resource_request(options.get("num_cpus") or 0.0, options.get("num_gpus") or 0.0, custom)


def check_actor_placeable(label: str, options: Mapping[str, Any]) -> None:
    """Refuse (`UnplaceableError`, one line naming the resource) an actor the cluster can never place."""
    request = actor_request(options)
    if request and ray.is_initialized():
        check_placeable({label: request})


def check_bundles_placeable(label: str, bundles: list[Mapping[str, float]]) -> None:
    """Refuse a placement group whose bundles (`pg.bundle_specs`) the cluster can never hold."""
    if ray.is_initialized():
        check_placeable({f"{label} bundle {index}": dict(bundle) for index, bundle in enumerate(bundles)})


class PlacementCheckedActorClass:
    """A Ray actor class whose `.remote()` and `.options(...).remote()` refuse an unplaceable request."""

    def __init__(self, actor_class: Any, role: str, options: Mapping[str, Any] | None = None) -> None:
        self.actor_class = actor_class
        self.role = role
        self.given = dict(options or {})

    def options(self, **options: Any) -> Self:
        """The class with these Ray actor options (over those given before)."""
        return type(self)(self.actor_class, self.role, {**self.given, **options})

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Create the actor, unless the cluster can never place what it asks for."""
        name = self.given.get("name")
        check_actor_placeable(f"{self.role} {name}" if name else self.role, self.given)
        target = self.actor_class.options(**self.given) if self.given else self.actor_class
        return target.remote(*args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") or "actor_class" not in self.__dict__:
            raise AttributeError(attribute)
        return getattr(self.actor_class, attribute)

    def __repr__(self) -> str:
        return f"PlacementCheckedActorClass({self.actor_class!r}, role={self.role!r})"
