"""Placing a new detached actor: wait a bounded time for Ray to give it a node, else say why it has none.

An actor Ray cannot place waits in its table as PENDING_CREATION without a process, for ever; a
maker lost with its node waits as RESTARTING for a node with its resources, and takes the first
one that joins. So a job that starts an actor waits for its placement at most
`placement_timeout()` s and then fails naming what it asked for, what is free, and which actors
wait for the same custom resources (a restarting maker is the usual one). A maker job started
under the name of a restarting maker takes that name over (`take_over_restarting`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from detached_rl.cli.cluster import JobError, seconds_from_environment
from detached_rl.core.resources import describe

PLACEMENT_TIMEOUT_VARIABLE = "DETACHED_RL_PLACEMENT_TIMEOUT"
DEFAULT_PLACEMENT_TIMEOUT = 120.0
POLL_S = 0.5
# Actor states in which an actor has no process yet and waits for a node.
WAITING_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "RESTARTING")


@dataclass
class ActorRow:
    """One actor of Ray's actor table: its name, state, whether it has a process, what it asks for."""

    name: str
    state: str
    placed: bool
    required: dict[str, float] = field(default_factory=dict)
    started: int = 0

    @property
    def waiting(self) -> bool:
        """True while it waits for a node (restarting, or pending without a process)."""
        return self.state == "RESTARTING" or (self.state in WAITING_STATES and not self.placed)


def placement_timeout() -> float:
    """Seconds a job waits for its actors to be placed: `$DETACHED_RL_PLACEMENT_TIMEOUT`, default 120."""
    return seconds_from_environment(PLACEMENT_TIMEOUT_VARIABLE, DEFAULT_PLACEMENT_TIMEOUT)


def read_rows(namespace: str) -> list[ActorRow]:
    """The named actors of `namespace` in Ray's actor table, read from the GCS (a driver connected
    directly)."""
    from ray.core.generated import gcs_pb2

    from detached_rl.actors.ray_seam import gcs_actor_table

    rows = []
    for data in gcs_actor_table():
        if data.ray_namespace != namespace or not data.name:
            continue
        rows.append(ActorRow(data.name, gcs_pb2.ActorTableData.ActorState.Name(data.state),
                             placed=data.pid != 0, required=dict(data.required_resources),
                             started=int(data.start_time)))
    return rows


def actor_rows(namespace: str) -> list[ActorRow] | None:
    """`read_rows` here, or through a small task in the cluster for a Ray client; None if neither works."""
    import ray

    try:
        return read_rows(namespace)
    except Exception:  # noqa: BLE001 - a Ray client cannot read the GCS: ask a task in the cluster
        pass
    try:
        return ray.get(ray.remote(num_cpus=0)(read_rows).remote(namespace), timeout=30)
    except Exception:  # noqa: BLE001 - a Ray whose internals moved: placement is bounded by the start timeout
        return None


def newest(rows: list[ActorRow], name: str) -> ActorRow | None:
    """The row of the actor now named `name`: the one not dead (a name's earlier, dead actors stay in the
    table; an actor not started yet has no start time), else the newest."""
    named = [row for row in rows if row.name == name]
    return max(named, key=lambda row: (row.state != "DEAD", row.started)) if named else None


def why_unplaced(what: str, name: str, request: dict[str, float], rows: list[ActorRow],
                 free: dict[str, float], waited: float) -> str:
    """One message: `what` was not placed within `waited` s, what is free, who waits for the same
    resources."""
    custom = {key for key in request if key not in ("CPU", "GPU")}
    rivals = sorted(row.name for row in rows if row.name != name and row.waiting
                    and custom & set(row.required))
    left = describe({key: free.get(key, 0.0) for key in ("CPU", "GPU", *sorted(custom))})
    message = (f"{what} (asking for {describe(request)}) did not start within {waited:.0f} s; the cluster "
               f"has {left} free")
    if rivals:
        listed = ", ".join(repr(rival) for rival in rivals)
        message += (f"; waiting for the same resources: {listed} (restarting after its node was lost, it "
                    "takes the next node that has them): start this maker under that name to take its "
                    f"place, or `detached-rl stop {rivals[0]}`")
    return message


def wait_placed(what: str, name: str, namespace: str, request: dict[str, float], timeout: float,
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until Ray gave actor `name` a process on a node; after `timeout` s, a JobError saying why not."""
    import ray

    start = clock()
    while True:
        rows = actor_rows(namespace)
        row = None if rows is None else newest(rows, name)
        if row is None or not row.waiting:
            return  # placed, dead (its start call says why), or not readable (the start timeout bounds it)
        if clock() - start >= timeout:
            raise JobError(why_unplaced(what, name, request, rows or [], ray.available_resources(),
                                        clock() - start))
        sleep(POLL_S)


def take_over_restarting(name: str, namespace: str, timeout: float = 30.0) -> bool:
    """Remove the actor `name` if Ray is restarting it (its process or node was lost), so that a new job may
    start under its name; True if one was removed. A live actor is left alone."""
    import ray

    rows = actor_rows(namespace)
    row = None if rows is None else newest(rows, name)
    if row is None or row.state != "RESTARTING":
        return False
    try:
        ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    except ValueError:
        return False  # gone meanwhile
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return True
        time.sleep(POLL_S)
    raise JobError(f"the restarting actor {name!r} was killed but its name was not released within "
                   f"{timeout:.0f} s")

