"""core.transfer without Ray: pieces split and joined exactly, progress, stalls and their messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detached_rl.core.chunk_codec import decode_chunk, encode_chunk
from detached_rl.core.transfer import (
    PieceJoiner,
    TransferProgress,
    TransferStalled,
    join_pieces,
    pull_pieces,
    split_chunk,
)


class Clock:
    """A clock tests move by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def chunk() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a": torch.randn(300, 7, generator=generator), "b": torch.arange(5, dtype=torch.int64),
            "empty": torch.zeros(0, dtype=torch.uint8), "c": torch.randn(3, generator=generator).half(),
            "d": torch.randn(1000, generator=generator).to(torch.bfloat16)}


@pytest.mark.parametrize("piece_bytes", [1, 7, 1000, 4096, 1 << 20])
def test_split_and_join_give_back_every_byte(piece_bytes: int) -> None:
    original = chunk()
    encoded = encode_chunk(original)
    layout, pieces = split_chunk(encoded, piece_bytes)
    assert layout.num_pieces == len(pieces) == max(1, -(-layout.total_bytes // piece_bytes))
    assert all(sum(part.size for part in piece) == layout.piece_size(i) for i, piece in enumerate(pieces))
    order = list(range(len(pieces)))[::-1]  # pieces may arrive in any order
    joiner = PieceJoiner(layout)
    for index in order:
        joiner.add(index, pieces[index])
    joined = joiner.result()
    assert list(joined) == list(encoded)
    for name, (dtype, shape, array) in encoded.items():
        assert joined[name][:2] == (dtype, shape)
        assert np.array_equal(joined[name][2], array)
    decoded = decode_chunk(joined)
    for name, tensor in original.items():
        assert decoded[name].dtype == tensor.dtype and torch.equal(decoded[name], tensor), name


def test_a_tensor_one_piece_holds_is_not_copied() -> None:
    encoded = encode_chunk({"small": torch.ones(4), "big": torch.ones(100)})
    layout, pieces = split_chunk(encoded, 64)
    joined = join_pieces(layout, pieces)
    assert np.shares_memory(joined["small"][2], pieces[0][0])  # 16 bytes, whole in piece 0
    assert not np.shares_memory(joined["big"][2], pieces[0][1])  # 400 bytes over 7 pieces: joined


def test_the_joiner_refuses_what_the_layout_does_not_say() -> None:
    layout, pieces = split_chunk(encode_chunk({"a": torch.ones(100)}), 128)
    joiner = PieceJoiner(layout)
    with pytest.raises(ValueError, match="not a uint8 array of 128"):
        joiner.add(0, (pieces[0][0][:10],))
    joiner.add(0, pieces[0])
    with pytest.raises(ValueError, match="already added"):
        joiner.add(0, pieces[0])
    with pytest.raises(ValueError, match="3 of 4 pieces missing"):
        joiner.result()
    with pytest.raises(ValueError, match="piece_bytes"):
        split_chunk(encode_chunk({"a": torch.ones(1)}), 0)


def test_progress_stalls_only_after_the_interval_without_bytes() -> None:
    clock = Clock()
    progress = TransferProgress("weight update v7 (full)", 8_000_000, "from trainer at 10.213.0.1", 4.0,
                                clock, key=7)
    clock.now += 3.9
    assert not progress.stalled()
    progress.advance(2_000_000)
    clock.now += 3.9
    assert not progress.stalled()  # 7.8 s since the start, 3.9 s since the last bytes
    clock.now += 0.1
    assert progress.stalled()
    assert progress.rate_mbit() == pytest.approx(2_000_000 * 8 / 1e6 / 7.9)
    assert progress.snapshot()["key"] == 7 and progress.snapshot()["idle_s"] == pytest.approx(4.0)
    message = str(progress.error())
    for part in ("weight update v7 (full)", "10.213.0.1", "2.0 MB of 8.0 MB", "2.03 Mbit/s", "4.0 s",
                 "stall interval 4 s"):
        assert part in message, (part, message)
    with pytest.raises(ValueError, match="stall_s"):
        TransferProgress("x", 1, "y", 0.0)


class Link:
    """`wait` and `get` over pieces that arrive on a schedule of the fake clock."""

    def __init__(self, pieces: list, clock: Clock, arrive_every: float | None) -> None:
        self.pieces, self.clock, self.arrive_every = pieces, clock, arrive_every
        self.waits: list[float] = []

    def wait(self, refs: list[int], timeout: float) -> list[int]:
        self.waits.append(timeout)
        if self.arrive_every is None or self.arrive_every > timeout:
            self.clock.now += timeout
            return []
        self.clock.now += self.arrive_every
        return [refs[0]]

    def get(self, ref: int) -> tuple:
        return self.pieces[ref]


def test_a_slow_transfer_never_times_out_while_pieces_arrive() -> None:
    clock = Clock()
    encoded = encode_chunk({"a": torch.randn(2000)})
    layout, pieces = split_chunk(encoded, 500)
    link = Link(pieces, clock, arrive_every=3.5)  # each piece takes most of the 4 s stall interval
    progress = TransferProgress("weight update v1 (full)", layout.total_bytes, "trainer at h0", 4.0, clock)
    joined = pull_pieces(list(range(len(pieces))), layout, link.wait, link.get, progress)
    assert clock.now - 100.0 == pytest.approx(3.5 * 16) and clock.now - 100.0 > 10 * 4.0  # far beyond 4 s
    assert np.array_equal(joined["a"][2], encoded["a"][2])
    assert progress.done == layout.total_bytes


def test_a_stalled_transfer_fails_after_one_retry_within_twice_the_interval() -> None:
    clock = Clock()
    layout, pieces = split_chunk(encode_chunk({"a": torch.randn(2000)}), 500)
    link = Link(pieces, clock, arrive_every=1.0)
    progress = TransferProgress("weight update v3 (lora)", layout.total_bytes, "from trainer at 10.213.0.1",
                                4.0, clock)

    def wait(refs: list[int], timeout: float) -> list[int]:
        if progress.done >= 2000:  # the link goes dead after 2000 bytes
            link.arrive_every = None
        return link.wait(refs, timeout)

    start = clock.now
    with pytest.raises(TransferStalled) as failed:
        pull_pieces(list(range(len(pieces))), layout, wait, link.get, progress)
    assert link.waits[-2:] == [pytest.approx(4.0), pytest.approx(2.0)]  # the interval, then a fresh half
    stalled_for = clock.now - progress.last_progress
    assert stalled_for == pytest.approx(6.0) and stalled_for <= 2 * 4.0
    assert clock.now - start == pytest.approx(4 * 1.0 + 6.0)
    message = str(failed.value)
    for part in ("weight update v3 (lora)", "10.213.0.1", "2.0 KB of 8.0 KB", "no progress for 6.0 s",
                 "stall interval 4 s"):
        assert part in message, (part, message)


def test_a_piece_in_the_retry_wait_carries_on() -> None:
    clock = Clock()
    layout, pieces = split_chunk(encode_chunk({"a": torch.randn(500)}), 1000)
    progress = TransferProgress("w", layout.total_bytes, "p", 4.0, clock)
    answers = [[], [0], [1]]  # nothing for the stall interval, then the retry brings a piece

    def wait(refs: list[int], timeout: float) -> list[int]:
        clock.now += timeout if not answers[0] else 1.0
        return answers.pop(0)

    pull_pieces([0, 1], layout, wait, lambda ref: pieces[ref], progress)
    assert progress.done == 2000
