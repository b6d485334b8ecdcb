"""Joining a Ray cluster, or starting an embedded one bound to 127.0.0.1: what CLI commands do first."""

from __future__ import annotations

import ipaddress
import logging
import math
import os
import socket
import sys
import threading
import time
from typing import Any

from detached_rl.core.text import first_line


class JobError(RuntimeError):
    """A cluster command failed for a reason the user can act on (the message says which)."""


def check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail fast with a clear message when a `host:port` or `ray://host:port` address does not answer."""
    if address in ("auto", "local") or "://" in address and not address.startswith("ray://"):
        return
    host_port = address.removeprefix("ray://")
    host, _, port = host_port.rpartition(":")
    if not host or not port.isdigit():
        raise JobError(f"address {address!r} is not host:port, ray://host:port or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as error:
        raise JobError(f"cannot reach a Ray cluster at {address} ({error.strerror or error})") from None


TOKEN_HINT = ("set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (or put the token in "
              "~/.ray/auth_token)")
AUTH_PROBE_TIMEOUT = 5.0


def is_local_address(ip: str) -> bool:
    """Whether `ip` is an address of this host (a socket can bind to it)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((ip, 0))
    except OSError:
        return False
    return True


def check_cluster(address: str, timeout: float = AUTH_PROBE_TIMEOUT) -> None:
    """Refuse at once what Ray's own join reports late, vaguely or with a crash: a token the cluster
    rejects (or no token), named with RAY_AUTH_MODE and RAY_AUTH_TOKEN (Ray retries for half a minute or
    more); and a direct address typed on a host that runs no Ray node of the cluster (the driver would
    die on a missing local raylet), pointing to `ray://`."""
    if address in ("auto", "local") or "://" in address and not address.startswith("ray://"):
        return
    import grpc

    try:
        from detached_rl.actors.ray_seam import open_grpc_channel

        channel = open_grpc_channel(address.removeprefix("ray://"))
    except Exception as error:  # noqa: BLE001 - e.g. RAY_AUTH_MODE=token and no token anywhere
        if "token" in str(error).lower():
            raise JobError(f"cannot join the Ray cluster at {address}: {first_line(error)} ({TOKEN_HINT})") \
                from None
        return  # a Ray whose internals moved: its own join says what is wrong
    try:
        if address.startswith("ray://"):
            from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

            ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
            ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=timeout)
            return
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        nodes = stub.GetAllNodeInfo(gcs_service_pb2.GetAllNodeInfoRequest(), timeout=timeout).node_info_list
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.UNAUTHENTICATED:
            return  # busy, starting, another protocol: Ray's own join (bounded by the watchdog) says
        sent = ("its token" if os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "token"
                else "no token (RAY_AUTH_MODE is not 'token')")
        raise JobError(f"the Ray cluster at {address} refused this driver, which sent {sent}: "
                       f"{error.details()} ({TOKEN_HINT})") from None
    finally:
        channel.close()
    alive = sorted({node.node_manager_address for node in nodes if node.state == 0})  # 0: ALIVE
    if alive and not any(is_local_address(ip) for ip in alive):
        head = address.rpartition(":")[0]
        raise JobError(f"no Ray node of the cluster at {address} runs on this host (its nodes: "
                       f"{', '.join(alive)}): a direct address works only on a node of the cluster; from "
                       f"another host use the Ray client, --address ray://{head}:10001 (the head's "
                       "--ray-client-server-port), or start a node here with `ray start --address=...`")


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
CONNECT_TIMEOUT_VARIABLE = "DETACHED_RL_CONNECT_TIMEOUT_S"
DEFAULT_CONNECT_TIMEOUT = 120.0


def seconds_from_environment(variable: str, default: float) -> float:
    """`$variable` as a positive number of seconds (`default` when unset or blank); a `JobError` naming it
    otherwise."""
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise JobError(f"{variable}={raw!r}: must be a positive number of seconds")
    return seconds


def connect_timeout() -> float:
    """Seconds `connect` may take to join a cluster: `$DETACHED_RL_CONNECT_TIMEOUT_S`, else 120."""
    return seconds_from_environment(CONNECT_TIMEOUT_VARIABLE, DEFAULT_CONNECT_TIMEOUT)


def connect(address: str | None, namespace: str, timeout: float | None = None,
            runtime_env: dict[str, Any] | None = None) -> None:
    """Join a running Ray cluster (default: `$RAY_ADDRESS`, else `auto`) in `namespace`.

    Never waits forever: an address that does not answer fails at once, so do a cluster that refuses
    this process's token and a direct address on a host without a node (`check_cluster`); if joining
    takes longer than `timeout` (default: `connect_timeout()`) the process exits with a one-line error
    (Ray retries internally without a bound, in native code that cannot be interrupted). A Ray
    client join starts a server process on the head node, which on a loaded machine can take
    minutes: raise `$DETACHED_RL_CONNECT_TIMEOUT_S` there. `runtime_env`: the job's (`config.shipping`).
    """
    timeout = connect_timeout() if timeout is None else timeout
    if not (math.isfinite(timeout) and timeout > 0):
        raise JobError(f"connect timeout must be a positive number of seconds, got {timeout!r}")
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    check_reachable(address)
    host = address.removeprefix("ray://").rpartition(":")[0]
    if host in LOOPBACK_HOSTS:
        # Otherwise Ray replaces a loopback address by the machine's external one, where a cluster
        # bound to loopback does not listen. Read when ray is imported, so set it first.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # RAY_AUTH_MODE is the user's: with token auth on (RAY_AUTH_MODE=token and RAY_AUTH_TOKEN or
    # ~/.ray/auth_token), Ray reads the token itself when this process joins.
    check_cluster(address)
    import ray

    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout):
            print(f"detached-rl: error: could not join the Ray cluster at {address} within {timeout:.0f} s "
                  f"(a busy machine may need more: set {CONNECT_TIMEOUT_VARIABLE}; with token auth on, check "
                  "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN)", file=sys.stderr, flush=True)
            os._exit(2)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for attempt in range(3):
            try:
                ray.init(address=address, namespace=namespace, log_to_driver=False,
                         logging_level=logging.ERROR, runtime_env=runtime_env)
                break
            except ConnectionError as error:
                # A busy head node can be slow to start the per-client server: try again before giving up.
                client_slow = address.startswith("ray://") and "Initialization failure" in str(error)
                if not client_slow or attempt == 2:
                    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                    hint = ("start one with `ray start --head`, or pass --address; with token auth on, "
                            "RAY_AUTH_MODE=token and the cluster's RAY_AUTH_TOKEN (or ~/.ray/auth_token)")
                    raise JobError(f"cannot connect to a Ray cluster at {address!r}: {first} ({hint})") \
                        from None
                time.sleep(2.0)
    finally:
        done.set()


LOCAL_HOST = "127.0.0.1"
LOCAL_CLUSTER_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# The embedded cluster's node shares its machine with its GCS: no network can cut them apart, and a missed
# health check means only that the machine is busy (a small box running a trainer and makers). Ray's default
# declares the node dead after 5 missed checks 3 s apart, which 2 loaded cores have reached (the whole job
# then fails); 40 checks (about 2 minutes) keep the job through any load that lets it progress at all.
LOCAL_HEALTH_CHECKS = {"health_check_failure_threshold": 40}


def init_local_ray(namespace: str, **options: Any) -> None:
    """Start an embedded single-node Ray bound to 127.0.0.1 (nothing listens on other interfaces).

    RAY_AUTH_MODE is left as the user set it; unset, Ray 2.60 turns token auth on for a new local
    cluster and keeps its token in ~/.ray/auth_token. For a real multi-node cluster, start each node with
    `detached-rl node` (token auth on, ports pinned, bound to the node's private address; docs/multi-host.md).
    """
    # Ray replaces a loopback node address by the machine's external one unless this is "0"; every GCS,
    # raylet, agent and worker socket then binds to that address or to all interfaces. The processes Ray
    # starts read the variable; this one read it when it first imported ray, which may have been before now.
    os.environ[LOCAL_CLUSTER_VARIABLE] = "0"
    import ray

    from detached_rl.actors.ray_seam import keep_loopback_node_address

    keep_loopback_node_address()
    options.setdefault("dashboard_host", LOCAL_HOST)
    options["_system_config"] = {**LOCAL_HEALTH_CHECKS, **options.get("_system_config", {})}
    ray.init(address="local", namespace=namespace, _node_ip_address=LOCAL_HOST, **options)
    node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback:
        ray.shutdown()
        raise JobError(f"the embedded Ray cluster took node address {node_ip}, not 127.0.0.1; refusing "
                       f"to run a cluster reachable from the network (is {LOCAL_CLUSTER_VARIABLE} honoured "
                       "by this Ray?)")


