"""Start a Ray node as docs/multi-host.md section 2 says: `ray start` with token authentication required and
every port pinned (with `--bind-to-address`, also the bind shim preloaded so that nothing listens on all
interfaces); then check the node's listening sockets and say where it listens and what a firewall must
guard."""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import json
import os
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from detached_rl.node.listening import wildcard_listeners
from detached_rl.node.shim import NodeError, build_bind_shim, port_ranges, preloaded

START_TIMEOUT_S = 300.0
# `ray start` flags of each pinned port (a flag also given after `--` overrides the default here).
PORT_FLAGS = {"node_manager": "--node-manager-port", "object_manager": "--object-manager-port",
              "dashboard_agent_grpc": "--dashboard-agent-grpc-port",
              "dashboard_agent_listen": "--dashboard-agent-listen-port",
              "runtime_env_agent": "--runtime-env-agent-port", "metrics_export": "--metrics-export-port",
              "min_worker": "--min-worker-port", "max_worker": "--max-worker-port"}
HEAD_PORT_FLAGS = {"gcs": "--port", "client": "--ray-client-server-port"}
# The head's two metrics exporters take their ports from these variables of `ray start`.
HEAD_PORT_VARIABLES = {"autoscaler_metrics": "AUTOSCALER_METRIC_PORT",
                       "dashboard_metrics": "DASHBOARD_METRIC_PORT"}


@dataclass
class NodePorts:
    """Every port a node listens on for other hosts (docs/multi-host.md section 6)."""

    gcs: int = 6379
    client: int = 10001
    node_manager: int = 6380
    object_manager: int = 6381
    dashboard_agent_grpc: int = 6382
    dashboard_agent_listen: int = 6383
    runtime_env_agent: int = 6384
    metrics_export: int = 6385
    min_worker: int = 11000
    max_worker: int = 11099
    autoscaler_metrics: int = 44217
    dashboard_metrics: int = 44227

    def overridden(self, extra: Sequence[str]) -> NodePorts:
        """These ports with any port flag of `extra` (`--flag=N` or `--flag N`) taken instead."""
        by_flag = {flag: name for name, flag in {**PORT_FLAGS, **HEAD_PORT_FLAGS}.items()}
        values = dict(vars(self))
        for index, argument in enumerate(extra):
            flag, equals, value = argument.partition("=")
            if flag in by_flag:
                value = value if equals else (extra[index + 1] if index + 1 < len(extra) else "")
                if not value.isdigit():
                    raise NodeError(f"{flag} takes a port number, not {value!r}")
                values[by_flag[flag]] = int(value)
        return NodePorts(**values)

    def of_node(self, head: bool) -> set[int]:
        """The ports this node listens on (worker ports included)."""
        names = [*PORT_FLAGS, *(HEAD_PORT_FLAGS if head else ()), *(HEAD_PORT_VARIABLES if head else ())]
        ports = {getattr(self, name) for name in names}
        return ports | set(range(self.min_worker, self.max_worker + 1))


@dataclass
class NodeSpec:
    """What `detached-rl node` starts: the head (`head_address` None) or a worker joining `head_address`."""

    node_ip_address: str
    head_address: str | None = None
    ports: NodePorts = field(default_factory=NodePorts)
    resources: dict[str, float] | None = None
    labels: dict[str, str] | None = None
    num_cpus: float | None = None
    num_gpus: float | None = None
    dashboard: bool = False
    bind_to_address: bool = False  # preload the bind shim (needs a C compiler); else Ray's own binding
    require_token: bool = True
    extra: list[str] = field(default_factory=list)  # more `ray start` options, given after `--`

    @property
    def head(self) -> bool:
        """Whether this is the head node."""
        return self.head_address is None


def check_node_address(address: str, bind_to_address: bool) -> None:
    """Refuse a `--node-ip-address` that names no single address of this host."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError as error:
        raise NodeError(f"--node-ip-address {address!r} is not an IP address (give the address the other "
                        "hosts reach this one at)") from error
    if parsed.is_unspecified:
        raise NodeError(f"--node-ip-address {address} means every interface: give the address the other "
                        "hosts reach this one at")
    if parsed.version == 6 and bind_to_address:
        raise NodeError(f"--node-ip-address {address}: --bind-to-address does not support an IPv6 node "
                        "address; give the node's IPv4 address, or leave out --bind-to-address")
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as error:
            if error.errno == errno.EADDRNOTAVAIL:
                raise NodeError(f"--node-ip-address {address} is not an address of this host (`ip -brief "
                                "address` lists them)") from error
            raise


def check_token(environment: Mapping[str, str], head: bool) -> None:
    """Refuse to start a node without token authentication, naming the variables."""
    if environment.get("RAY_AUTH_MODE", "").strip().lower() != "token":
        raise NodeError("RAY_AUTH_MODE is not 'token': a node of a multi-host cluster runs with token "
                        "authentication (export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN, docs/multi-host.md "
                        "section 1), or add --no-token to run without it")
    path = environment.get("RAY_AUTH_TOKEN_PATH") or str(Path(environment.get("HOME", str(Path.home())))
                                                         / ".ray" / "auth_token")
    if not environment.get("RAY_AUTH_TOKEN", "").strip() and not Path(path).is_file():
        made = ("make one with `ray get-auth-token --generate` (it writes ~/.ray/auth_token) and copy it to "
                "every host" if head else "give it the head's token")
        raise NodeError(f"RAY_AUTH_MODE=token but no token: neither RAY_AUTH_TOKEN nor {path} is set; {made}")


def ray_start_command(spec: NodeSpec, ray: str = "ray") -> list[str]:
    """The `ray start` argv of `spec`."""
    ports = spec.ports
    command = [ray, "start", f"--node-ip-address={spec.node_ip_address}"]
    if spec.head:
        command += ["--head", f"--port={ports.gcs}", f"--ray-client-server-port={ports.client}",
                    f"--include-dashboard={'true' if spec.dashboard else 'false'}"]
    else:
        command.append(f"--address={spec.head_address}")
    command += [f"{flag}={getattr(ports, name)}" for name, flag in PORT_FLAGS.items()]
    if spec.num_cpus is not None:
        command.append(f"--num-cpus={spec.num_cpus:g}")
    if spec.num_gpus is not None:
        command.append(f"--num-gpus={spec.num_gpus:g}")
    if spec.resources:
        command.append(f"--resources={json.dumps(spec.resources)}")
    if spec.labels:
        command.append("--labels=" + ",".join(f"{key}={value}" for key, value in spec.labels.items()))
    return [*command, *spec.extra]


def node_environment(spec: NodeSpec, environment: Mapping[str, str]) -> dict[str, str]:
    """The environment `ray start` runs in: the head's metrics ports pinned; with `bind_to_address` the bind
    shim preloaded (built here, the only step that needs a C compiler)."""
    result = dict(environment)
    if spec.head:
        result.update({variable: str(getattr(spec.ports, name))
                       for name, variable in HEAD_PORT_VARIABLES.items()})
    if not spec.bind_to_address:
        return result
    return preloaded(result, build_bind_shim(environment=environment), spec.node_ip_address,
                     spec.ports.of_node(spec.head))


def describe(spec: NodeSpec, wide: Sequence[tuple[str, int]] = ()) -> str:
    """What the started node listens on, for the user: with `bind_to_address` its own address; else the
    node's ports found on all interfaces (`wide`) and every port a firewall must guard."""
    ports = spec.ports
    guarded = port_ranges(ports.of_node(spec.head))  # worker ports included
    role = f"{'head' if spec.head else 'worker'} node started on {spec.node_ip_address}"
    if spec.bind_to_address:
        lines = [f"{role}, listening on {spec.node_ip_address} and 127.0.0.1 only: ports {guarded}"]
    else:
        found = port_ranges(port for _, port in wide) or "none yet"
        lines = [f"{role}, with Ray's own binding: on all interfaces at ports {found}",
                 f"a firewall must let only the cluster's hosts reach ports {guarded} (docs/multi-host.md "
                 "section 6); --bind-to-address binds them to the node's address instead"]
    if spec.head:
        lines.append("join it from another host: detached-rl node --address "
                     f"{spec.node_ip_address}:{ports.gcs} --node-ip-address <that host's address>")
        lines.append(f"jobs: --address {spec.node_ip_address}:{ports.gcs} on a node, "
                     f"--address ray://{spec.node_ip_address}:{ports.client} from anywhere")
    return "\n".join(lines)


Runner = Callable[..., subprocess.CompletedProcess[str]]


def start_node(spec: NodeSpec, environment: Mapping[str, str] | None = None, runner: Runner = subprocess.run,
               proc_net: Path = Path("/proc/self/net")) -> str:
    """Start the node of `spec` with `ray start`, read which of its ports listen on all interfaces and return
    what it listens on. Raises `NodeError` (naming the option, variable or socket) where it cannot start, or
    where a node started with `bind_to_address` listens on all interfaces."""
    environment = dict(os.environ if environment is None else environment)
    spec = dataclasses.replace(spec, ports=spec.ports.overridden(spec.extra))  # the caller's stays as given
    if "--block" in spec.extra:
        raise NodeError("--block is not taken after `--`: detached-rl node returns once the node runs and "
                        "its sockets are checked (run it under your supervisor, or use ray start --block)")
    check_node_address(spec.node_ip_address, spec.bind_to_address)
    if spec.require_token:
        check_token(environment, spec.head)
    ray = shutil.which("ray", path=environment.get("PATH")) or "ray"
    command = ray_start_command(spec, ray)
    try:
        result = runner(command, env=node_environment(spec, environment), capture_output=True, text=True,
                        timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        raise NodeError(f"`ray start` did not return within {START_TIMEOUT_S:.0f} s") from error
    if result.returncode != 0:
        raise NodeError(f"`ray start` exited {result.returncode}: "
                        f"{(result.stderr or result.stdout).strip()[-1500:]}")
    wide = wildcard_listeners(spec.ports.of_node(spec.head), proc_net)
    if wide and spec.bind_to_address:
        shown = ", ".join(f"{address}:{port}" for address, port in wide)
        raise NodeError(f"the node started but listens on all interfaces at {shown}: the bind shim did "
                        "not take (is LD_PRELOAD cleared for Ray's processes?); stop it with `ray stop`")
    return describe(spec, wide)
