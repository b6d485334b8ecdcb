"""The wire format of a weight chunk: tensors as raw byte arrays that an object store shares without copying.

Pickled torch tensors are copied on both sides; numpy arrays travel out of band, so a maker reads
them straight from shared memory and copies each byte once, into its model. A chunk on the wire is
`{name: (dtype name, shape, uint8 array of the tensor's bytes)}`; `decode_chunk` refuses anything
else with a message naming the tensor and the field.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

EncodedChunk = dict[str, tuple[str, tuple[int, ...], np.ndarray]]


def encode_chunk(chunk: Mapping[str, torch.Tensor]) -> EncodedChunk:
    """Each tensor as (dtype name, shape, a uint8 view of its bytes); CPU tensors
    are not copied if contiguous."""
    encoded: EncodedChunk = {}
    for name, tensor in chunk.items():
        flat = tensor.detach().reshape(-1).cpu()
        encoded[name] = (str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape),
                         flat.view(torch.uint8).numpy())
    return encoded


def decode_chunk(raw: Any) -> dict[str, torch.Tensor]:
    """Tensors viewing the arrays of an encoded chunk (read-only memory: verify, then copy)."""
    if not isinstance(raw, Mapping):
        raise ValueError("weight chunk: expected a mapping of name -> (dtype, shape, bytes), got "
                         f"{type(raw).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in raw.items():
        if not isinstance(name, str) or not isinstance(entry, tuple) or len(entry) != 3:
            raise ValueError(f"weight chunk: entry {name!r} is not a (dtype, shape, bytes) triple")
        dtype_name, shape, array = entry
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight chunk: tensor {name!r}: dtype {dtype_name!r} is not a torch dtype")
        if not isinstance(shape, tuple) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"weight chunk: tensor {name!r}: shape {shape!r} is not a tuple of sizes")
        if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
            raise ValueError(f"weight chunk: tensor {name!r}: bytes must be a 1-D uint8 array")
        expected = math.prod(shape) * dtype.itemsize
        if array.size != expected:
            raise ValueError(f"weight chunk: tensor {name!r}: {array.size} bytes for shape {shape} of "
                             f"{dtype_name} ({expected} expected)")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*")  # only read: verified, then copied
            tensors[name] = torch.from_numpy(array).view(dtype).reshape(shape)
    return tensors
