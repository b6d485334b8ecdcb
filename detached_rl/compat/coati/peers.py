"""How a coati actor finds its own name, its namespace and its peers' names."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ray


def _actor_name(role: str) -> str:
    name = ray.get_runtime_context().get_actor_name()
    if not name:
        raise ValueError(f"a coati {role} finds its peers by name: create it with "
                         ".options(name=...).remote(...)")
    return name


def _namespace(namespace: str | None) -> str:
    """The given namespace, else coati's RAY_NAMESPACE, else the one this actor runs in (its driver's)."""
    return namespace or os.environ.get("RAY_NAMESPACE") or ray.get_runtime_context().namespace


def _names(value: Any, field: str) -> list[str]:
    if (isinstance(value, str) or not isinstance(value, Sequence)
            or not all(isinstance(v, str) for v in value)):
        raise TypeError(f"{field} must be a list of actor names, got {value!r}")
    return list(value)
