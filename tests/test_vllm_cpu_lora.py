"""The one-adapter fast path of vLLM's CPU LoRA ops computes what vLLM's own ops
compute (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from detached_rl.generation.vllm import vllm_available

if not vllm_available():
    pytest.skip("vllm is not importable (optional; see docs/vllm-notes.md)", allow_module_level=True)

from vllm.lora.ops import torch_ops  # noqa: E402
from vllm.lora.punica_wrapper import punica_cpu  # noqa: E402

from detached_rl.generation import vllm_cpu_lora  # noqa: E402

TOKENS, D_IN, D_OUT, RANK, ADAPTERS = 7, 24, 40, 8, 3


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert vllm_cpu_lora.install() and vllm_cpu_lora.install()  # idempotent
    assert all(getattr(punica_cpu, name) is not getattr(torch_ops, name) for name in vllm_cpu_lora._OPS)


def weights(rows: int, cols: int) -> torch.Tensor:
    return torch.randn(ADAPTERS, 1, rows, cols)


@pytest.mark.parametrize("indices", [[1] * TOKENS, [0, 0, 2, 2, 2, 1, 1], [-1] * TOKENS],
                         ids=["one-adapter", "mixed", "no-adapter"])
def test_bgmv_ops_match_vllms(indices):
    torch.manual_seed(0)
    index = torch.tensor(indices)
    x, a, b = torch.randn(TOKENS, D_IN), weights(RANK, D_IN), weights(D_OUT, RANK)
    shrunk, expected_shrunk = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
    punica_cpu.bgmv_shrink(x, a, shrunk, index, 0.5)
    torch_ops.bgmv_shrink(x, a, expected_shrunk, index, 0.5)
    torch.testing.assert_close(shrunk, expected_shrunk)
    for add in (True, False):
        out, expected = torch.ones(TOKENS, D_OUT), torch.ones(TOKENS, D_OUT)
        punica_cpu.bgmv_expand(shrunk, b, out, index, add)
        torch_ops.bgmv_expand(shrunk, b, expected, index, add)
        torch.testing.assert_close(out, expected)
        out, expected = torch.ones(TOKENS, D_OUT + 16), torch.ones(TOKENS, D_OUT + 16)
        punica_cpu.bgmv_expand_slice(shrunk, b, out, index, 8, D_OUT, add)
        torch_ops.bgmv_expand_slice(shrunk, b, expected, index, 8, D_OUT, add)
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("request_indices", [[2, 2], [0, 1]], ids=["one-adapter", "mixed"])
def test_sgmv_ops_match_vllms(request_indices):
    torch.manual_seed(1)
    lengths = torch.tensor([3, 4])
    starts = torch.tensor([0, 3])
    index = torch.tensor(request_indices)
    meta = (starts, lengths, index, 2, 4, TOKENS)
    x, a, b = torch.randn(TOKENS, D_IN), weights(RANK, D_IN), weights(D_OUT, RANK)
    shrunk, expected_shrunk = torch.zeros(TOKENS, RANK), torch.zeros(TOKENS, RANK)
    punica_cpu.sgmv_shrink(x, a, shrunk, *meta, 2.0)
    torch_ops.sgmv_shrink(x, a, expected_shrunk, *meta, 2.0)
    torch.testing.assert_close(shrunk, expected_shrunk)
    out, expected = torch.ones(TOKENS, D_OUT), torch.ones(TOKENS, D_OUT)
    punica_cpu.sgmv_expand(shrunk, b, out, *meta, True)
    torch_ops.sgmv_expand(shrunk, b, expected, *meta, True)
    torch.testing.assert_close(out, expected)
    out, expected = torch.zeros(TOKENS, D_OUT + 8), torch.zeros(TOKENS, D_OUT + 8)
    punica_cpu.sgmv_expand_slice(shrunk, b, out, *meta, 4, D_OUT, False)
    torch_ops.sgmv_expand_slice(shrunk, b, expected, *meta, 4, D_OUT, False)
    torch.testing.assert_close(out, expected)


def test_single_index():
    assert vllm_cpu_lora.single_index(torch.tensor([3, 3, 3])) == 3
    assert vllm_cpu_lora.single_index(torch.tensor([3, 2])) is None
    assert vllm_cpu_lora.single_index(torch.tensor([-1, -1])) is None
    assert vllm_cpu_lora.single_index(torch.tensor([], dtype=torch.long)) is None
