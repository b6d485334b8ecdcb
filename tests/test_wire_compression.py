"""Lossless compression of weight pieces (no Ray): byte planes + zlib give back every byte, pieces join to the
chunk they were split from whatever their dtypes and boundaries, a trained adapter shrinks, and a corrupt or
short stream is refused naming the piece."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detached_rl.core.chunk_codec import decode_chunk, encode_chunk
from detached_rl.core.transfer import PieceJoiner, split_chunk
from detached_rl.core.wire_compression import CompressedPiece, check_compression, compress_piece, expand_piece


def mixed_chunk() -> dict[str, torch.Tensor]:
    """fp32, bf16, fp16 and int64 tensors whose sizes do not fall on piece boundaries."""
    generator = torch.Generator().manual_seed(0)
    return {"a": torch.randn(333, 17, generator=generator) * 0.04,
            "b": (torch.randn(1001, generator=generator) * 1e-3).to(torch.bfloat16),
            "c": torch.randn(77, 5, generator=generator).to(torch.float16),
            "d": torch.arange(12345, dtype=torch.int64),
            "e": torch.zeros(0)}


@pytest.mark.parametrize("piece_bytes", [1, 7, 4096, 1 << 20])
def test_compressed_pieces_join_to_the_exact_chunk(piece_bytes):
    chunk = mixed_chunk()
    layout, pieces = split_chunk(encode_chunk(chunk), piece_bytes)
    joiner = PieceJoiner(layout)
    for index in reversed(range(len(pieces))):  # any order
        joiner.add(index, layout.compress(index, pieces[index]))
    joined = decode_chunk(joiner.result())
    assert set(joined) == set(chunk)
    for name, tensor in chunk.items():
        assert joined[name].dtype == tensor.dtype and torch.equal(joined[name], tensor), name


def test_byte_planes_make_a_lora_like_tensor_smaller_and_come_back_exactly():
    values = (torch.rand(4096, 64, generator=torch.Generator().manual_seed(1)) - 0.5) * 0.08  # kaiming-like A
    raw = values.view(-1).view(torch.uint8).numpy()
    planes = compress_piece((raw,), (4,))
    plain = compress_piece((raw,), (1,))  # no planes: zlib alone
    assert len(planes.data) < 0.9 * raw.size and len(planes.data) < len(plain.data)
    (back,) = expand_piece(planes, (raw.size,), (4,))
    assert np.array_equal(back, raw)


def test_a_corrupt_or_short_stream_is_refused_naming_the_piece():
    layout, pieces = split_chunk(encode_chunk(mixed_chunk()), 4096)
    good = layout.compress(1, pieces[1])
    with pytest.raises(ValueError, match="piece 1: compressed piece: not a zlib stream"):
        PieceJoiner(layout).add(1, CompressedPiece(good.data[:-9] + b"garbage!!"))
    short = compress_piece((pieces[1][0][:-1],), (1,))
    with pytest.raises(ValueError, match=r"piece 1: compressed piece: \d+ bytes, the layout says 4096"):
        PieceJoiner(layout).add(1, short)


def test_the_setting_is_checked_by_name():
    assert check_compression("auto", "x") == "auto"
    with pytest.raises(ValueError, match="TrainerConfig.wire_compression must be one of"):
        from detached_rl.trainer.config import TrainerConfig

        TrainerConfig(wire_compression="lz4")
