"""The multi-host fixture: `hosts_fixture(...)` makes a module-scoped fixture that builds hosts from network
namespaces with a Ray node each (token auth on) and always tears them down, even when a test fails; `Probe`,
a Ray driver kept running on one host, and the polling helpers the multi-host tests share."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from detached_rl.core.line_reader import LineReader

from .conftest import ROOT
from .deadlines import scaled
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


PROBE = str(Path(__file__).with_name("multihost_probe.py"))


class Probe:
    """A Ray driver kept running on one host (tests/multihost_probe.py): asks actors, line by line."""

    def __init__(self, hosts: Any, index: int) -> None:
        self.hosts, self.index = hosts, index
        self._start()

    def _start(self) -> None:
        self.log = self.hosts.workdir / f"probe-h{self.index}-{time.monotonic_ns()}.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                self.hosts.command(self.index, [sys.executable, PROBE, self.hosts.head_address]),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
        self.reader = LineReader(self.process.stdout.fileno())
        ready = self._line(120)
        assert "ready" in ready, "the probe did not connect"
        self.pid = json.loads(ready)["pid"]  # in its host's pid namespace

    def restart(self) -> None:
        """A new probe in place of one that stopped answering (its Ray driver stalled on a lost node)."""
        print(f"probe on h{self.index} stalled; its log ends: {self.log.read_text()[-600:]!r}")
        # its threads, where it stalled: a diagnosis only, never a reason for the test to fail
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            dump = self.hosts.run(self.index, [str(Path(sys.executable).with_name("py-spy")), "dump", "--pid",
                                               str(self.pid)], timeout=20)
            print(f"its threads: {dump.stdout[-8000:]} {dump.stderr[-1000:]}")
        self.process.kill()
        self.process.wait(timeout=20)
        self._start()

    def _line(self, timeout: float) -> str:
        """The next line the probe answers (Ray's own lines on stdout skipped), or "" after `timeout` s."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            line = self.reader.readline(left)
            if line is None:
                break
            if line.startswith("{"):
                return line
        return ""

    def call(self, actor: str, method: str, *args: Any, timeout: float = 10.0, fresh: bool = False,
             namespace: str = "detached_rl") -> Any:
        """The call's result, or an `Exception` holding Ray's error (no answer in time counts as one);
        `fresh`: look the actor up by name again (a new actor under it)."""
        return self._ask({"actor": actor, "method": method, "args": list(args), "timeout": timeout,
                          "fresh": fresh, "namespace": namespace}, timeout)

    def ask(self, actor: str, method: str, *args: Any, tries: int = 5, namespace: str = "detached_rl") -> Any:
        """`actor.method(*args)`, which must answer within `tries` tries; a probe that stalls (its Ray driver
        stuck on a node being declared dead) is replaced."""
        for _ in range(tries):
            try:
                answer = self.call(actor, method, *args, timeout=scaled(20), namespace=namespace)
            except TimeoutError:
                self.restart()
                continue
            if not isinstance(answer, Exception):
                return answer
            time.sleep(2)
        return ok(answer)

    def rows(self) -> list[dict[str, Any]]:
        """The actor table's rows of the namespace."""
        return ok(self._ask({"rows": "detached_rl"}, 30))

    def _ask(self, request: dict[str, Any], timeout: float) -> Any:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self._line(timeout + 30)
        if not line:
            raise TimeoutError(f"the probe did not answer {request}")
        reply = json.loads(line)
        return reply["ok"] if "ok" in reply else RuntimeError(reply["error"])

    def close(self) -> None:
        """End the probe (it owns nothing; it may have died with its host's node)."""
        try:
            self.process.stdin.close()
            self.process.wait(timeout=20)
        except Exception:  # noqa: BLE001 - a broken pipe or a probe that hangs: end it
            self.process.kill()
            self.process.wait(timeout=20)


def wait_for(what: str, condition: Any, timeout: float, poll: float = 1.0) -> Any:
    """Poll `condition()` until it returns something true; fail naming `what` after `timeout` s on the idle
    reference box, scaled to this machine (`tests/deadlines.py`)."""
    timeout = scaled(timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    pytest.fail(f"{what}: not within {timeout:.0f} s")


def ok(value: Any) -> Any:
    """A probe answer that must not be an error."""
    assert not isinstance(value, Exception), value
    return value
