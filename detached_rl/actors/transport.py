"""Ray transport: actor names and namespaces, waiting with timeouts, and the weight-chunk wire format.

Actors find each other only by name and namespace (`attach`), never by handles passed
around by a driver, so makers and trainers may start in any order and in separate jobs. A
namespace left out is the caller's own Ray namespace when the driver set one, else `detached_rl`
(`resolve_namespace`).
Every wait here has a timeout. Weight chunks travel as raw byte arrays in pieces (`put_chunk`): each piece
is `ray.put` once and the same references go to every maker, which pulls them a few at a time and fails a
transfer only when it stalls, never because it is slow (`fetch_chunk`, `core.transfer`).
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch

from detached_rl.core.chunk_codec import EncodedChunk, decode_chunk, encode_chunk
from detached_rl.core.namespace import DEFAULT_NAMESPACE
from detached_rl.core.transfer import (
    DEFAULT_PIECE_BYTES,
    DEFAULT_WINDOW,
    ChunkLayout,
    TransferProgress,
    join_pieces,
    pull_pieces,
    split_chunk,
)
from detached_rl.core.weight_sync import ApplyResult, Fetch, WeightUpdate

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


@dataclass(frozen=True)
class PiecedChunk:
    """What a manifest lists for a chunk stored in pieces: its layout, one reference per piece and the node
    IP of the process that stored it (small and picklable: the pieces themselves stay in the object store)."""

    layout: ChunkLayout
    refs: tuple[Any, ...]
    host: str

    @property
    def total_bytes(self) -> int:
        """Bytes of the chunk's tensors."""
        return self.layout.total_bytes


@functools.cache
def node_ip() -> str:
    """This process's node IP ("?" outside Ray)."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only for messages and the same-node shortcut
        return "?"


def put_chunk(chunk: dict[str, torch.Tensor], piece_bytes: int = DEFAULT_PIECE_BYTES,
              compression: str = "auto") -> PiecedChunk:
    """Store a weight chunk in the wire format of `core.chunk_codec`, in pieces of `piece_bytes`, each
    `ray.put` once (shared by every maker without copies); with `compression` "zlib" (or "auto" on a
    cluster of several nodes: `compresses`) each piece is compressed first (`core.wire_compression`)."""
    layout, pieces = split_chunk(encode_chunk(chunk), piece_bytes)
    if compresses(compression):
        refs = _putter().map(lambda index: ray.put(layout.compress(index, pieces[index])), range(len(pieces)))
    else:
        refs = _putter().map(ray.put, pieces)
    return PiecedChunk(layout, tuple(refs), node_ip())


_NODES_CHECKED: list[tuple[float, bool]] = []  # (when, several nodes alive): `compresses`' cache


def compresses(compression: str) -> bool:
    """Whether pieces are compressed: "zlib" always, "none" never, "auto" when the cluster has more than one
    alive node (makers may be across a link; on one node compressing only costs), checked every 30 s."""
    if compression != "auto":
        return compression == "zlib"
    now = time.monotonic()
    if not _NODES_CHECKED or now - _NODES_CHECKED[-1][0] > 30.0:
        try:
            several = sum(bool(node.get("Alive")) for node in ray.nodes()) > 1
        except Exception:  # noqa: BLE001 - outside Ray: one process, nothing to cross
            several = False
        _NODES_CHECKED[:] = [(now, several)]
    return _NODES_CHECKED[-1][1]


@functools.cache
def _putter() -> ThreadPoolExecutor:
    """Threads for `ray.put`: many small puts cost per call, and run in parallel (copies release the GIL)."""
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="put-piece")


def _wait_local(refs: list[Any], timeout: float) -> list[Any]:
    """Those of `refs` whose objects are on this node, waiting up to `timeout` s for one (pulling all)."""
    ready, _ = ray.wait(refs, num_returns=1, timeout=timeout, fetch_local=True)
    return ready


def fetch_chunk(ref: Any, timeout: float, progress: TransferProgress | None = None,
                window: int = DEFAULT_WINDOW) -> dict[str, torch.Tensor]:
    """A chunk stored by `put_chunk` as tensors (read-only memory: verify, then copy).

    Its pieces are pulled `window` at a time; the fetch fails (`TransferStalled`) only when none arrived for
    the stall interval (`progress.stall_s`, else `timeout`) and a fresh wait of half that. A raw reference
    (a plain `ray.put` of an encoded chunk) is read with `ray.get(ref, timeout=timeout)`.
    """
    if not isinstance(ref, PiecedChunk):
        raw = decode_chunk(ray.get(ref, timeout=timeout))
        if progress is not None:
            progress.advance(sum(tensor.nbytes for tensor in raw.values()))
        return raw
    if progress is None:
        progress = TransferProgress("weight chunk", ref.total_bytes, f"stored at {ref.host}", timeout)
    return decode_chunk(_pull(ref, progress, window))


def _pull(ref: PiecedChunk, progress: TransferProgress, window: int = DEFAULT_WINDOW) -> EncodedChunk:
    """The encoded chunk behind `ref`: one `get` when stored on this node, else `pull_pieces`."""
    if ref.host == node_ip() != "?":  # no link to watch, and one `get` costs least
        encoded = join_pieces(ref.layout, ray.get(list(ref.refs), timeout=progress.stall_s))
        progress.advance(ref.total_bytes)
        return encoded
    return pull_pieces(list(ref.refs), ref.layout, _wait_local,
                       lambda piece: ray.get(piece, timeout=progress.stall_s), progress, window)


def put_payload(payload: Any, piece_bytes: int = PUSH_PIECE_BYTES) -> PiecedChunk:
    """Store any picklable object (a push of experiences) in pieces, like `put_chunk`."""
    data = np.frombuffer(pickle.dumps(payload, protocol=5), dtype=np.uint8)
    layout, pieces = split_chunk({"payload": ("uint8", (data.size,), data)}, piece_bytes)
    return PiecedChunk(layout, tuple(ray.put(piece) for piece in pieces), node_ip())


def fetch_payload(ref: PiecedChunk, progress: TransferProgress) -> Any:
    """The object `put_payload` stored, its pieces pulled as `fetch_chunk` pulls a chunk's."""
    return pickle.loads(_pull(ref, progress)["payload"][2].tobytes())


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


def update_progress(update: WeightUpdate, stall_s: float) -> TransferProgress:
    """A `TransferProgress` for pulling `update`: named by version and kind, the trainer's host, its bytes."""
    manifest = update.manifest
    pieced = [ref for ref in update.chunk_refs if isinstance(ref, PiecedChunk)]
    total = sum(ref.total_bytes for ref in pieced) if pieced else manifest.total_bytes
    hosts = ", ".join(sorted({ref.host for ref in pieced})) or "?"
    return TransferProgress(f"weight update v{manifest.version} ({manifest.kind})", total,
                            f"from trainer at {hosts}", stall_s, key=manifest.version)


def tracked_fetch(updates: Sequence[WeightUpdate | None], stall_s: float,
                  track: Callable[[TransferProgress], None] | None = None) -> Fetch:
    """A chunk fetcher for whichever of `updates` a `WeightReceiver` pulls (registration offers several):
    stalls fail it (`fetch_chunk` with `stall_s`), and the progress of the update being pulled is handed to
    `track` when it starts, so the maker can say how its transfer goes."""
    owner = {id(ref): update for update in updates if update is not None for ref in update.chunk_refs}
    progress: dict[int, TransferProgress] = {}

    def fetch(ref: Any) -> dict[str, torch.Tensor]:
        update = owner.get(id(ref))
        if update is None:
            return fetch_chunk(ref, stall_s)
        if id(update) not in progress:
            progress[id(update)] = update_progress(update, stall_s)
            if track is not None:
                track(progress[id(update)])
        tracker = progress[id(update)]
        tracker.resume()  # time spent verifying the previous chunk was this node's, not the link's
        return fetch_chunk(ref, stall_s, tracker)

    return fetch


def ray_fetch(timeout: float) -> Callable[[Any], dict[str, torch.Tensor]]:
    """A chunk fetcher for `WeightReceiver.receive`: `fetch_chunk` with `timeout` as the stall interval."""
    return lambda ref: fetch_chunk(ref, timeout)


def send_weight_update(maker: str, update: WeightUpdate, namespace: str) -> Future:
    """Send `update` to the maker named `maker`; a future of its acknowledgement
    (`LookupError` if no such actor)."""
    try:
        handle = ray.get_actor(maker, namespace=namespace)
    except ValueError:
        raise LookupError(f"no maker named {maker!r} in namespace {namespace!r}") from None
    return handle.apply_weight_update.remote(update).future()


def maker_progress(maker: str, namespace: str) -> Future:
    """A future of the named maker's `transfer_progress` answer (`LookupError` if no such actor)."""
    try:
        handle = ray.get_actor(maker, namespace=namespace)
    except ValueError:
        raise LookupError(f"no maker named {maker!r} in namespace {namespace!r}") from None
    return handle.transfer_progress.remote().future()


def actor_host(name: str, namespace: str, timeout: float = 5.0) -> str | None:
    """The IP of the node the named actor lives on (from Ray's state API), None if unknown; for messages."""
    try:
        from ray.util.state import get_actor

        actor_id = ray.get_actor(name, namespace=namespace)._actor_id.hex()
        node_id = get_actor(actor_id, timeout=timeout).node_id
        return next((node["NodeManagerAddress"] for node in ray.nodes() if node["NodeID"] == node_id), None)
    except Exception:  # noqa: BLE001 - gone, or the state API is unreachable: the message says unknown
        return None


def dispatch_weight_update(update: WeightUpdate, makers: Sequence[str], namespace: str, timeout: float
                           ) -> dict[str, ApplyResult | BaseException]:
    """Send the same update (the same chunk refs) to every maker at once and wait (at most `timeout` s in all)
    for each maker's acknowledgement or error."""
    pending: dict[str, Future] = {}
    results: dict[str, ApplyResult | BaseException] = {}
    for name in makers:
        try:
            pending[name] = send_weight_update(name, update, namespace)
        except LookupError as error:
            results[name] = error
    deadline = time.monotonic() + timeout
    for name, future in pending.items():
        try:
            results[name] = future.result(timeout=max(deadline - time.monotonic(), 0.01))
        except Exception as error:  # noqa: BLE001 - that maker's result
            results[name] = error
    return results
