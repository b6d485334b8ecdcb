"""What the CLI's cluster commands do: connect, start named actors, list, inspect, export, stop.

Plain functions over a connected Ray driver (local, `ray start --head` cluster, or a Ray
client at `ray://host:port`); the CLI adds argument parsing and one-line errors.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from detached_rl.config import RunConfig

DEFAULT_STATUS_TIMEOUT = 10.0


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


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")
CONNECT_TIMEOUT_VARIABLE = "DETACHED_RL_CONNECT_TIMEOUT_S"
DEFAULT_CONNECT_TIMEOUT = 120.0


def connect_timeout() -> float:
    """Seconds `connect` may take to join a cluster: `$DETACHED_RL_CONNECT_TIMEOUT_S`, else 120."""
    raw = os.environ.get(CONNECT_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return DEFAULT_CONNECT_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise JobError(f"{CONNECT_TIMEOUT_VARIABLE}={raw!r}: must be a positive number of seconds")
    return seconds


def connect(address: str | None, namespace: str, timeout: float | None = None) -> None:
    """Join a running Ray cluster (default: `$RAY_ADDRESS`, else `auto`) in `namespace`.

    Never waits forever: an address that does not answer fails at once, and if joining takes
    longer than `timeout` (default: `connect_timeout()`) the process exits with a one-line error
    (Ray retries internally without a bound, in native code that cannot be interrupted). A Ray
    client join starts a server process on the head node, which on a loaded machine can take
    minutes: raise `$DETACHED_RL_CONNECT_TIMEOUT_S` there.
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
    import ray

    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout):
            print(f"detached-rl: error: could not join the Ray cluster at {address} within {timeout:.0f} s "
                  f"(a busy machine may need more: set {CONNECT_TIMEOUT_VARIABLE}; with token auth on, check "
                  "RAY_AUTH_TOKEN)", file=sys.stderr, flush=True)
            os._exit(2)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for attempt in range(3):
            try:
                ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.ERROR)
                break
            except ConnectionError as error:
                # A busy head node can be slow to start the per-client server: try again before giving up.
                if not (address.startswith("ray://") and "Initialization failure" in str(error)) or attempt == 2:
                    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                    hint = ("start one with `ray start --head`, or pass --address; with token auth on, "
                            "RAY_AUTH_MODE=token and the cluster's RAY_AUTH_TOKEN (or ~/.ray/auth_token)")
                    raise JobError(f"cannot connect to a Ray cluster at {address!r}: {first} ({hint})") from None
                time.sleep(2.0)
    finally:
        done.set()


LOCAL_HOST = "127.0.0.1"
LOCAL_CLUSTER_VARIABLE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def init_local_ray(namespace: str, **options: Any) -> None:
    """Start an embedded single-node Ray bound to 127.0.0.1 (nothing listens on other interfaces).

    RAY_AUTH_MODE is left as the user set it; unset, Ray 2.60 turns token auth on for a new local
    cluster and keeps its token in ~/.ray/auth_token. For a real multi-node cluster, start it with
    `ray start --head --node-ip-address=<private address>` on a trusted network and token auth
    (docs/operations.md#security).
    """
    # Ray replaces a loopback node address by the machine's external one unless this is "0"; every GCS, raylet,
    # agent and worker socket then binds to that address or to all interfaces. The processes Ray starts read
    # the variable; this one read it when it first imported ray, which may have been before now.
    os.environ[LOCAL_CLUSTER_VARIABLE] = "0"
    import ray
    from ray._private import ray_constants

    if hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # the value taken at import, read at each call
        ray_constants.ENABLE_RAY_CLUSTER = False
    options.setdefault("dashboard_host", LOCAL_HOST)
    ray.init(address="local", namespace=namespace, _node_ip_address=LOCAL_HOST, **options)
    node_ip = ray.util.get_node_ip_address()
    if not ipaddress.ip_address(node_ip).is_loopback:
        ray.shutdown()
        raise JobError(f"the embedded Ray cluster took node address {node_ip}, not 127.0.0.1; refusing to run a "
                       f"cluster reachable from the network (is {LOCAL_CLUSTER_VARIABLE} honoured by this Ray?)")


DEFAULT_START_TIMEOUT = 600.0


def check_placeable(requests: dict[str, dict[str, float]]) -> None:
    """Refuse at once, as a JobError naming the role and the resources, what the cluster can never place."""
    from detached_rl.actors.launch import check_placeable as check
    from detached_rl.core.resources import UnplaceableError

    try:
        check(requests)
    except UnplaceableError as error:
        raise JobError(str(error)) from None


def _started_in_time(refs: list[Any], what: str, request: dict[str, float], timeout: float) -> list[Any]:
    """The answers of the first calls to new actors; if they do not come within `timeout`, a JobError naming
    `what` and the resources it asked for (an actor Ray cannot place yet never answers)."""
    import ray

    from detached_rl.actors.transport import get_all
    from detached_rl.core.resources import describe

    try:
        return get_all(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        free = ray.available_resources()
        raise JobError(f"{what} (asking for {describe(request)}) did not start within {timeout:.0f} s; the cluster "
                       f"has {describe({k: free.get(k, 0.0) for k in sorted({'CPU', 'GPU', *request})})} free") from None


def start_trainer(config: RunConfig, name: str, total_steps: int, update_steps: int,
                  timeout: float = DEFAULT_START_TIMEOUT, **checkpointing: Any) -> list[str]:
    """Create a detached, named trainer (or trainer group) and start `fit` in the background; returns rank names.

    PPO or GRPO by `config.algorithm`. With `config.trainer_group` asking for more than one rank
    or a distributed strategy, the ranks are `<name>_0` ... in one placement group. A request the
    cluster can never place is refused at once; placing and starting take at most `timeout` s.
    """
    import ray

    from detached_rl.actors.launch import launch_requests, launch_trainers, trainer_names_of, trainer_request

    names = trainer_names_of(config, name)
    for rank_name in names:
        _refuse_existing(rank_name, config.namespace)
    check_placeable(launch_requests(config, trainer=name))
    deadline = time.monotonic() + timeout
    try:
        handles = launch_trainers(config, name, timeout=timeout)
    except ray.exceptions.RayTaskError as error:  # a group rank's own error (e.g. a strategy that needs CUDA)
        raise JobError(f"trainer group {name!r} did not start: {_first_line(error.cause)}") from None
    except TimeoutError as error:  # a group that could not be placed
        raise JobError(str(error)) from None
    try:
        _started_in_time([h.start_fit.remote(total_steps, update_steps, **checkpointing) for h in handles],
                         f"trainer {name!r}", trainer_request(config), max(1.0, deadline - time.monotonic()))
    except JobError:
        stop(names, config.namespace, force=True, timeout=10)  # detached: it would wait for resources forever
        raise
    return names


def start_maker(config: RunConfig, name: str, trainers: list[str], num_batches: int | None,
                state_dir: str | None = None, shard: tuple[int, int] = (0, 1),
                timeout: float = DEFAULT_START_TIMEOUT) -> Any:
    """Create a detached, named experience maker feeding `trainers` and start it in the background.

    With `state_dir`, the maker saves its prompt cursor and counters to `<state_dir>/<name>` after
    every pushed batch and resumes from there when it (or a successor under its name) starts.
    `shard` = (index, count): the maker takes that share of the prompts. A request the cluster can
    never place is refused at once; placing and starting take at most `timeout` s (then the maker is removed).
    """
    import ray

    from detached_rl.actors.launch import launch_maker, launch_requests, maker_request

    if not trainers:
        raise JobError("a maker needs --trainers (comma-separated trainer names)")
    _refuse_existing(name, config.namespace)
    check_placeable(launch_requests(config, makers=[name]))
    handle = launch_maker(config, name, trainers, shard,
                          state_path=str(Path(state_dir).resolve() / name) if state_dir else None)
    try:
        _started_in_time([handle.start.remote(num_batches)], f"maker {name!r}", maker_request(config), timeout)
    except JobError:
        ray.kill(handle, no_restart=True)  # detached: it would otherwise wait for resources, and run, forever
        raise
    return handle


def start_scorers(config: RunConfig, trainers: list[str], timeout: float | None = None) -> list[str]:
    """Start the scorer groups the makers' config names (`maker.<role>_scorer`); returns the worker names.

    Each group is shaped and placed by `config.scorers.<role>`; a critic group takes its weights
    from `trainers`. A group whose first worker already runs is left as it is (shared by makers).
    Groups the cluster can never place are refused at once, before any starts; each group's
    placement waits at most `timeout` s (and its `timeout_s`).
    """
    import ray

    from detached_rl.actors.launch import launch_requests, launch_scorer_group
    from detached_rl.actors.scorer import scorer_names

    started: list[str] = []
    missing = []
    for role, prefix in config.maker.scorers.items():
        group = getattr(config.scorers, role)
        try:
            ray.get_actor(scorer_names(prefix, group.num_workers)[0], namespace=config.namespace)
        except ValueError:
            missing.append(role)
    check_placeable(launch_requests(config, scorer_roles=missing))
    deadline = None if timeout is None else time.monotonic() + timeout
    for role in missing:
        prefix = config.maker.scorers[role]
        names = scorer_names(prefix, getattr(config.scorers, role).num_workers)
        if role == "critic" and not trainers:
            raise JobError("a critic scorer group needs the trainer names (its weights come from them)")
        left = None if deadline is None else max(1.0, deadline - time.monotonic())
        try:
            launch_scorer_group(config, role, trainers, timeout=left)
        except ray.exceptions.RayTaskError as error:
            raise JobError(f"scorer group {prefix!r} ({role}) did not start: {_first_line(error.cause)}") from None
        except TimeoutError as error:
            raise JobError(str(error)) from None
        started.extend(names)
    return started


def _refuse_existing(name: str, namespace: str) -> None:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return
    raise JobError(f"an actor named {name!r} already runs in namespace {namespace!r} (stop it first)")


def actor_names(namespace: str) -> list[str]:
    """Names of the live named actors in `namespace`."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)


def handle_of(name: str, namespace: str) -> Any:
    """The named actor's handle, or a JobError naming it and listing what exists."""
    import ray

    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        known = ", ".join(actor_names(namespace)) or "none"
        raise JobError(f"no actor named {name!r} in namespace {namespace!r} (actors there: {known})") from None


def status_of(name: str, namespace: str, timeout: float = DEFAULT_STATUS_TIMEOUT) -> dict[str, Any]:
    """An actor's status, or a row saying why it did not answer."""
    import ray

    try:
        return ray.get(handle_of(name, namespace).status.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        return {"name": name, "role": "?", "state": "unresponsive", "last_error": f"no answer within {timeout:.0f} s"}
    except ray.exceptions.RayActorError as error:
        return {"name": name, "role": "?", "state": "dead", "last_error": _first_line(error)}


def all_status(namespace: str) -> list[dict[str, Any]]:
    """Status rows of every named actor in the namespace, then of named actors that died there (not replaced).

    Actors removed on purpose (`ray.kill`, as `detached-rl stop` does) are gone, not dead: they are not listed.
    """
    live = actor_names(namespace)
    table = actor_table(namespace)
    rows = []
    for name in live:
        if table.get(name, {}).get("state") == "RESTARTING":
            rows.append({"name": name, "role": table[name]["role"], "state": "restarting",
                         "last_error": table[name]["death_cause"]})
        else:
            rows.append(status_of(name, namespace))
    for name, entry in sorted(table.items()):
        if name not in live and entry["state"] == "DEAD" and not entry["killed_on_purpose"]:
            rows.append({"name": name, "role": entry["role"], "state": "dead", "last_error": entry["death_cause"],
                         "restarts": entry["restarts"]})
    return rows


ROLES = {"ExperienceMakerHolder": "maker", "PPOTrainerShell": "trainer", "GRPOTrainerShell": "trainer",
         "ScorerWorker": "scorer"}


def actor_table(namespace: str) -> dict[str, dict[str, Any]]:
    """The newest actor of each name in `namespace` from Ray's actor table (dead ones too): state, role, cause.

    Reads the GCS directly (Ray's state API needs the dashboard); through a Ray client, where that
    is not possible, it returns {} and `status` shows live actors only.
    """
    try:
        from ray._private.state import state as global_state
        from ray.core.generated import common_pb2, gcs_pb2

        raw_table = global_state._connect_and_get_accessor().get_actor_table(None, None)
    except Exception:  # noqa: BLE001 - a Ray client, or a Ray whose internals moved: live actors only
        return {}
    newest: dict[str, dict[str, Any]] = {}
    for raw in raw_table:
        data = gcs_pb2.ActorTableData.FromString(raw)
        if data.ray_namespace != namespace or not data.name:
            continue
        died = data.death_cause.actor_died_error_context if data.HasField("death_cause") else None
        cause = died.error_message if died is not None else ""
        killed_on_purpose = died is not None and died.reason == common_pb2.ActorDiedErrorContext.Reason.RAY_KILL
        entry = {"state": gcs_pb2.ActorTableData.ActorState.Name(data.state),
                 "role": ROLES.get(data.class_name, data.class_name or "?"),
                 "death_cause": cause.split(". ")[0] if cause else "", "killed_on_purpose": killed_on_purpose,
                 "restarts": int(data.num_restarts),
                 "started": int(data.start_time)}
        if data.name not in newest or entry["started"] >= newest[data.name]["started"]:
            newest[data.name] = entry
    return newest


def format_status(rows: list[dict[str, Any]]) -> str:
    """Status rows as an aligned table."""
    if not rows:
        return "no detached-rl actors in this namespace"
    header = ("name", "role", "state", "version", "steps", "buffer", "samples/s", "last error")
    table = [header]
    for row in rows:
        trainer = row.get("role") == "trainer"
        buffer = f"{row.get('buffer_size', 0)}/{row.get('buffer_max_samples', '?')}" if trainer else "-"
        steps = str(row.get("steps" if trainer else "batches", ""))
        if trainer and row.get("skipped_steps"):
            steps += f" ({row['skipped_steps']} skipped)"
        behind = row.get("makers_behind") or {}
        if trainer and behind:  # makers trailing by more than max_staleness versions (the trainer goes on)
            steps += " (behind: " + ", ".join(f"{m} by {lag}" for m, lag in sorted(behind.items())) + ")"
        version = str(row.get("policy_version", ""))
        pending = (row.get("weight_updates") or {}).get("pending_version")
        if pending is not None:  # verified, swapped in when the batch under way ends
            version += f" (v{pending} next)"
        rate = row.get("samples_per_s") or 0.0
        table.append((
            str(row.get("name", "?")), str(row.get("role", "?")), str(row.get("state", "?")),
            version, str(steps), buffer, f"{rate:.1f}",
            _first_line(row.get("last_error") or "")[:60],
        ))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table)


def inspect(name: str, namespace: str, last: int, maker: str | None, min_reward: float | None) -> dict[str, Any]:
    """Buffer statistics and the newest samples (decoded) of a trainer."""
    import ray

    handle = handle_of(name, namespace)
    try:
        stats = ray.get(handle.buffer_stats.remote(), timeout=DEFAULT_STATUS_TIMEOUT)
        samples = ray.get(handle.buffer_peek.remote(last, maker, min_reward), timeout=DEFAULT_STATUS_TIMEOUT)
    except AttributeError:
        raise JobError(f"{name!r} is not a trainer (it has no replay buffer)") from None
    return {"name": name, "stats": stats, "samples": samples}


def format_inspection(report: dict[str, Any]) -> str:
    """An inspection report as text."""
    stats = report["stats"]
    reward = stats["reward"]
    lines = [
        f"{report['name']}: {stats['size']} samples / {stats['max_samples']}, {stats['bytes'] / 2**20:.2f} MiB "
        f"(received {stats['received']}, sampled {stats['sampled']}, dropped {stats['dropped']}, "
        f"duplicates {stats['duplicates']}, accounting {'ok' if stats['accounting_ok'] else 'BROKEN'})",
        "staleness (policy version: samples): " + (
            ", ".join(f"v{v}: {n}" for v, n in stats["staleness"].items()) or "-"),
        "per maker: " + (", ".join(f"{m}: {c['in_buffer']} in buffer / {c['received']} received"
                                   for m, c in stats["per_maker"].items()) or "-"),
        "reward: " + ("-" if reward["mean"] is None else
                      f"mean {reward['mean']:.3f} std {reward['std']:.3f} min {reward['min']:.3f} "
                      f"max {reward['max']:.3f}"),
    ]
    for sample in report["samples"]:
        lines.append(f"- [{sample['maker']} v{sample['policy_version']} reward {sample['score']:.3f}] "
                     f"{sample.get('prompt_text', '')!r} -> {sample.get('response_text', '')!r}")
    return "\n".join(lines)


def export(name: str, namespace: str, path: Path, page: int = 256) -> int:
    """Write a trainer's buffer to JSONL (or Parquet for a .parquet path); returns the number of samples."""
    import ray

    handle = handle_of(name, namespace)
    rows: list[dict[str, Any]] = []
    start = 0
    while True:
        batch = ray.get(handle.buffer_export.remote(start, page), timeout=60)
        rows.extend(batch)
        start += len(batch)
        if len(batch) < page:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise JobError("writing Parquet needs pyarrow (pip install pyarrow); use a .jsonl path instead") from None
        for row in rows:
            row["info"] = json.dumps(row["info"])
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w") as handle_out:
            for row in rows:
                handle_out.write(json.dumps(row) + "\n")
    return len(rows)


def stop(names: list[str], namespace: str, force: bool, timeout: float) -> list[str]:
    """Stop actors (makers first, then trainers): drain gracefully, then kill; returns what was stopped."""
    import ray

    names = names or actor_names(namespace)
    rows = {name: status_of(name, namespace) for name in names}
    ordered = sorted(names, key=lambda n: rows[n].get("role") == "trainer")  # makers first
    stopped = []
    for name in ordered:
        handle = handle_of(name, namespace)
        if not force and rows[name].get("state") not in ("dead", "unresponsive"):
            try:
                ray.get(handle.stop.remote(), timeout=timeout)
                _wait_until_idle(name, namespace, timeout)
                if rows[name].get("role") == "trainer":
                    ray.get(handle.shutdown.remote(), timeout=timeout)
            except Exception as error:  # noqa: BLE001 - fall through to kill, and say so
                logging.getLogger(__name__).warning("%s did not stop gracefully: %s", name, _first_line(error))
        ray.kill(handle, no_restart=True)
        stopped.append(name)
    _remove_placement_groups_of(stopped, namespace)
    return stopped


def _remove_placement_groups_of(stopped: list[str], namespace: str) -> None:
    """Remove the placement group of each actor group (trainer ranks, scorer workers) whose workers are now all gone."""
    from detached_rl.actors.group import remove_placement_groups_left_empty

    remove_placement_groups_left_empty(stopped, actor_names(namespace))


def _wait_until_idle(name: str, namespace: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = status_of(name, namespace).get("state")
        if state not in ("running", "training"):
            return
        time.sleep(0.2)


def _first_line(value: Any) -> str:
    text = str(value).strip()
    return text.splitlines()[0] if text else ""
