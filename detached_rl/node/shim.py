"""The bind shim (bind_shim.c) of `detached-rl node --bind-to-address`: built once per source version with
the system's C compiler, preloaded into a Ray node's processes so that what Ray would bind to all interfaces
on the node's ports is bound to the node's address."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path

SOURCE = Path(__file__).with_name("bind_shim.c")
# The variable the shim reads: the IPv4 address that replaces a wildcard bind.
ADDRESS_VARIABLE = "DETACHED_RL_BIND_ADDRESS"
# ... and the ports it does so on (the node's own; unset: every port).
PORTS_VARIABLE = "DETACHED_RL_BIND_PORTS"
BUILD_TIMEOUT_S = 120.0


class NodeError(RuntimeError):
    """A node cannot be started as asked (the message names the option or variable and what to do)."""


def cache_directory(environment: Mapping[str, str] | None = None) -> Path:
    """Where built shims are kept: $DETACHED_RL_CACHE_DIR, else $XDG_CACHE_HOME/detached-rl, else
    ~/.cache/detached-rl (of the environment's HOME)."""
    environment = os.environ if environment is None else environment
    if environment.get("DETACHED_RL_CACHE_DIR"):
        return Path(environment["DETACHED_RL_CACHE_DIR"])
    if environment.get("XDG_CACHE_HOME"):
        return Path(environment["XDG_CACHE_HOME"]) / "detached-rl"
    home = environment.get("HOME") or str(Path.home())
    return Path(home) / ".cache" / "detached-rl"


def find_compiler(environment: Mapping[str, str] | None = None) -> str:
    """$CC, else cc or gcc on PATH; refuses naming what to install."""
    environment = os.environ if environment is None else environment
    path = environment.get("PATH")
    for candidate in (environment.get("CC"), "cc", "gcc"):
        if candidate and (found := shutil.which(candidate, path=path)):
            return found
    raise NodeError("--bind-to-address needs a C compiler to build detached-rl's bind shim once (none "
                    "found: set CC, or apt-get install gcc libc6-dev); or leave out --bind-to-address: Ray's "
                    "own binding with token auth and a firewall (docs/multi-host.md section 6)")


def build_bind_shim(directory: Path | None = None, environment: Mapping[str, str] | None = None) -> Path:
    """The shared object of bind_shim.c, compiled into `directory` (default `cache_directory()`) unless a
    build of this source is there already."""
    source = SOURCE.read_bytes()
    directory = directory or cache_directory(environment)
    target = directory / f"bind-shim-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if target.is_file():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    command = [find_compiler(environment), "-shared", "-fPIC", "-O2", "-Wall", "-o", str(partial),
               str(SOURCE), "-ldl"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise NodeError(f"building the bind shim took over {BUILD_TIMEOUT_S:.0f} s: {' '.join(command)}") \
            from error
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise NodeError(f"building the bind shim failed ({' '.join(command)}): "
                        f"{(result.stderr or result.stdout).strip()[-800:]}")
    os.replace(partial, target)  # atomic: a node started meanwhile never preloads half a file
    return target


def port_ranges(ports: Iterable[int]) -> str:
    """{6379, 6380, 6381, 10001} -> "6379-6381,10001" (the shim's DETACHED_RL_BIND_PORTS)."""
    ranges: list[list[int]] = []
    for port in sorted(set(ports)):
        if ranges and port == ranges[-1][1] + 1:
            ranges[-1][1] = port
        else:
            ranges.append([port, port])
    return ",".join(f"{low}" if low == high else f"{low}-{high}" for low, high in ranges)


def preloaded(environment: Mapping[str, str], shim: Path, address: str,
              ports: Iterable[int] | None = None) -> dict[str, str]:
    """`environment` with the shim preloaded (before any LD_PRELOAD already set), binding wildcard binds on
    `ports` (None: every port) to `address`."""
    preload = " ".join(part for part in (str(shim), environment.get("LD_PRELOAD", "")) if part)
    result = {**environment, "LD_PRELOAD": preload, ADDRESS_VARIABLE: address}
    result.pop(PORTS_VARIABLE, None)
    if ports is not None:
        result[PORTS_VARIABLE] = port_ranges(ports)
    return result
