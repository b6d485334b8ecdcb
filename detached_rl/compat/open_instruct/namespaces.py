"""Where open-instruct's learners and the makers meet: one Ray namespace, said out loud when they miss.

Makers find learners, and learners send weights to makers, by name in one namespace. A learner always lands
in the namespace it looks in (`LearnerActorClass`); a maker found elsewhere is refused with the exact change
that brings it over (`misplaced_maker`).
"""

from __future__ import annotations

import uuid
from typing import Any

import ray

from detached_rl.actors.transport import resolve_namespace
from detached_rl.compat.placement import PlacementCheckedActorClass


def is_anonymous(namespace: str) -> bool:
    """True for the random uuid4 namespace Ray gives a driver whose `ray.init()` named none."""
    try:
        return str(uuid.UUID(namespace, version=4)) == namespace
    except ValueError:
        return False


def learner_namespace(options_namespace: str | None, constructor_namespace: str | None, label: str) -> str:
    """The one namespace a learner is created in and looks in: the one given (in `.options` or to the
    constructor; both must agree), else `resolve_namespace` (the driver's named one, else `detached_rl`)."""
    if options_namespace and constructor_namespace and options_namespace != constructor_namespace:
        raise ValueError(f"{label}: .options(namespace={options_namespace!r}) and namespace="
                         f"{constructor_namespace!r} differ: the learner would look for makers where it is "
                         "not")
    return resolve_namespace(options_namespace or constructor_namespace)


class LearnerActorClass(PlacementCheckedActorClass):
    """The learner's Ray class: `.options(name=...)` without a namespace creates the rank where it looks for
    makers and where makers look for it, never in a plain `ray.init()`'s anonymous namespace."""

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        """Create the learner in `learner_namespace` (told to the constructor too)."""
        label = f"{self.role} {self.given.get('name') or ''}".rstrip()
        namespace = learner_namespace(self.given.get("namespace"), kwargs.get("namespace"), label)
        options = dict(self.given)
        if options.get("name"):  # an unnamed actor has no namespace in Ray
            options["namespace"] = namespace
        return PlacementCheckedActorClass(self.actor_class, self.role, options).remote(
            *args, **{**kwargs, "namespace": namespace})


def namespaces_holding(name: str) -> list[str]:
    """The namespaces that hold a named actor `name` (sorted; empty without Ray)."""
    if not ray.is_initialized():
        return []
    return sorted({entry["namespace"] for entry in ray.util.list_named_actors(all_namespaces=True)
                   if entry["name"] == name})


def maker_advice(maker: str, learner: str, namespace: str, found_in: list[str]) -> str:
    """What to say when maker `maker` is not in `namespace`, where `learner` sends weights (`found_in`: the
    namespaces that do hold a `maker`)."""
    places = [f"the anonymous namespace {name!r} of a plain ray.init() (actors created with "
              ".options(name=...) and no namespace land there)" if is_anonymous(name)
              else f"namespace {name!r}" for name in found_in]
    where = "it is in " + ", ".join(places) if places else "no Ray namespace holds an actor of that name"
    return (f"maker {maker!r} is not in Ray namespace {namespace!r}, where learner {learner!r} sends it "
            f"weights and makers find learners; {where}: create it with .options(name={maker!r}, "
            f"namespace={namespace!r}), or name the namespace in the driver: "
            f"ray.init(namespace={namespace!r})")


def no_batch_advice(learner: str, namespace: str, refused: list[str]) -> str:
    """What a learner's step that got no batch adds: where makers must be, and the makers it `refused`."""
    return (f"Learner {learner!r} is in Ray namespace {namespace!r}: makers find it there by name (create "
            f"them with .options(name=..., namespace={namespace!r}))."
            + "".join(f" Refused: {advice}." for advice in refused))


def misplaced_maker(maker: str, learner: str, namespace: str) -> str | None:
    """None when Ray namespace `namespace` holds maker `maker` (or Ray is not running); else
    `maker_advice`."""
    if not ray.is_initialized():
        return None
    try:
        ray.get_actor(maker, namespace=namespace)
    except ValueError:
        return maker_advice(maker, learner, namespace, namespaces_holding(maker))
    return None
