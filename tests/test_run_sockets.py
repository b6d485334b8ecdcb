"""What a `detached-rl run` started from a plain shell listens on: helpers that follow a run's process tree
and its sockets (tests/test_run_job.py's run is checked with them), and what counts as loopback."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.conftest import CLUSTER_MARKER

LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
# What tests/conftest.py puts in the environment of the test process; a user's shell has none of them.
CONFTEST_VARIABLES = ("RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_USAGE_STATS_ENABLED",
                      "TOKENIZERS_PARALLELISM", CLUSTER_MARKER)


def plain_environment(home: Path) -> dict[str, str]:
    """This process's environment without anything the test suite sets, no RAY_* and no DETACHED_RL_*."""
    env = {key: value for key, value in os.environ.items()
           if key not in CONFTEST_VARIABLES and not key.startswith(("RAY_", "DETACHED_RL_"))}
    env["HOME"] = str(home)  # Ray's token auth, on when RAY_AUTH_MODE is unset, writes ~/.ray/auth_token
    return env


def console_script() -> list[str]:
    """The `detached-rl` command as a user runs it: the venv's console script (else `python -m`)."""
    script = Path(sys.executable).with_name("detached-rl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "detached_rl.cli"]


def listening(process: psutil.Process) -> list[tuple[str, str, int]]:
    """(kind, address, port) of each TCP socket `process` listens on and each UDP socket it has bound."""
    found = []
    with contextlib.suppress(psutil.Error):
        for conn in process.net_connections(kind="inet"):
            if conn.type == socket.SOCK_STREAM and conn.status == psutil.CONN_LISTEN:
                found.append(("tcp", conn.laddr.ip, conn.laddr.port))
            elif conn.type == socket.SOCK_DGRAM and conn.laddr and not conn.raddr:
                found.append(("udp", conn.laddr.ip, conn.laddr.port))
    return found


def on_loopback(address: str) -> bool:
    """True for an address in 127.0.0.0/8, also written IPv4-mapped (::ffff:127.0.0.1)."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip in LOOPBACK


def stop_tree(root: subprocess.Popen, seen: dict[int, psutil.Process]) -> None:
    """End the run's process group and every process of its tree seen while it ran."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(root.pid, signal.SIGTERM)
    alive = [proc for proc in seen.values() if proc.is_running()]
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(alive, timeout=15)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(root.pid, signal.SIGKILL)
    root.wait(timeout=30)


def watch_sockets(run: subprocess.Popen, timeout: float, poll_s: float = 0.2
                  ) -> tuple[dict[int, psutil.Process], dict[tuple[str, str, int], str]]:
    """Follow `run`'s process tree until it exits (or `timeout` s pass): every process seen (pid -> process)
    and every socket they listened on ((kind, address, port) -> process name)."""
    seen: dict[int, psutil.Process] = {}
    sockets: dict[tuple[str, str, int], str] = {}
    deadline = time.monotonic() + timeout
    while run.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(run.pid)
            for proc in [root, *root.children(recursive=True)]:
                seen.setdefault(proc.pid, proc)
                for entry in listening(proc):
                    with contextlib.suppress(psutil.Error):
                        sockets.setdefault(entry, proc.name())
        time.sleep(poll_s)
    return seen, sockets


# The run whose sockets are checked is tests/test_run_job.py's (one tiny `run` serves both).


def test_on_loopback():
    assert on_loopback("127.0.0.1") and on_loopback("127.3.2.1") and on_loopback("::ffff:127.0.0.1")
    assert not any(on_loopback(a)
                   for a in ("0.0.0.0", "::", "192.0.2.2", "::1", "10.0.0.1", "::ffff:10.0.0.1"))


def test_plain_environment_drops_what_the_suite_sets(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    env = plain_environment(tmp_path)
    assert not [key for key in env if key.startswith("RAY_") or key in CONFTEST_VARIABLES]
    assert env["HOME"] == str(tmp_path) and env["PATH"] == os.environ["PATH"]
