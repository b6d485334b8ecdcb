"""Ray transport: actor names and namespaces, waiting with timeouts, experience pushes in pieces.

Actors find each other only by name and namespace (`attach`), never by handles passed
around by a driver, so makers and trainers may start in any order and in separate jobs. A
namespace left out is the caller's own Ray namespace when the driver set one, else `detached_rl`
(`resolve_namespace`).
Every wait here has a timeout. Big experience pushes travel in pieces (`put_payload`), on the weight path's
wire (`detached_rl.weights.ray_wire`, which also holds everything that stores, fetches and sends weights).
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray

from detached_rl.actors.ray_seam import actor_node_ip
from detached_rl.core.namespace import DEFAULT_NAMESPACE
from detached_rl.core.transfer import TransferProgress, split_chunk
from detached_rl.weights.ray_wire import PiecedChunk, node_ip, pull

logger = logging.getLogger(__name__)

PUSH_PIECE_BYTES = 256 * 1024  # a push's pieces: 0.4 s each at 5 Mbit/s
PIECED_PUSH_BYTES = 1 << 20  # pushes bigger than this travel in pieces; smaller ones inside the call



def _anonymous(namespace: str) -> bool:
    """True for the namespace Ray makes up for a driver that named none (`ray.init()`): a random uuid4."""
    try:
        parsed = uuid.UUID(namespace)
    except ValueError:
        return False
    return parsed.version == 4 and str(parsed) == namespace


def default_namespace() -> str:
    """Where actors meet when no namespace is given: the Ray job's namespace when one was set, else
    `DEFAULT_NAMESPACE`. In a driver that is its `ray.init(namespace=...)`; inside an actor, the namespace of
    the driver that created it (Ray reports the job's, not the actor's own `.options(namespace=...)`)."""
    if ray.is_initialized():
        current = ray.get_runtime_context().namespace
        if current and not _anonymous(current):
            return current
    return DEFAULT_NAMESPACE


def resolve_namespace(namespace: str | None) -> str:
    """`namespace`, or `default_namespace()` when it is None or empty."""
    return namespace or default_namespace()


def get_all(refs: Sequence[Any], timeout: float) -> list[Any]:
    """`ray.get` of every ref within `timeout`; on errors, raise the first only after all were retrieved.

    A plain `ray.get(list)` raises at the first failed ref and leaves the others unretrieved, so Ray
    later logs their errors as unhandled (a second traceback on the user's terminal).
    """
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    results: list[Any] = []
    first_error: BaseException | None = None
    for ref in refs:
        if ref not in ready:
            continue
        try:
            results.append(ray.get(ref))
        except Exception as error:  # noqa: BLE001 - raised below, after every ref was retrieved
            first_error = first_error or error
    if first_error is not None:
        raise first_error
    if pending:
        raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} calls did not finish within "
                                             f"{timeout:.0f} s")
    return results


def attach(name: str, namespace: str | None = None, timeout: float = 60.0, poll_interval: float = 0.2):
    """The handle of the named actor, waiting up to `timeout` s for it to exist
    (namespace: `resolve_namespace`)."""
    namespace = resolve_namespace(namespace)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no actor named {name!r} in Ray namespace {namespace!r} after {timeout:.1f} s "
                    "(is it started, and in this namespace?)"
                ) from None
            time.sleep(poll_interval)


def put_payload(payload: Any, piece_bytes: int = PUSH_PIECE_BYTES) -> PiecedChunk:
    """Store any picklable object (a push of experiences) in pieces, like `put_chunk`."""
    data = np.frombuffer(pickle.dumps(payload, protocol=5), dtype=np.uint8)
    layout, pieces = split_chunk({"payload": ("uint8", (data.size,), data)}, piece_bytes)
    return PiecedChunk(layout, tuple(ray.put(piece) for piece in pieces), node_ip())


def fetch_payload(ref: PiecedChunk, progress: TransferProgress) -> Any:
    """The object `put_payload` stored, its pieces pulled as `fetch_chunk` pulls a chunk's."""
    return pickle.loads(pull(ref, progress)["payload"][2].tobytes())


class IncomingPushes:
    """A trainer's side of pushes that travel in pieces: pulls them (failing only on stalls) and says how the
    ones from a maker are arriving (`progress`), for the maker's pusher to tell slow from dead."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._transfers: dict[str, list[TransferProgress]] = {}

    def pull(self, payload: PiecedChunk, maker: str, stall_s: float) -> Any:
        """The push behind `payload` (from `maker`), its progress shown while it arrives."""
        progress = TransferProgress(f"experience push of {payload.total_bytes / 1e6:.2f} MB from maker "
                                    f"{maker!r}", payload.total_bytes, f"from {payload.host}", stall_s)
        with self._lock:
            self._transfers.setdefault(maker, []).append(progress)
        try:
            return fetch_payload(payload, progress)
        finally:
            with self._lock:
                self._transfers[maker].remove(progress)

    def progress(self, maker: str) -> dict[str, Any]:
        """This node's IP and the transfers from `maker` under way (`TransferProgress.snapshot`)."""
        with self._lock:
            transfers = list(self._transfers.get(maker, ()))
        return {"host": node_ip(), "transfers": [transfer.snapshot() for transfer in transfers]}


def actor_host(name: str, namespace: str, timeout: float = 5.0) -> str | None:
    """The IP of the node the named actor lives on (from Ray's state API), None if unknown; for messages."""
    return actor_node_ip(name, namespace, timeout)
