"""The weight path's Ray wire: chunks stored in pieces in the object store (`put_chunk`, `chunk_store`),
pulled by makers without a deadline while bytes arrive (`fetch_chunk`, `tracked_fetch`), and updates sent
to named makers (`send_weight_update`, `ray_send_update`). The one module of `detached_rl.weights` that
imports Ray.

Each piece is `ray.put` once and the same references go to every maker, which pulls them a few at a time
and fails a transfer only when it stalls, never because it is slow (`core.transfer`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import ray
import torch

from detached_rl.core.chunk_codec import EncodedChunk, decode_chunk, encode_chunk
from detached_rl.core.transfer import (
    DEFAULT_PIECE_BYTES,
    DEFAULT_WINDOW,
    ChunkLayout,
    TransferProgress,
    join_pieces,
    pull_pieces,
    split_chunk,
)
from detached_rl.weights.liveness import MakerLiveness
from detached_rl.weights.push_queue import Locate, SendUpdate, WeightPushQueue
from detached_rl.weights.update import ApplyResult, Fetch, Put, WeightUpdate


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
    return decode_chunk(pull(ref, progress, window))


def pull(ref: PiecedChunk, progress: TransferProgress, window: int = DEFAULT_WINDOW) -> EncodedChunk:
    """The encoded chunk behind `ref`: one `get` when stored on this node, else `pull_pieces`."""
    if ref.host == node_ip() != "?":  # no link to watch, and one `get` costs least
        encoded = join_pieces(ref.layout, ray.get(list(ref.refs), timeout=progress.stall_s))
        progress.advance(ref.total_bytes)
        return encoded
    return pull_pieces(list(ref.refs), ref.layout, _wait_local,
                       lambda piece: ray.get(piece, timeout=progress.stall_s), progress, window)


def chunk_store(piece_bytes: int = DEFAULT_PIECE_BYTES, compression: str = "auto") -> Put:
    """The `put` a trainer stores its chunks with: `put_chunk` in pieces of `piece_bytes`, compressed as
    `compression` says (`TrainerConfig.weight_piece_bytes`, `wire_compression`)."""
    if (piece_bytes, compression) == (DEFAULT_PIECE_BYTES, "auto"):
        return put_chunk
    return functools.partial(put_chunk, piece_bytes=piece_bytes, compression=compression)


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
    """Send `update` to the maker named `maker`; a future of its acknowledgement; `LookupError` if no such
    actor."""
    try:
        handle = ray.get_actor(maker, namespace=namespace)
    except ValueError:
        raise LookupError(f"no maker named {maker!r} in namespace {namespace!r}") from None
    return handle.apply_weight_update.remote(update).future()


def relay_copy(relay: str, update: WeightUpdate, host: str, namespace: str, timeout: float) -> WeightUpdate:
    """The named maker's streaming copy of `update` (`weights.relay`): for each piece, a task on the relay
    that pulls it to the relay's node and returns it there (`relayed_piece`), so makers given this copy pull
    every piece from the relay's `host` as soon as it landed; the same manifest, so they check
    it as the trainer's. `LookupError` if no such actor."""
    try:
        handle = ray.get_actor(relay, namespace=namespace)
    except ValueError:
        raise LookupError(f"no maker named {relay!r} in namespace {namespace!r}") from None

    def piece(ref: Any) -> Any:  # the reference goes in a list: the task waits for it, not Ray before it
        return handle.relay_piece.remote([ref], timeout)

    chunks = [PiecedChunk(ref.layout, tuple(piece(one) for one in ref.refs), host)
              if isinstance(ref, PiecedChunk) else piece(ref) for ref in update.chunk_refs]
    return WeightUpdate(update.manifest, chunks)


def relayed_piece(piece: Sequence[Any], timeout: float) -> Any:
    """A relay's copy of `piece[0]` (a piece of a weight update): pulled to this node and returned, so Ray
    stores the copy here (`relay_copy`); fails after `timeout` s without it."""
    return ray.get(piece[0], timeout=timeout)


def maker_progress(maker: str, namespace: str) -> Future:
    """A future of the named maker's `transfer_progress` answer (`LookupError` if no such actor)."""
    try:
        handle = ray.get_actor(maker, namespace=namespace)
    except ValueError:
        raise LookupError(f"no maker named {maker!r} in namespace {namespace!r}") from None
    return handle.transfer_progress.remote().future()


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


def ray_send_update(namespace: str, timeout: float) -> SendUpdate:
    """A `send_update` for `WeightPublisher.publish`: each update to the named makers in `namespace` at once,
    waiting at most `timeout` s in all for their acknowledgements (`dispatch_weight_update`)."""
    return functools.partial(dispatch_weight_update, namespace=namespace, timeout=timeout)


def ray_push_queue(namespace: str, timeout: float, stall_timeout: float, locate: Locate | None = None,
                   relay_fanout: int = 0, relay_min_bytes: int = 0) -> WeightPushQueue:
    """A trainer's push queue over Ray: updates sent to the named makers in `namespace`, each asked how its
    transfer goes once a push is older than `stall_timeout` (slow or dead?); `locate` names a maker's host;
    `relay_fanout` > 0: makers on other nodes relay updates of `relay_min_bytes` or more to one another
    (`weights.relay`), each relayed
    piece waited for up to `stall_timeout` s. Every maker is asked the same question every 5 s, and named in
    `stats()["silent"]` after 15 s without an answer (`weights.liveness`)."""
    progress = functools.partial(maker_progress, namespace=namespace)
    return WeightPushQueue(functools.partial(send_weight_update, namespace=namespace), timeout,
                           progress=progress, stall_timeout=stall_timeout, locate=locate,
                           relay_fanout=relay_fanout, relay_min_bytes=relay_min_bytes, origin=node_ip(),
                           relay=functools.partial(relay_copy, namespace=namespace, timeout=stall_timeout),
                           liveness=MakerLiveness(progress, interval=5.0, silent_after=15.0))
