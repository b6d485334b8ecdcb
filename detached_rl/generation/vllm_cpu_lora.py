"""A one-adapter fast path for vLLM's PyTorch LoRA ops on CPU (the ops `PunicaWrapperCPU` calls).

vLLM 0.32's CPU LoRA ops (`vllm.lora.ops.torch_ops`) gather one [out, in] adapter matrix *per token*
(`weights[indices]`) and contract with einsum: a prefill of T tokens through a rank-r adapter on a
[d_out, d_in] layer copies T·r·(d_in + d_out) numbers per layer, which made LoRA keep mode 1.4-3x slower
than the HF backend on SmolLM2 (benchmarks/bench_generation.py). A keep-mode maker pins every request of a
batch to one adapter, so every token's index is the same: then the op is one matmul with that adapter,
`inputs @ weights[index].T`, the same numbers without the gather. Batches that mix adapters (or hold
rows without one, index -1) go to vLLM's own op unchanged.

`install()` swaps the six ops in `vllm.lora.punica_wrapper.punica_cpu`'s namespace (where the CPU
wrapper looks them up) for wrappers that try the fast path first; it is idempotent and does nothing
when that module or one of its ops is missing (another vLLM version: the original ops stay).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["install", "single_index"]

_OPS = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice", "sgmv_shrink", "sgmv_expand", "sgmv_expand_slice")
_INSTALLED = "_detached_rl_fast_path"


def single_index(indices: torch.Tensor) -> int | None:
    """The adapter index every token uses, or None when they differ, are empty or name no adapter (-1)."""
    if indices.numel() == 0:
        return None
    first = int(indices.min())
    if first < 0 or first != int(indices.max()):
        return None
    return first


def _adapter(weights: torch.Tensor, index: int, dtype: torch.dtype) -> torch.Tensor:
    """Adapter `index` of stacked weights [adapters, (1,) out, in] as [out, in] in `dtype`."""
    matrix = weights[index]
    if matrix.dim() == 3:
        matrix = matrix.squeeze(0)
    return matrix.to(dtype)


def _shrink(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, index: int,
            scaling: float) -> None:
    """output[:, :r] = scaling · inputs @ A.T (what `bgmv_shrink` computes when all indices equal `index`)."""
    outputs = inputs.to(output.dtype) @ _adapter(weights, index, output.dtype).T
    output[:, : outputs.shape[1]] = scaling * outputs


def _expand(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, index: int,
            add_inputs: bool) -> None:
    """output (+)= inputs @ B.T on the common width (`bgmv_expand` with one index, its row rule kept)."""
    outputs = inputs.to(output.dtype) @ _adapter(weights, index, output.dtype).T
    limit = 1 if outputs.shape[0] == 1 and output.shape[0] != 1 else output.shape[0]
    width = min(outputs.shape[1], output.shape[1])
    if add_inputs:
        output[:, :width] += outputs[:limit, :width]
    else:
        output[:, :width] = outputs[:limit, :width]


def _expand_slice(inputs: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, index: int, offset: int,
                  size: int, add_inputs: bool) -> None:
    """output[:, offset:offset+size] (+)= inputs @ B.T (`bgmv_expand_slice` with one index)."""
    outputs = inputs.to(output.dtype) @ _adapter(weights, index, output.dtype).T
    if add_inputs:
        output[:, offset : offset + size] += outputs
    else:
        output[:, offset : offset + size] = outputs


def _fast(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """`original` with the one-adapter fast path in front (the sgmv ops take per-request indices)."""

    def bgmv_shrink(inputs, weights, output, indices, scaling=1.0):
        index = single_index(indices)
        if index is None:
            return original(inputs, weights, output, indices, scaling)
        _shrink(inputs, weights, output, index, scaling)

    def bgmv_expand(inputs, weights, output, indices, add_inputs=True):
        index = single_index(indices)
        if index is None:
            return original(inputs, weights, output, indices, add_inputs)
        _expand(inputs, weights, output, index, add_inputs)

    def bgmv_expand_slice(inputs, weights, output, indices, slice_offset, slice_size, add_inputs=True):
        index = single_index(indices)
        if index is None:
            return original(inputs, weights, output, indices, slice_offset, slice_size, add_inputs)
        _expand_slice(inputs, weights, output, index, slice_offset, slice_size, add_inputs)

    def sgmv_shrink(inputs, weights, output, starts, lengths, indices, batches, max_length, tokens, scaling):
        index = single_index(indices[: lengths.numel()][lengths > 0])
        if index is None:
            return original(inputs, weights, output, starts, lengths, indices, batches, max_length, tokens,
                            scaling)
        _shrink(inputs, weights, output, index, scaling)

    def sgmv_expand(inputs, weights, output, starts, lengths, indices, batches, max_length, tokens,
                    add_inputs=False):
        index = single_index(indices[: lengths.numel()][lengths > 0])
        if index is None:
            return original(inputs, weights, output, starts, lengths, indices, batches, max_length, tokens,
                            add_inputs)
        _expand(inputs, weights, output, index, add_inputs)

    def sgmv_expand_slice(inputs, weights, output, starts, lengths, indices, batches, max_length, tokens,
                          slice_offset, slice_size, add_inputs=False):
        index = single_index(indices[: lengths.numel()][lengths > 0])
        if index is None:
            return original(inputs, weights, output, starts, lengths, indices, batches, max_length, tokens,
                            slice_offset, slice_size, add_inputs)
        _expand_slice(inputs, weights, output, index, slice_offset, slice_size, add_inputs)

    wrapper = locals()[name]
    setattr(wrapper, _INSTALLED, original)
    return wrapper


def install() -> bool:
    """Put the fast path in front of the CPU wrapper's LoRA ops; True when they are
    (now or already) in place."""
    try:
        from vllm.lora.punica_wrapper import punica_cpu
    except ImportError:
        return False
    ops = {name: getattr(punica_cpu, name, None) for name in _OPS}
    if any(op is None for op in ops.values()):
        return False
    for name, op in ops.items():
        if not hasattr(op, _INSTALLED):
            setattr(punica_cpu, name, _fast(name, op))
    return True
