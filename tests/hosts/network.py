"""Hosts as Linux network namespaces joined by veth pairs to one bridge, each link shaped by `tc tbf`.

Layout for prefix P and N hosts: namespace `P-sw` holds bridge `br0`; host i is namespace `P-hi` with
`eth0` (address 10.213.W.(i+1)/24, W the pytest-xdist worker's number) paired with port `pi` on the
bridge. A link's rate is shaped in both directions: `tbf` on the host's `eth0` (its uploads) and on the
bridge port (its downloads). Nothing is created in the caller's namespace, so the addresses cannot clash
with the machine's own networks, and traffic between hosts never leaves the namespaces. Each host also
gets a private mount namespace in which its own directory is mounted at `HOST_ROOT`: the same path names
different files on different hosts, as on real machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .wire import LinkCharacter, netem_args


def subnet_for(worker: str | None) -> str:
    """The hosts' /24: 10.213.N for pytest-xdist worker gwN (10.213.0 outside xdist). Each `Network` has its
    own bridge namespace, so equal subnets never meet; a subnet per worker keeps logs and `ip` output
    telling which worker's hosts they are."""
    index = int(worker[2:]) if worker and worker.startswith("gw") and worker[2:].isdigit() else 0
    return f"10.213.{index % 256}"


SUBNET = subnet_for(os.environ.get("PYTEST_XDIST_WORKER"))
# Where each host sees its own directory (its home and working directory live under it).
HOST_ROOT = Path("/tmp/drl-hostfs")
# Ray's default temp directory (sessions, sockets, `ray_current_cluster`): private to each host too, so a
# host's nodes never touch, nor are found by, other Ray clusters on the machine.
RAY_TMP = Path("/tmp/ray")
# tbf's bucket: large enough for the rate's bursts at HZ=1000, small enough to keep the link honest.
MIN_BURST_BYTES = 32 * 1024


class NetworkError(RuntimeError):
    """A namespace, link or shaping command failed (the message has the command and its error)."""


def ip_command(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip`/`tc` (or any command) and raise `NetworkError` with its stderr when it fails."""
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NetworkError(f"`{' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def require_tools() -> None:
    """Refuse, naming what is missing, where the harness cannot run: root, iproute2, util-linux."""
    if os.geteuid() != 0:
        raise NetworkError("the multi-host harness needs root (network namespaces, veth pairs, tc); "
                           "leave its tests out with -m 'not multihost'")
    missing = [tool for tool in ("ip", "tc", "unshare", "nsenter", "mount") if shutil.which(tool) is None]
    if missing:
        raise NetworkError(f"the multi-host harness needs {', '.join(missing)} (Debian: apt-get install "
                           "iproute2 util-linux mount)")


def tbf_args(rate_mbit: float) -> list[str]:
    """`tc` arguments of a token bucket at `rate_mbit` Mbit/s (burst >= 10 ms of traffic, queue <= 1 s)."""
    rate_bits = int(rate_mbit * 1e6)
    burst = max(MIN_BURST_BYTES, rate_bits // 8 // 100)
    return ["tbf", "rate", f"{rate_bits}bit", "burst", str(burst), "latency", "1000ms"]


@dataclass
class Host:
    """One host: its namespace, address, bridge port, directory and the anchor process of its mounts."""

    index: int
    namespace: str
    address: str
    port: str
    directory: Path
    anchor_pid: int = 0
    anchor_parent_pid: int = 0
    rate_mbit: float | None = None
    character: LinkCharacter = field(default_factory=LinkCharacter)  # delay, jitter, loss
    wire_pid: int = 0  # the user-space wire of its link (0: a veth, with netem where the kernel has it)

    @property
    def name(self) -> str:
        """`h<index>`."""
        return f"h{self.index}"

    def pids(self) -> list[int]:
        """Every process living in this host's network namespace (the anchor included)."""
        result = ip_command("ip", "netns", "pids", self.namespace, check=False)
        return [int(p) for p in result.stdout.split()]

    def anchors(self) -> set[int]:
        """The host's init and the `unshare` that waits for it: the host itself, not its workload."""
        return {self.anchor_pid, self.anchor_parent_pid}

    def enter(self) -> list[str]:
        """Command prefix that runs a command inside this host (its network and its mounts)."""
        return ["nsenter", f"--target={self.anchor_pid}", "--net", "--mount", "--pid", "--"]


class Network:
    """The switch and the hosts of one prefix; `create` builds them, `destroy` removes everything."""

    def __init__(self, prefix: str, count: int, workdir: Path,
                 characters: dict[int, LinkCharacter] | None = None) -> None:
        if count < 1:
            raise NetworkError(f"hosts: need at least 1, got {count}")
        self.prefix = prefix
        self.workdir = workdir
        self.switch = f"{prefix}-sw"
        self.hosts = [Host(i, f"{prefix}-h{i}", f"{SUBNET}.{i + 1}", f"p{i}", workdir / f"h{i}")
                      for i in range(count)]
        for index, character in (characters or {}).items():
            self.hosts[index].character = character
        # "netem" where the kernel has it, else "wire" (wire.py); decided when a link first needs one
        self.emulation: str | None = None
        self._anchors: list[subprocess.Popen[str]] = []  # reaped by `destroy`, so no zombie outlives it
        self._wires: list[subprocess.Popen[str]] = []

    def create(self) -> None:
        """Namespaces, bridge, links, addresses and each host's private mount of its directory."""
        require_tools()
        HOST_ROOT.mkdir(parents=True, exist_ok=True)
        RAY_TMP.mkdir(parents=True, exist_ok=True)
        self.save()  # first, so that `python -m tests.hosts down` finds what a failed create left
        ip_command("ip", "netns", "add", self.switch)
        ip_command("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip_command("ip", "-n", self.switch, "link", "set", "br0", "up")
        for host in self.hosts:
            ip_command("ip", "netns", "add", host.namespace)
            if not host.character.plain and self.link_emulation() == "wire":
                self._wire(host)
            else:
                ip_command("ip", "link", "add", "name", "eth0", "netns", host.namespace, "type", "veth",
                           "peer", "name", host.port, "netns", self.switch)
            ip_command("ip", "-n", self.switch, "link", "set", host.port, "master", "br0")
            ip_command("ip", "-n", self.switch, "link", "set", host.port, "up")
            ip_command("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            ip_command("ip", "-n", host.namespace, "link", "set", "eth0", "up")
            ip_command("ip", "-n", host.namespace, "link", "set", "lo", "up")
            (host.directory / "home").mkdir(parents=True, exist_ok=True)
            (host.directory / "ray").mkdir(parents=True, exist_ok=True)
            host.anchor_pid = self._anchor(host)
            if not host.character.plain and self.emulation == "netem":
                self.shape(host, host.rate_mbit)
        self.save()

    def link_emulation(self) -> str:
        """How links get delay and loss here: "netem" when the kernel has it (tried once on the switch's
        bridge), else "wire" (a user-space wire between two TAP devices: wire.py)."""
        if self.emulation is None:
            tried = ip_command("tc", "-n", self.switch, "qdisc", "add", "dev", "br0", "root", "netem",
                               "delay", "1ms", check=False)
            self.emulation = "netem" if tried.returncode == 0 else "wire"
            if tried.returncode == 0:
                ip_command("tc", "-n", self.switch, "qdisc", "del", "dev", "br0", "root", check=False)
        return self.emulation

    def _character_file(self, host: Host) -> Path:
        return self.workdir / f"{host.name}-link.json"

    def _wire(self, host: Host) -> None:
        """The host's link as two TAP devices joined by wire.py in the switch's namespace: the bridge's port
        there, and the host's eth0 (made there, then moved into the host)."""
        path = self._character_file(host)
        path.write_text(host.character.to_json())
        host_side = f"w{host.index}"
        wire = subprocess.Popen(
            ["ip", "netns", "exec", self.switch, sys.executable, str(Path(__file__).with_name("wire.py")),
             host.port, host_side, str(path), str(host.index)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = wire.stdout.readline() if wire.stdout else ""
        if line.strip() != "ready":
            wire.kill()
            error = wire.stderr.read() if wire.stderr else ""
            raise NetworkError(f"host {host.name}: its link's wire did not start: {error.strip()[-2000:]}")
        self._wires.append(wire)
        host.wire_pid = wire.pid
        ip_command("ip", "-n", self.switch, "link", "set", host_side, "netns", host.namespace)
        ip_command("ip", "-n", host.namespace, "link", "set", host_side, "name", "eth0")

    def set_character(self, host: Host, character: LinkCharacter) -> None:
        """Give the host's link another delay, jitter or loss while it runs."""
        if host.wire_pid:
            host.character = character
            self._character_file(host).write_text(character.to_json())
            os.kill(host.wire_pid, signal.SIGHUP)
        elif self.link_emulation() == "netem":
            host.character = character
            self.shape(host, host.rate_mbit)
        else:
            raise NetworkError(f"host {host.name}: its link is a veth and this kernel has no netem: give it "
                               "a delay, jitter or loss when the hosts are made (a wire is built then)")
        self.save()

    def _anchor(self, host: Host) -> int:
        """A process in the host's namespace with a private mount of its directory at HOST_ROOT: every
        command of the host enters its namespaces."""
        script = (f"mount --make-rprivate / && mount --bind {host.directory} {HOST_ROOT} && "
                  f"mount --bind {host.directory / 'ray'} {RAY_TMP} && echo ready && exec sleep infinity")
        # Its own PID namespace and /proc too: Ray finds "the raylet of this machine" by scanning the
        # process table, which on a shared one would show every host's raylet.
        anchor = subprocess.Popen(
            ["ip", "netns", "exec", host.namespace, "unshare", "--mount", "--propagation", "private",
             "--pid", "--fork", "--mount-proc", "sh", "-c", script], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        line = anchor.stdout.readline() if anchor.stdout else ""
        children = Path(f"/proc/{anchor.pid}/task/{anchor.pid}/children")
        init = children.read_text().split() if line.strip() == "ready" and children.exists() else []
        if not init:
            anchor.kill()
            error = anchor.stderr.read() if anchor.stderr else ""
            raise NetworkError(f"host {host.name}: could not set up its namespaces: {error.strip()}")
        self._anchors.append(anchor)
        host.anchor_parent_pid = anchor.pid
        return int(init[0])  # the host's init (pid 1 inside): commands enter its namespaces

    def shape(self, host: Host, rate_mbit: float | None) -> None:
        """Shape the host's link to `rate_mbit` Mbit/s both ways (None: unshaped)."""
        netem = not host.character.plain and not host.wire_pid and self.link_emulation() == "netem"
        for namespace, device in ((host.namespace, "eth0"), (self.switch, host.port)):
            ip_command("tc", "-n", namespace, "qdisc", "del", "dev", device, "root", check=False)
            if netem:
                ip_command("tc", "-n", namespace, "qdisc", "add", "dev", device, "root",
                           *netem_args(host.character, rate_mbit))
            elif rate_mbit is not None:
                ip_command("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf_args(rate_mbit))
        host.rate_mbit = rate_mbit
        self.save()

    def set_link(self, host: Host, up: bool) -> None:
        """Take the host's cable out (`up=False`: packets are lost, connections stall) or put it back."""
        ip_command("ip", "-n", self.switch, "link", "set", host.port, "up" if up else "down")

    def counters(self, host: Host) -> dict[str, int]:
        """Bytes the host's link carried so far, read from the bridge port: `sent` (host to switch) and
        `received` (switch to host)."""
        result = ip_command("ip", "-n", self.switch, "-s", "-j", "link", "show", host.port)
        stats = json.loads(result.stdout)[0]["stats64"]
        # The bridge port's rx is what the host sent, its tx what the host received.
        return {"sent": int(stats["rx"]["bytes"]), "received": int(stats["tx"]["bytes"])}

    def save(self) -> None:
        """Record the layout in `workdir/network.json` (what `python -m tests.hosts down` reads)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        state = {"prefix": self.prefix, "owner": os.getpid(), "switch": self.switch,
                 "hosts": [{"namespace": h.namespace, "address": h.address, "anchor_pid": h.anchor_pid,
                            "rate_mbit": h.rate_mbit, "link": asdict(h.character), "wire_pid": h.wire_pid}
                           for h in self.hosts]}
        (self.workdir / "network.json").write_text(json.dumps(state, indent=1))

    def destroy(self, grace: float = 5.0) -> None:
        """Stop every process in the hosts' namespaces (by pid), then remove namespaces and links."""
        destroy_namespaces([h.namespace for h in self.hosts], self.switch, grace)
        # anchors, and the links' wires (they ended with the switch's namespace): reaped here
        for process in [*self._anchors, *self._wires]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace)
            for stream in (process.stdout, process.stderr):
                if stream is not None:
                    stream.close()
        self._anchors.clear()
        self._wires.clear()


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def namespace_pids(namespace: str) -> list[int]:
    """Processes in a network namespace (empty when it is gone)."""
    result = ip_command("ip", "netns", "pids", namespace, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def destroy_namespaces(namespaces: list[str], switch: str, grace: float = 5.0) -> None:
    """SIGTERM every process in `namespaces` and the switch's (the links' wires), SIGKILL what is left after
    `grace` s, delete the namespaces (their veths go with them) and the switch."""
    namespaces = [*namespaces, switch]
    pids = [pid for namespace in namespaces for pid in namespace_pids(namespace)]
    _signal_all(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(namespace_pids(n) for n in namespaces):
        time.sleep(0.2)
    for _ in range(5):
        left = [pid for namespace in namespaces for pid in namespace_pids(namespace)]
        if not left:
            break
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.5)
    for namespace in namespaces:
        ip_command("ip", "netns", "del", namespace, check=False)
