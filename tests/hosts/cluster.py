"""A Ray cluster over the hosts of a `Network`: the head on host 0, a worker node on each other host, each
started with `detached-rl node` (token authentication on, ports pinned; `bind_to_address`: listening on the
host's address only) or with plain `ray start` (as KubeRay or a Slurm script does), every process owned by
the harness and stopped by pid."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from detached_rl.node import NodePorts

from .network import HOST_ROOT, Host, Network, NetworkError, destroy_namespaces
from .wire import LinkCharacter

RAY_PORT = NodePorts().gcs
CLIENT_PORT = NodePorts().client
# How a host's Ray node is started: `detached-rl node` (docs/multi-host.md section 2), or `ray start` with
# Ray's defaults but the head's ports, the host's address and what the test asks for (CPUs, resources,
# labels).
NODE_STARTERS = ("detached-rl node", "ray start")


class HostsError(NetworkError):
    """The harness could not build, start or stop a host (the message says which and why)."""


def tool_bin() -> Path:
    """The directory of this Python's scripts (`ray`, `detached-rl`): the same install on every host."""
    return Path(sys.executable).parent


class Hosts:
    """N hosts with a Ray node each (but the `bare` ones); a context manager that always tears down what it
    built.

    `hosts.run(i, [...])` runs a command on host i from a plain environment (PATH, HOME on that host,
    the cluster's token), as a user's shell there would; `hosts.popen` starts one and returns it.
    """

    def __init__(self, count: int = 2, rates_mbit: dict[int, float] | None = None, *,
                 cpus: dict[int, float] | None = None, resources: dict[int, dict[str, float]] | None = None,
                 labels: dict[int, dict[str, str]] | None = None, object_store_mb: int = 1024,
                 token: bool = True, prefix: str | None = None, workdir: Path | None = None,
                 node_args: dict[int, list[str]] | None = None, bare: set[int] | None = None,
                 start_with: str = "detached-rl node", bind_to_address: bool = False,
                 links: dict[int, LinkCharacter] | None = None) -> None:
        if bare and 0 in bare:
            raise HostsError("host 0 runs the head: it cannot be bare (without a Ray node)")
        if start_with not in NODE_STARTERS:
            raise HostsError(f"start_with={start_with!r}: a node is started with one of {NODE_STARTERS}")
        if bind_to_address and start_with != "detached-rl node":
            raise HostsError("bind_to_address=True is `detached-rl node --bind-to-address`: not with "
                             f"start_with={start_with!r}")
        self.prefix = prefix or f"drlh-{uuid.uuid4().hex[:6]}"
        # short: Ray's socket paths have a length limit of about 100 characters
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix=f"{self.prefix}-", dir="/tmp"))
        # delay, jitter and loss of each host's link (its rate is `rates_mbit`): netem, or a wire (wire.py)
        self.network = Network(self.prefix, count, self.workdir, links)
        self.rates_mbit = rates_mbit or {}
        self.cpus = cpus or {}
        self.resources = resources or {}
        self.labels = labels or {}
        self.node_args = node_args or {}  # more `ray start` options of host i (after `detached-rl node --`)
        self.start_with = start_with
        # True: `detached-rl node --bind-to-address` (the bind shim); False: Ray's own binding
        self.bind_to_address = bind_to_address
        self.node_reports: dict[int, str] = {}  # what each host's node command printed when it started
        self.bare = set(bare or ())  # hosts without a Ray node (a laptop with the CLI only)
        self.object_store_mb = object_store_mb
        self.token = secrets.token_hex(32) if token else None
        self.started = False

    # -- layout ---------------------------------------------------------------------------------------
    @property
    def hosts(self) -> list[Host]:
        """The hosts, host 0 first (the head)."""
        return self.network.hosts

    def host(self, index: int) -> Host:
        """Host `index`."""
        return self.hosts[index]

    @property
    def head_address(self) -> str:
        """`host:port` of the head's GCS."""
        return f"{self.hosts[0].address}:{RAY_PORT}"

    @property
    def client_address(self) -> str:
        """`ray://host:port` of the head's Ray client server."""
        return f"ray://{self.hosts[0].address}:{CLIENT_PORT}"

    # -- commands -------------------------------------------------------------------------------------
    def environment(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A plain shell's environment on a host: PATH, HOME (on the host), locale and the cluster's token;
        the caller's PYTHONPATH too, so that every host runs the same code (a shared install, like NFS)."""
        env = {"PATH": f"{tool_bin()}:/usr/local/bin:/usr/bin:/bin", "HOME": str(HOST_ROOT / "home"),
               "LANG": "C.UTF-8", "RAY_USAGE_STATS_ENABLED": "0"}
        if os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        if self.token:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        env.update(extra or {})
        return env

    def command(self, index: int, args: list[str], env: dict[str, str] | None = None,
                cwd: str | None = None) -> list[str]:
        """The argv that runs `args` on host `index` in `env` (default `environment()`), from `cwd`
        (default its home)."""
        env = self.environment() if env is None else env
        assignments = [f"{key}={value}" for key, value in env.items()]
        return [*self.host(index).enter(), "env", "-i", f"--chdir={cwd or env.get('HOME', '/')}",
                *assignments, *args]

    def run(self, index: int, args: list[str], *, env: dict[str, str] | None = None,
            cwd: str | None = None, timeout: float = 300.0,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run a command on host `index` and wait for it (text output captured)."""
        result = subprocess.run(self.command(index, args, env, cwd), capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise HostsError(f"h{index}: `{' '.join(args)}` exited {result.returncode}:\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def popen(self, index: int, args: list[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, log: Path | None = None) -> subprocess.Popen[str]:
        """Start a command on host `index` (its own session; output to `log` or captured)."""
        out: Any = open(log, "w") if log else subprocess.PIPE  # noqa: SIM115 - the child keeps it
        return subprocess.Popen(self.command(index, args, env, cwd), stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)

    def python(self, index: int, code: str, **options: Any) -> subprocess.CompletedProcess[str]:
        """Run a Python snippet on host `index` (this interpreter, the same install)."""
        return self.run(index, [sys.executable, "-c", code], **options)

    # -- links ----------------------------------------------------------------------------------------
    def shape(self, index: int, rate_mbit: float | None) -> None:
        """Shape host `index`'s link to `rate_mbit` Mbit/s both ways (None: full speed)."""
        self.network.shape(self.host(index), rate_mbit)

    def set_link_character(self, index: int, character: LinkCharacter) -> None:
        """Give host `index`'s link another delay, jitter or loss while it runs (a host made with one)."""
        self.network.set_character(self.host(index), character)

    def link(self, index: int, up: bool) -> None:
        """Unplug (`up=False`) or plug back host `index`'s link."""
        self.network.set_link(self.host(index), up)

    def counters(self, index: int) -> dict[str, int]:
        """Bytes host `index`'s link has carried each way (`sent`, `received`), from the link's counters."""
        return self.network.counters(self.host(index))

    # -- Ray nodes ------------------------------------------------------------------------------------
    def node_command(self, index: int) -> list[str]:
        """The argv that starts host `index`'s Ray node: the head on host 0, else a worker joining it. With
        `detached-rl node`: ports pinned (the command's defaults), the cluster's token required; with `ray
        start`: Ray's own defaults (ports, dashboard) but the head's two ports and the host's address."""
        host = self.host(index)
        if self.start_with == "ray start":
            command = [str(tool_bin() / "ray"), "start", f"--node-ip-address={host.address}"]
        else:
            command = [str(tool_bin() / "detached-rl"), "node", f"--node-ip-address={host.address}"]
        command.append(f"--num-cpus={self.cpus.get(index, 2)}")
        if index == 0:
            command += ["--head", f"--port={RAY_PORT}", f"--ray-client-server-port={CLIENT_PORT}"]
        else:
            command.append(f"--address={self.head_address}")
        if self.resources.get(index):
            command.append(f"--resources={json.dumps(self.resources[index])}")
        if self.labels.get(index):
            command.append("--labels=" + ",".join(f"{k}={v}" for k, v in self.labels[index].items()))
        ray_options = [f"--object-store-memory={self.object_store_mb * 2 ** 20}", "--disable-usage-stats",
                       *self.node_args.get(index, [])]
        if self.start_with == "ray start":
            return [*command, *ray_options]
        if not self.token:
            command.append("--no-token")
        if self.bind_to_address:
            command.append("--bind-to-address")
        return [*command, "--", *ray_options]

    def start_node(self, index: int) -> None:
        """Start host `index`'s Ray node as a user on that host would (`node_command`); what it printed is
        kept in `node_reports[index]`."""
        self.node_reports[index] = self.run(index, self.node_command(index), timeout=360, check=True).stdout

    def kill_node(self, index: int, sig: int = signal.SIGKILL) -> list[int]:
        """Kill every process of host `index` but its anchor (its raylet, workers, agents): the machine
        dies, its namespace stays. Returns the pids signalled."""
        host = self.host(index)
        pids = [pid for pid in host.pids() if pid not in host.anchors()]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def raylet_pid(self, index: int) -> int | None:
        """The pid of host `index`'s raylet, if it runs."""
        for pid in self.host(index).pids():
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            if name == "raylet":
                return pid
        return None

    def wait_for_nodes(self, count: int, timeout: float = 120.0) -> None:
        """Wait until the cluster has `count` alive nodes (asked from host 0)."""
        code = ("import ray, time, sys\n"
                f"ray.init(address='{self.head_address}', log_to_driver=False)\n"
                f"deadline = time.time() + {timeout}\n"
                f"while len([n for n in ray.nodes() if n['Alive']]) < {count} and time.time() < deadline:\n"
                "    time.sleep(0.5)\n"
                f"sys.exit(0 if len([n for n in ray.nodes() if n['Alive']]) >= {count} else 1)\n")
        result = self.python(0, code, timeout=timeout + 60)
        if result.returncode != 0:
            raise HostsError(f"the cluster did not reach {count} nodes within {timeout:.0f} s:\n"
                             f"{result.stderr[-2000:]}")

    # -- life cycle -----------------------------------------------------------------------------------
    def up(self, nodes: bool = True) -> Hosts:
        """Build the network, shape the links and (with `nodes`) start a Ray node on every host."""
        try:
            self.network.create()
            for index, rate in self.rates_mbit.items():
                self.shape(index, rate)
            if nodes:
                for index in range(len(self.hosts)):
                    if index not in self.bare:
                        self.start_node(index)
                self.wait_for_nodes(len(self.hosts) - len(self.bare))
            self.started = True
            self._save()
        except BaseException:
            self.down()
            raise
        return self

    def _save(self) -> None:
        state = json.loads((self.workdir / "network.json").read_text())
        state.update(head_address=self.head_address, client_address=self.client_address, token=self.token)
        (self.workdir / "network.json").write_text(json.dumps(state, indent=1))

    def down(self) -> None:
        """Stop every process on the hosts (by pid), remove namespaces and links, delete the work
        directory."""
        self.network.destroy()
        self.started = False
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Hosts:
        return self if self.started else self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def tear_down(workdir: Path) -> None:
    """Tear down what `Hosts` built in `workdir` (read from its network.json), e.g. after a crash."""
    state = json.loads((workdir / "network.json").read_text())
    destroy_namespaces([h["namespace"] for h in state["hosts"]], state["switch"])
    shutil.rmtree(workdir, ignore_errors=True)
