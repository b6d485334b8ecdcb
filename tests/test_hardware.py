"""Device peaks for MFU and the decode bound: the GPU table, measured fallbacks, caching."""

import pytest
import torch

from detached_rl.strategies import hardware
from detached_rl.strategies.hardware import (
    GPU_SPECS,
    PEAK_KINDS,
    device_peak,
    lookup_gpu,
    measure_matmul_flops,
    memory_bandwidth,
    peak_flops,
    table_or_measured_peak,
)

from .helpers import lane_device

T = 1e12


@pytest.mark.parametrize(("name", "spec", "bf16_tflops", "bandwidth_gb_s"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5, 3350),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756, 2000),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 3900),
    ("NVIDIA H200", "H200 SXM", 989.5, 4800),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5, 4800),
    ("NVIDIA GH200 480GB", "GH200", 989.5, 4000),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 312, 2039),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 312, 1935),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB", 312, 1555),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312, 1555),
    ("NVIDIA L4", "L4", 121, 300),
    ("NVIDIA L40S", "L40S", 362, 864),
    ("NVIDIA L40", "L40", 181, 864),
    ("NVIDIA A10", "A10", 125, 600),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090", 165.2, 1008),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090", 71, 936),
])
def test_known_gpu_names_map_to_their_data_sheet_dense_peaks(name, spec, bf16_tflops, bandwidth_gb_s):
    found = lookup_gpu(name)
    assert found is not None and found.name == spec
    assert found.peak_flops["bfloat16"] == pytest.approx(bf16_tflops * T)
    assert found.memory_bandwidth == pytest.approx(bandwidth_gb_s * 1e9)
    assert table_or_measured_peak(name, "bfloat16", lambda: pytest.fail("measured a known GPU"), "-") \
        == hardware.Peak(found.peak_flops["bfloat16"], f"table: {found.source}")


@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA B200", "AMD Instinct MI300X", "Tesla K80"])
def test_gpus_not_in_the_table_are_measured(name):
    assert lookup_gpu(name) is None
    peak = table_or_measured_peak(name, "float32", lambda: measure_matmul_flops("cpu", "float32", 128),
                                  "128³")
    assert peak.source == "measured: 128³" and peak.value > 1e6


def test_a_kind_missing_from_a_known_gpu_is_measured():
    """V100 has no bf16 tensor cores: its bf16 figure is measured, its fp16 one comes from the table."""
    assert "bfloat16" not in lookup_gpu("Tesla V100-SXM2-16GB").peak_flops
    assert table_or_measured_peak("Tesla V100-SXM2-16GB", "bfloat16", lambda: 1.0,
                                  "x").source == "measured: x"
    assert table_or_measured_peak("Tesla V100-SXM2-16GB", "float16", lambda: 1.0, "x").value == 125 * T


def test_the_table_is_consistent():
    """Dense peaks: tensor-core kinds at least the FP32 one, all positive, every
    entry sourced and reachable."""
    names = [spec.name for _, spec in GPU_SPECS]
    assert len(names) == len(set(names))
    for pattern, spec in GPU_SPECS:
        assert set(spec.peak_flops) <= set(PEAK_KINDS) and spec.source and spec.memory_bandwidth > 0
        assert spec.peak_flops["tfloat32"] >= spec.peak_flops["float32"] > 0
        assert all(spec.peak_flops[kind] >= spec.peak_flops["tfloat32"] for kind in ("bfloat16", "float16")
                   if kind in spec.peak_flops)
        # No earlier, more general pattern shadows this entry.
        assert lookup_gpu(f"NVIDIA {spec.name}") is spec or lookup_gpu(pattern.replace(".*", " ")) is spec


def test_the_cpu_peak_is_measured_once_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    first = device_peak("cpu", "float32")
    assert torch.equal(torch.rand(3), want)
    assert first.source.startswith("measured: 1024³ float32 matmul") and first.value > 1e8
    assert device_peak(torch.device("cpu"), "float32") is first  # cached per (device, dtype)
    assert peak_flops("cpu", "float32") == first.value
    bandwidth = memory_bandwidth("cpu")
    assert bandwidth.source.startswith("measured") and bandwidth.value > 1e8
    assert memory_bandwidth("cpu") is bandwidth


def test_float32_on_cuda_counts_as_tf32_only_when_pytorch_allows_tf32():
    cuda = torch.device("cuda", 0)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert hardware._peak_kind(cuda, "float32") == "float32"
        torch.set_float32_matmul_precision("high")
        assert hardware._peak_kind(cuda, "float32") == "tfloat32"
        assert hardware._peak_kind(torch.device("cpu"), "float32") == "float32"
        assert hardware._peak_kind(cuda, "bfloat16") == "bfloat16"
    finally:
        torch.set_float32_matmul_precision(before)


def test_unknown_dtypes_are_refused_naming_them():
    with pytest.raises(ValueError, match="float64"):
        peak_flops("cpu", "float64")


@pytest.mark.skipif(lane_device().type != "cuda",
                    reason="GPU lane: the lane GPU's peak (run with --device cuda)")
def test_the_lane_gpus_peak_is_its_table_entry_or_a_plausible_measurement():
    name = torch.cuda.get_device_name(lane_device())
    peak = device_peak(lane_device(), "bfloat16")
    spec = lookup_gpu(name)
    if spec is not None:
        assert peak.value == spec.peak_flops["bfloat16"] and peak.source.startswith("table")
        # The data sheet's dense peak is an upper bound a large matmul gets within 2x of.
        measured = measure_matmul_flops(lane_device(), "bfloat16", 8192)
        assert spec.peak_flops["bfloat16"] / 2 < measured <= spec.peak_flops["bfloat16"] * 1.05
    else:
        assert peak.source.startswith("measured") and peak.value > 1e12



def test_auto_dtypes_take_bfloat16_only_where_the_device_computes_it_natively():
    """"auto" (the main job's trainer autocast and vLLM engine dtype): bfloat16 on a device with native bf16,
    the fallback elsewhere; an explicit dtype or None is kept whatever the device."""
    from pathlib import Path

    from detached_rl.core.native_dtypes import NATIVE_BF16_CPU_FLAGS, native_bfloat16, resolve_auto_dtype

    assert resolve_auto_dtype("auto", "cpu", None, native=lambda device: True) == "bfloat16"
    assert resolve_auto_dtype("auto", "cpu", None, native=lambda device: False) is None
    assert resolve_auto_dtype("auto", "cpu", "float32", native=lambda device: False) == "float32"
    for explicit in ("bfloat16", "float16", None):
        assert resolve_auto_dtype(explicit, "cpu", "float32", native=lambda device: False) == explicit
    flags = Path("/proc/cpuinfo").read_text()
    assert native_bfloat16("cpu") == any(f" {flag}" in flags for flag in NATIVE_BF16_CPU_FLAGS)
    assert not native_bfloat16("meta")
