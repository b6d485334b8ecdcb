"""The TCP sockets listening in this network namespace, read from /proc/net/tcp and tcp6 (no tools needed)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from pathlib import Path

LISTEN = "0A"  # the kernel's TCP_LISTEN, as /proc/net/tcp writes the state column
WILDCARDS = {"0.0.0.0", "::"}


def _address(hexadecimal: str) -> str:
    """A /proc/net/tcp{,6} address: 32-bit words in host (little-endian) byte order. IPv4-mapped IPv6
    addresses are given as IPv4."""
    raw = bytes.fromhex(hexadecimal)
    ordered = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(ordered)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return str(address.ipv4_mapped)
    return str(address)


def parse_table(text: str) -> list[tuple[str, int]]:
    """(address, port) of each listening socket of one /proc/net/tcp or tcp6 table."""
    found = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 4 or fields[3] != LISTEN:
            continue
        address, _, port = fields[1].partition(":")
        found.append((_address(address), int(port, 16)))
    return found


def listening_sockets(proc_net: Path = Path("/proc/self/net")) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of this process's network namespace, sorted."""
    found: set[tuple[str, int]] = set()
    for table in ("tcp", "tcp6"):
        path = proc_net / table
        if path.exists():
            found.update(parse_table(path.read_text()))
    return sorted(found, key=lambda row: (row[1], row[0]))


def wildcard_listeners(ports: Iterable[int],
                       proc_net: Path = Path("/proc/self/net")) -> list[tuple[str, int]]:
    """The sockets on `ports` that listen on all interfaces (0.0.0.0 or [::])."""
    wanted = set(ports)
    return [(address, port) for address, port in listening_sockets(proc_net)
            if port in wanted and address in WILDCARDS]
