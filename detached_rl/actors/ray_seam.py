"""Every use of Ray's private internals, in one place: a Ray release is this file to check.

Each function says which internal it touches and why no public API does the job. Everything else in the
package uses Ray's public API only (`tests/test_layout.py` checks that `ray._private`, `ray_constants` and
`_actor_id` appear nowhere else). Tested with the Ray versions `pyproject.toml` admits.
"""

from __future__ import annotations

from typing import Any

import ray


def gcs_actor_table() -> list[Any]:
    """Every actor in the GCS's actor table, dead ones too, as `gcs_pb2.ActorTableData` messages.

    Internal: `ray._private.state.state`'s accessor. The public `ray.util.state.list_actors` goes through
    the dashboard's state API, which `detached-rl` clusters run without (and which a driver cannot count on);
    the GCS answers every driver connected directly. Raises outside such a driver (a Ray client).
    """
    from ray._private.state import state as global_state
    from ray.core.generated import gcs_pb2

    return [gcs_pb2.ActorTableData.FromString(raw)
            for raw in global_state._connect_and_get_accessor().get_actor_table(None, None)]


def open_grpc_channel(address: str) -> Any:
    """A gRPC channel to a Ray GCS or client server at `address`, with Ray's own auth token and TLS settings.

    Internal: `ray._private.grpc_utils.init_grpc_channel`. There is no public way to probe a cluster before
    joining it; joining reports a rejected token only after half a minute of retries.
    """
    from ray._private.grpc_utils import init_grpc_channel

    return init_grpc_channel(address)


def keep_loopback_node_address() -> None:
    """Make a local cluster started in this process keep 127.0.0.1 as its node address.

    Internal: `ray._private.ray_constants.ENABLE_RAY_CLUSTER`, which Ray reads from
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` once, at import; the caller sets the variable too, for the processes
    Ray starts. No public option keeps a loopback address (Ray swaps in the machine's external one).
    """
    from ray._private import ray_constants

    if hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):  # the value taken at import, read at each call
        ray_constants.ENABLE_RAY_CLUSTER = False


def actor_id_hex(handle: Any) -> str:
    """The actor id (hex) of an actor handle.

    Internal: `ActorHandle._actor_id`. A handle has no public id; `ray.get_runtime_context().get_actor_id()`
    gives only the calling actor's own.
    """
    return handle._actor_id.hex()


def actor_node_ip(name: str, namespace: str, timeout: float = 5.0) -> str | None:
    """The IP of the node the named actor lives on (Ray's state API), None if unknown; for messages."""
    try:
        from ray.util.state import get_actor

        node_id = get_actor(actor_id_hex(ray.get_actor(name, namespace=namespace)), timeout=timeout).node_id
        return next((node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id), None)
    except Exception:  # noqa: BLE001 - gone, or the state API is unreachable: the message says unknown
        return None
