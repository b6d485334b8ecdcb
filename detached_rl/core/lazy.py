"""Names imported on first use: a package's public names (so importing it loads no torch) and registry entries
written as "module:attribute" (so a registry of names is plain data until an entry is used)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any


def resolve(entry: str) -> Any:
    """The object an entry "package.module:attribute[.attribute...]" names, imported now."""
    module_name, _, path = entry.partition(":")
    found: Any = importlib.import_module(module_name)
    for attribute in path.split(".") if path else ():
        found = getattr(found, attribute)
    return found


def lazy_exports(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A package's module `__getattr__` for `names` (public name -> the module that defines it)."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


class LazyRegistry(MutableMapping[str, Any]):
    """A registry by name whose entries may be written "module:attribute": names, membership and iteration
    need no import; looking an entry up imports it once (and keeps it)."""

    def __init__(self, entries: Mapping[str, Any]) -> None:
        self._entries: dict[str, Any] = dict(entries)

    def __getitem__(self, name: str) -> Any:
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = self._entries[name] = resolve(entry)
        return entry

    def __setitem__(self, name: str, value: Any) -> None:
        self._entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"LazyRegistry({sorted(self._entries)})"
