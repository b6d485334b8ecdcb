"""Node-label selectors (Ray's `label_selector`): checked when a config is read, matched against the labels
of a cluster's nodes before anything is placed.

A selector maps a label key to a condition, as Ray 2.60 takes them: `value` (the node's label equals it),
`!value` (it does not, or the node lacks the label), `in(a,b)` (one of them), `!in(a,b)` (none of them).
Nodes get labels from `ray start --labels key=value,...` (and Ray's own `ray.io/...` labels).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

# Ray's label syntax (`ray._private.label_utils`): alphanumerics first and last, '-', '_', '.' between,
# at most 63 characters; a key may have a 'prefix/' of such names joined by dots.
_VALUE = r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_KEY = re.compile(rf"^(?:{_VALUE}(?:\.{_VALUE})*/)?{_VALUE}$")
_CONDITION = re.compile(rf"^(!)?(?:(?:in)?\(({_VALUE}(?:, ?{_VALUE})*)\)|({_VALUE}))$")


def check_label_selector(selector: Any, where: str) -> None:
    """Refuse a selector that is not a mapping of label keys to conditions Ray accepts, naming `where`."""
    if not isinstance(selector, dict):
        raise ValueError(f"{where} must be a mapping of node-label keys to values (e.g. {{zone: east}}), "
                         f"got {selector!r}")
    for key, condition in selector.items():
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"{where}: {key!r} is not a node-label key (letters, digits, '-', '_', '.'; an "
                             "optional 'prefix/')")
        if not isinstance(condition, str) or not _CONDITION.match(condition):
            raise ValueError(f"{where}.{key}: {condition!r} is not a label condition: 'value', '!value', "
                             "'in(a,b)' or '!in(a,b)' (values: letters, digits, '-', '_', '.')")


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with `labels` satisfies every condition of `selector`."""
    for key, condition in selector.items():
        found = _CONDITION.match(condition)
        if found is None:
            return False
        negated, listed, single = found.groups()
        values = {v.strip() for v in listed.split(",")} if listed else {single}
        if (labels.get(key) in values) == bool(negated):
            return False
    return True


def describe_selector(selector: Mapping[str, str]) -> str:
    """A selector as text: "role=maker, zone=!east"."""
    return ", ".join(f"{key}={condition}" for key, condition in selector.items())


def unmatched(selectors: Mapping[str, Mapping[str, str]], nodes: Iterable[Mapping[str, str]]) -> str | None:
    """Why one of the actors `selectors` (label, e.g. "maker m0" -> its selector) can never be placed: no
    node among `nodes` (the labels of each alive node) carries the labels it asks for; None when all can."""
    nodes = list(nodes)
    for label, selector in selectors.items():
        if selector and not any(matches(selector, node) for node in nodes):
            seen = sorted({f"{key}={value}" for node in nodes for key, value in node.items()
                           if not key.startswith("ray.io/")})
            return (f"{label} asks for a node with labels {describe_selector(selector)}; no alive node "
                    f"carries them (the nodes' labels: {', '.join(seen) or 'none'})")
    return None
