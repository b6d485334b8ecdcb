"""Transfers that tell slow from dead: an encoded chunk in pieces, progress, and the stall that fails one.

A weight chunk (`core.chunk_codec`) can be hundreds of MB; over a thin link one fetch of it takes minutes,
so a fixed deadline either fails a healthy transfer or waits long for a dead one. Here a chunk is split
into pieces of `piece_bytes` (`split_chunk`) that travel on their own and are joined back exactly
(`PieceJoiner`); `pull_pieces` fetches them a few at a time and fails only when no piece arrived for the
stall interval, and once more after a fresh wait of half that (`TransferStalled`): a stalled transfer fails
within 1.5x the stall interval, a progressing one never. `TransferProgress` is what both sides report
(bytes done of total, rate) and what a trainer asks a maker for while its push is in flight. Plain code: the
Ray wing (`actors.transport`) passes the `wait` and `get` functions.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from detached_rl.core.chunk_codec import EncodedChunk
from detached_rl.core.limits import check_stall_s as check_stall_s
from detached_rl.core.wire_compression import CompressedPiece, compress_piece, element_size, expand_piece

DEFAULT_PIECE_BYTES = 1 << 20
DEFAULT_STALL_S = 30.0
DEFAULT_WINDOW = 2  # pieces requested at once: enough to keep a link busy, few enough that each lands soon

# One piece on the wire: the byte ranges (uint8 views, no copies) of the tensors it covers, in order.
Piece = tuple[np.ndarray, ...]


class TransferStalled(TimeoutError):
    """A transfer that made no progress for its stall interval; the message names what, bytes, rate, host."""


@dataclass(frozen=True)
class ChunkLayout:
    """What a chunk in pieces holds: (name, dtype, shape, bytes) per tensor, in stream order, and the
    piece size."""

    tensors: tuple[tuple[str, str, tuple[int, ...], int], ...]
    piece_bytes: int

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors together."""
        return sum(entry[3] for entry in self.tensors)

    @property
    def num_pieces(self) -> int:
        """How many pieces carry them (at least one, so an empty chunk still travels)."""
        return max(1, math.ceil(self.total_bytes / self.piece_bytes))

    def piece_size(self, index: int) -> int:
        """Bytes in piece `index`."""
        return min(self.piece_bytes, self.total_bytes - index * self.piece_bytes) if self.total_bytes else 0

    def element_sizes(self, index: int) -> tuple[int, ...]:
        """Bytes per element of the tensor behind each segment of piece `index` (for byte planes)."""
        return tuple(element_size(self.tensors[position][1]) for position, _, _ in self.segments(index))

    def compress(self, index: int, piece: Piece) -> CompressedPiece:
        """Piece `index` compressed for the wire (`core.wire_compression`)."""
        return compress_piece(piece, self.element_sizes(index))

    def segments(self, index: int) -> list[tuple[int, int, int]]:
        """(tensor index, offset in the tensor, length) of each byte range piece `index` holds, in order."""
        start, end = index * self.piece_bytes, min((index + 1) * self.piece_bytes, self.total_bytes)
        found, offset = [], 0
        for position, entry in enumerate(self.tensors):
            size = entry[3]
            low, high = max(start, offset), min(end, offset + size)
            if low < high:
                found.append((position, low - offset, high - low))
            offset += size
            if offset >= end:
                break
        return found


def check_piece_bytes(piece_bytes: int) -> int:
    """`piece_bytes` if it is an int >= 1, else a ValueError naming it."""
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 1:
        raise ValueError(f"piece_bytes must be an int >= 1, got {piece_bytes!r}")
    return piece_bytes


def split_chunk(encoded: EncodedChunk, piece_bytes: int = DEFAULT_PIECE_BYTES
                ) -> tuple[ChunkLayout, list[Piece]]:
    """The layout of an encoded chunk and its pieces: each a tuple of views of the tensor bytes (no copy)."""
    check_piece_bytes(piece_bytes)
    layout = ChunkLayout(tuple((name, dtype, tuple(shape), int(array.size))
                               for name, (dtype, shape, array) in encoded.items()), piece_bytes)
    arrays = [array for _, _, array in encoded.values()]
    pieces = [tuple(arrays[t][offset:offset + length] for t, offset, length in layout.segments(index))
              for index in range(layout.num_pieces)]
    return layout, pieces


class PieceJoiner:
    """Joins the pieces of a chunk, in any order, back into the encoded chunk they were split from.

    A tensor that one piece holds whole is kept as that piece's view (no copy); the others are copied
    into a buffer of their own as their pieces arrive, so a piece need not be kept once added.
    """

    def __init__(self, layout: ChunkLayout) -> None:
        self.layout = layout
        self._arrays: list[np.ndarray | None] = [None] * len(layout.tensors)
        self._missing = set(range(layout.num_pieces))

    def add(self, index: int, piece: Any) -> int:
        """Take piece `index`; returns its bytes. ValueError for a piece that is not what the layout says."""
        if index not in self._missing:
            raise ValueError(f"piece {index} of {self.layout.num_pieces}: unexpected or already added")
        segments = self.layout.segments(index)
        if isinstance(piece, CompressedPiece):
            try:
                piece = expand_piece(piece, tuple(length for _, _, length in segments),
                                     self.layout.element_sizes(index))
            except ValueError as error:
                raise ValueError(f"piece {index}: {error}") from None
        if not isinstance(piece, tuple) or len(piece) != len(segments):
            raise ValueError(f"piece {index}: expected a tuple of {len(segments)} byte arrays, got "
                             f"{type(piece).__name__}")
        for (position, offset, length), part in zip(segments, piece, strict=True):
            name, _, _, size = self.layout.tensors[position]
            if not isinstance(part, np.ndarray) or part.dtype != np.uint8 or part.shape != (length,):
                raise ValueError(f"piece {index}: the bytes of tensor {name!r} are not a uint8 array of "
                                 f"{length}")
            if length == size:
                self._arrays[position] = part
                continue
            if self._arrays[position] is None:
                self._arrays[position] = np.empty(size, dtype=np.uint8)
            self._arrays[position][offset:offset + length] = part
        self._missing.discard(index)
        return self.layout.piece_size(index)

    @property
    def complete(self) -> bool:
        """Every piece was added."""
        return not self._missing

    def result(self) -> EncodedChunk:
        """The encoded chunk (every piece added), byte for byte the one that was split."""
        if self._missing:
            raise ValueError(f"{len(self._missing)} of {self.layout.num_pieces} pieces missing")
        empty = np.empty(1, dtype=np.uint8)[:0]  # strides (1,), as torch views need
        return {name: (dtype, shape, self._arrays[position] if size else empty)
                for position, (name, dtype, shape, size) in enumerate(self.layout.tensors)}


def join_pieces(layout: ChunkLayout, pieces: Sequence[Any]) -> EncodedChunk:
    """The encoded chunk `pieces` (in order) were split from."""
    joiner = PieceJoiner(layout)
    for index, piece in enumerate(pieces):
        joiner.add(index, piece)
    return joiner.result()


def mbit_per_s(num_bytes: float, seconds: float) -> float:
    """The rate of `num_bytes` in `seconds`, in Mbit/s (0 for no time)."""
    return num_bytes * 8 / 1e6 / seconds if seconds > 0 else 0.0


def human_bytes(num_bytes: float) -> str:
    """Bytes for people: 812 B, 3.4 KB, 12.0 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


def describe(done: float, total: float, seconds: float) -> str:
    """'1.2 MB of 3.4 MB in 12.0 s (0.80 Mbit/s)'."""
    rate = mbit_per_s(done, seconds)
    return f"{human_bytes(done)} of {human_bytes(total)} in {seconds:.1f} s ({rate:.2f} Mbit/s)"


def describe_answer(answer: Mapping[str, Any]) -> str:
    """`describe` of a progress answer (`TransferProgress.snapshot`: done, total, seconds)."""
    return describe(answer.get("done", 0), answer.get("total", 0), float(answer.get("seconds", 0.0)))


class TransferProgress:
    """Bytes done of total of one transfer, when it started and when it last moved; thread-safe to read.

    `what` names the transfer for messages ("weight update v7 (full) chunk 2 of 9"), `peer` the other
    side ("trainer at 10.213.0.1"), `key` the same for programs (a weight update's version).
    `stalled(now)` once `stall_s` passed without progress.
    """

    def __init__(self, what: str, total: int, peer: str, stall_s: float = DEFAULT_STALL_S,
                 clock: Callable[[], float] = time.monotonic, key: Any = None) -> None:
        check_stall_s("stall_s", stall_s)
        self.what, self.total, self.peer, self.stall_s, self.clock = what, int(total), peer, stall_s, clock
        self.key = key
        self.start = self.last_progress = clock()
        self.done = 0
        self._lock = threading.Lock()

    def advance(self, num_bytes: int) -> None:
        """`num_bytes` more arrived (a piece): progress, even of 0 bytes (an empty piece)."""
        with self._lock:
            self.done += num_bytes
            self.last_progress = self.clock()

    def resume(self) -> None:
        """Restart the stall clock without progress: the time since was spent on this side (verifying a
        chunk), not waiting for the link."""
        with self._lock:
            self.last_progress = self.clock()

    def stalled(self, now: float | None = None) -> bool:
        """True once `stall_s` passed since the start or the last progress."""
        now = self.clock() if now is None else now
        return now - self.last_progress >= self.stall_s

    def rate_mbit(self, now: float | None = None) -> float:
        """The rate achieved so far, Mbit/s."""
        now = self.clock() if now is None else now
        return mbit_per_s(self.done, now - self.start)

    def describe(self, now: float | None = None) -> str:
        """'<what> from/to <peer>: 1.2 MB of 3.4 MB in 12.0 s (0.80 Mbit/s)'."""
        now = self.clock() if now is None else now
        return f"{self.what} ({self.peer}): {describe(self.done, self.total, now - self.start)}"

    def error(self, now: float | None = None, waited: float | None = None) -> TransferStalled:
        """The `TransferStalled` that fails this transfer now, naming what, bytes, rate, peer and stall."""
        now = self.clock() if now is None else now
        waited = now - self.last_progress if waited is None else waited
        return TransferStalled(f"{self.describe(now)}: stalled, no progress for {waited:.1f} s "
                               f"(stall interval {self.stall_s:g} s)")

    def snapshot(self) -> dict[str, Any]:
        """What a progress query answers: key, what, peer, bytes done/total, seconds since the start and since
        the last progress."""
        now = self.clock()
        with self._lock:
            return {"key": self.key, "what": self.what, "peer": self.peer, "done": self.done,
                    "total": self.total, "seconds": now - self.start, "idle_s": now - self.last_progress}


# `wait(refs, timeout)` -> the refs that are ready (local) among `refs`; `get(ref)` -> the piece.
Wait = Callable[[list[Any], float], list[Any]]
Get = Callable[[Any], Any]


def pull_pieces(refs: Sequence[Any], layout: ChunkLayout, wait: Wait, get: Get, progress: TransferProgress,
                window: int = DEFAULT_WINDOW) -> EncodedChunk:
    """Fetch the pieces behind `refs` (`window` requested at a time) and join them.

    Never times out while pieces keep arriving. When none arrived for the stall interval, one fresh wait
    of half of it follows (a retry); if that brings none either, `TransferStalled` (so within 1.5x
    the stall interval). A piece that fails to `get` raises that error.
    """
    if len(refs) != layout.num_pieces:
        raise ValueError(f"{len(refs)} piece references for a layout of {layout.num_pieces} pieces")
    joiner = PieceJoiner(layout)
    index_of = {ref: index for index, ref in enumerate(refs)}
    queued, active = list(refs), []
    retried = False  # the stall interval passed without a piece: this is the one fresh wait left
    while queued or active:
        while queued and len(active) < window:
            active.append(queued.pop(0))
        if retried:
            budget = progress.stall_s / 2
        else:
            budget = progress.stall_s - (progress.clock() - progress.last_progress)
        ready = wait(active, budget) if budget > 0 else []
        if not ready:
            if retried:
                raise progress.error()
            retried = True
            continue
        retried = False
        for ref in ready:
            active.remove(ref)
            progress.advance(joiner.add(index_of[ref], get(ref)))
    return joiner.result()
