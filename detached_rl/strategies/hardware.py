"""Peak matmul throughput and memory bandwidth of the device a model runs on: the denominators of MFU and of
the memory-bound decode estimate.

Known GPUs are looked up by `torch.cuda.get_device_name` in `GPU_SPECS`: dense (not 2:4 sparse) tensor-core
peaks from NVIDIA's data sheets. Anything else (the CPU, a GPU not in the table) is measured once per
(device, kind) with a matmul large enough to reach the device's plateau and cached for the process.

float32 matmuls run on tensor cores as TF32 only when `torch.get_float32_matmul_precision()` is not "highest"
(PyTorch's default is "highest"), so the float32 peak is the plain FP32 figure unless TF32 is allowed.
"""

from __future__ import annotations

import functools
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from detached_rl.core.native_dtypes import cpuinfo_value

__all__ = [
    "GPU_SPECS",
    "DeviceSpec",
    "Peak",
    "device_name",
    "device_peak",
    "lookup_gpu",
    "measure_copy_bandwidth",
    "measure_matmul_flops",
    "memory_bandwidth",
    "peak_flops",
    "table_or_measured_peak",
]

TERA = 1e12

# The dtypes a peak is asked for; "tfloat32" is float32 on tensor cores (see the module doc).
PEAK_KINDS = ("float32", "tfloat32", "bfloat16", "float16")

# Measuring: a square matmul of this size per device type, timed in trials of at least MEASURE_SECONDS
# (and 3 matmuls), the best of MEASURE_TRIALS trials taken. On a 2-core Xeon (AMX) under load, 1024³ fp32
# already reaches the BLAS plateau (2048³ is no faster, within noise, and 4x slower to time), and
# contention from other processes only lowers a trial, so the best trial is the honest peak. On GPUs
# 1024³ is launch-bound (an H100 gave 54 TFLOP/s bf16 against ~800 achievable), hence 4096³.
MEASURE_SIZE = {"cpu": 1024, "cuda": 4096}
MEASURE_SECONDS = 0.2
MEASURE_TRIALS = 3


@dataclass(frozen=True)
class DeviceSpec:
    """A GPU's dense matmul peaks (FLOP/s by kind, see `PEAK_KINDS`) and memory bandwidth (bytes/s)."""

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    memory_bandwidth: float
    source: str  # the data sheet the figures come from


def _spec(name: str, fp32: float, tf32: float, bf16: float | None, fp16: float, bandwidth_gb_s: float,
          source: str) -> DeviceSpec:
    """A `DeviceSpec` from data-sheet figures in TFLOP/s (dense) and GB/s."""
    peaks = {"float32": fp32 * TERA, "tfloat32": tf32 * TERA, "float16": fp16 * TERA}
    if bf16 is not None:
        peaks["bfloat16"] = bf16 * TERA
    return DeviceSpec(name, peaks, bandwidth_gb_s * 1e9, source)


# (regex on torch.cuda.get_device_name, spec), first match wins: specific names before general ones
# ("H100 NVL" before "H100", "L40S" before "L40", "A10" must not match "A100" or "A10G").
# Data sheets list tensor-core figures "with sparsity"; the dense figure is half of that.
GPU_SPECS: tuple[tuple[str, DeviceSpec], ...] = (
    (r"H100 NVL", _spec("H100 NVL", 60, 417.5, 835.5, 835.5, 3900,
                        "NVIDIA H100 Tensor Core GPU data sheet (H100 NVL column)")),
    (r"H100.*PCIe", _spec("H100 PCIe", 51, 378, 756, 756, 2000,
                          "NVIDIA H100 Tensor Core GPU data sheet (H100 PCIe column)")),
    (r"H100", _spec("H100 SXM", 67, 494.5, 989.5, 989.5, 3350,
                    "NVIDIA H100 Tensor Core GPU data sheet (H100 SXM column)")),
    (r"GH200", _spec("GH200", 67, 494.5, 989.5, 989.5, 4000,
                     "NVIDIA GH200 Grace Hopper Superchip data sheet (96GB HBM3 version)")),
    (r"H200 NVL", _spec("H200 NVL", 60, 417.5, 835.5, 835.5, 4800,
                        "NVIDIA H200 Tensor Core GPU data sheet (H200 NVL column)")),
    (r"H200", _spec("H200 SXM", 67, 494.5, 989.5, 989.5, 4800,
                    "NVIDIA H200 Tensor Core GPU data sheet (H200 SXM column)")),
    (r"A100.*80GB.*PCIe|A100.*PCIe.*80GB", _spec("A100 80GB PCIe", 19.5, 156, 312, 312, 1935,
                                                  "NVIDIA A100 Tensor Core GPU data sheet (A100 80GB PCIe)")),
    (r"A100.*80GB", _spec("A100 80GB SXM", 19.5, 156, 312, 312, 2039,
                          "NVIDIA A100 Tensor Core GPU data sheet (A100 80GB SXM)")),
    (r"A100", _spec("A100 40GB", 19.5, 156, 312, 312, 1555,
                    "NVIDIA A100 Tensor Core GPU data sheet (A100 40GB)")),
    (r"L40S", _spec("L40S", 91.6, 183, 362, 362, 864, "NVIDIA L40S GPU data sheet")),
    (r"L40\b", _spec("L40", 90.5, 90.5, 181, 181, 864, "NVIDIA L40 GPU data sheet")),
    (r"\bL4\b", _spec("L4", 30.3, 60, 121, 121, 300, "NVIDIA L4 Tensor Core GPU data sheet")),
    (r"\bA10\b", _spec("A10", 31.2, 62.5, 125, 125, 600, "NVIDIA A10 Tensor Core GPU data sheet")),
    # GeForce tensor cores run FP16/BF16 with FP32 accumulation (what PyTorch uses) at half the
    # FP16-accumulate rate that the marketing figure quotes.
    (r"RTX 4090", _spec("GeForce RTX 4090", 82.6, 82.6, 165.2, 165.2, 1008,
                        "NVIDIA Ada Lovelace architecture whitepaper, appendix table (RTX 4090)")),
    (r"RTX 3090", _spec("GeForce RTX 3090", 35.6, 35.6, 71, 71, 936,
                        "NVIDIA Ampere GA102 architecture whitepaper, appendix table (RTX 3090)")),
    (r"V100", _spec("V100", 15.7, 15.7, None, 125, 900, "NVIDIA V100 Tensor Core GPU data sheet (SXM2)")),
    (r"\bT4\b", _spec("T4", 8.1, 8.1, None, 65, 320, "NVIDIA T4 Tensor Core GPU data sheet")),
    # A10G (AWS G5) has no NVIDIA data sheet: it is left out and measured.
)


@dataclass(frozen=True)
class Peak:
    """A peak figure and where it comes from: "table: <data sheet>" or "measured: <how>"."""

    value: float
    source: str


def lookup_gpu(name: str) -> DeviceSpec | None:
    """The `GPU_SPECS` entry for a `torch.cuda.get_device_name` string, or None for a GPU not in the table."""
    for pattern, spec in GPU_SPECS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return spec
    return None


def _normalise(device: str | torch.device) -> torch.device:
    """`device` with the CUDA index filled in ("cuda" -> "cuda:<current>")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: str | torch.device) -> str:
    """The device's name: `torch.cuda.get_device_name` on CUDA, the processor's on the CPU."""
    device = _normalise(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return _cpu_name()
    return device.type


@functools.cache
def _cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else `platform.processor()`."""
    return cpuinfo_value("model name") or platform.processor() or platform.machine() or "cpu"


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_rate(device: torch.device, work: float, step: Callable[[], object]) -> float:
    """Best of `MEASURE_TRIALS` timed trials of `step()` (each `work` units), in units per second."""
    best = 0.0
    for _ in range(MEASURE_TRIALS):
        repeats = 0
        _synchronize(device)
        start = time.perf_counter()
        while True:
            step()
            repeats += 1
            if repeats >= 3:
                _synchronize(device)
                elapsed = time.perf_counter() - start
                if elapsed >= MEASURE_SECONDS:
                    break
        best = max(best, work * repeats / elapsed)
    return best


def measure_matmul_flops(device: str | torch.device, dtype: str = "float32",
                         size: int | None = None) -> float:
    """Measured square-matmul throughput (FLOP/s) of `device` in `dtype` (best of a few timed trials)."""
    device = _normalise(device)
    size = size or MEASURE_SIZE.get(device.type, MEASURE_SIZE["cpu"])
    # A private generator: measuring must not move the global RNG (exact resume depends on it).
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(getattr(torch, dtype))
    b = torch.randn(size, size, device=device, generator=generator).to(getattr(torch, dtype))
    a @ b  # warm-up: kernel selection, thread pool, clocks
    return _best_rate(device, 2.0 * size**3, lambda: a @ b)


def measure_copy_bandwidth(device: str | torch.device, megabytes: int = 256) -> float:
    """Measured device-to-device copy bandwidth (bytes read + written per second)."""
    device = _normalise(device)
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    target.copy_(source)
    return _best_rate(device, 2.0 * source.numel(), lambda: target.copy_(source))


def _peak_kind(device: torch.device, dtype: str) -> str:
    """The `PEAK_KINDS` entry a matmul in `dtype` runs at on `device` (float32 may run as TF32 on CUDA)."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"peak FLOP/s are known for float32, bfloat16 and float16, got dtype {dtype!r}")
    if dtype == "float32" and device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
        return "tfloat32"
    return dtype


def device_peak(device: str | torch.device, dtype: str = "float32") -> Peak:
    """Dense matmul peak (FLOP/s) of `device` in `dtype`: the data sheet's for a known GPU, else measured."""
    device = _normalise(device)
    return _cached_peak(str(device), _peak_kind(device, dtype))


@functools.cache
def _cached_peak(device: str, kind: str) -> Peak:
    """`device_peak` once per (device, kind) and process."""
    torch_device = torch.device(device)
    dtype = "float32" if kind == "tfloat32" else kind  # the matmul precision setting makes it TF32
    size = MEASURE_SIZE.get(torch_device.type, MEASURE_SIZE["cpu"])
    name = device_name(torch_device) if torch_device.type == "cuda" else None
    return table_or_measured_peak(name, kind, lambda: measure_matmul_flops(torch_device, dtype, size),
                                  f"{size}³ {dtype} matmul, best of {MEASURE_TRIALS} trials")


def table_or_measured_peak(gpu_name: str | None, kind: str, measure: Callable[[], float], how: str) -> Peak:
    """The `GPU_SPECS` peak of `kind` for a GPU of that name, else `measure()` (a GPU not in the table, a GPU
    without that kind, or no GPU: `gpu_name` None)."""
    spec = lookup_gpu(gpu_name) if gpu_name is not None else None
    if spec is not None and kind in spec.peak_flops:
        return Peak(spec.peak_flops[kind], f"table: {spec.source}")
    return Peak(measure(), f"measured: {how}")


def peak_flops(device: str | torch.device, dtype: str = "float32") -> float:
    """Dense matmul peak (FLOP/s) of `device` in `dtype`, the denominator of MFU (see `device_peak`)."""
    return device_peak(device, dtype).value


def memory_bandwidth(device: str | torch.device) -> Peak:
    """Memory bandwidth (bytes/s) of `device`: the data sheet's for a known GPU, else a measured copy."""
    return _cached_bandwidth(str(_normalise(device)))


@functools.cache
def _cached_bandwidth(device: str) -> Peak:
    """`memory_bandwidth` once per device and process."""
    torch_device = torch.device(device)
    spec = lookup_gpu(device_name(torch_device)) if torch_device.type == "cuda" else None
    if spec is not None:
        return Peak(spec.memory_bandwidth, f"table: {spec.source}")
    return Peak(measure_copy_bandwidth(torch_device),
                f"measured: 256 MiB device copy, best of {MEASURE_TRIALS} trials")
