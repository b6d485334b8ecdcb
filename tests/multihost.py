"""The multi-host fixture: `hosts_fixture(...)` makes a module-scoped fixture that builds hosts from network
namespaces with a Ray node each (token auth on) and always tears them down, even when a test fails."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from .conftest import ROOT
from .hosts import Hosts
from .hosts.network import NetworkError, require_tools


def hosts_fixture(count: int = 2, **options: Any) -> Callable[..., Iterator[Hosts]]:
    """A module-scoped pytest fixture yielding a started `Hosts(count, **options)`."""

    @pytest.fixture(scope="module")
    def hosts() -> Iterator[Hosts]:
        try:
            require_tools()
        except NetworkError as error:
            pytest.fail(str(error), pytrace=False)  # not a skip: CI runs as root and must run these
        with Hosts(count, **options) as built:
            yield built

    return hosts


def tiny_config_path() -> str:
    """The repository's tiny-model config (a path every host sees: one install, shared like NFS)."""
    return str(ROOT / "examples" / "jobs" / "tiny.yaml")
