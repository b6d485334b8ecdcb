"""Generation backends by name, for `MakerConfig.backend` (a new backend is one module and one line here), and
the LoRA modes they take (`MakerConfig.lora_mode`); torch-free, so the run config checks both."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from detached_rl.generation.base import GenerationBackend
    from detached_rl.models.actor import Actor

BackendFactory = Callable[..., "GenerationBackend"]
# How a maker serves a LoRA policy: "keep" the adapter modules, or "merge" them into plain weights.
LORA_MODES = ("keep", "merge")
# A vLLM engine's dtypes ("auto": bfloat16 where native, else float32; core/native_dtypes.py).
VLLM_DTYPES = ("auto", "bfloat16", "float32", "float16")

# Name -> factory `(actor, lora_mode="keep", **options) -> GenerationBackend`, or "module:attribute" naming
# one, imported on first use (so an engine's heavy or optional package loads only when chosen).
GENERATION_BACKENDS: dict[str, str | BackendFactory] = {
    "hf": "detached_rl.generation.hf:HFGenerationBackend.from_actor",
    # Settings in `MakerConfig.vllm`; the factory sets the engine's environment before vLLM is imported.
    "vllm": "detached_rl.generation.vllm_config:build_vllm_backend",
    # vLLM where the maker's process can serve the policy with it (installed, head size), else "hf".
    "auto": "detached_rl.generation.vllm_config:build_auto_backend",
}


def backend_factory(name: str) -> BackendFactory:
    """The factory registered as `name`; ValueError naming `MakerConfig.backend` for an unknown one."""
    if name not in GENERATION_BACKENDS:
        raise ValueError(f"MakerConfig.backend must be one of {sorted(GENERATION_BACKENDS)}, got {name!r}")
    entry = GENERATION_BACKENDS[name]
    if not isinstance(entry, str):
        return entry
    module_name, _, path = entry.partition(":")
    factory: Any = importlib.import_module(module_name)
    for attribute in path.split("."):
        factory = getattr(factory, attribute)
    return factory


def build_generation_backend(name: str, actor: Actor, lora_mode: str = "keep",
                             options: Mapping[str, Any] | None = None) -> GenerationBackend:
    """Build backend `name` for `actor`; options it does not take are refused naming
    `MakerConfig.backend_options`."""
    from detached_rl.generation.base import GenerationBackend

    factory = backend_factory(name)
    options = dict(options or {})
    try:
        inspect.signature(factory).bind(actor, lora_mode=lora_mode, **options)
    except TypeError as error:
        raise ValueError(f"MakerConfig.backend_options {sorted(options)} do not fit backend "
                         f"{name!r}: {error}") from None
    backend = factory(actor, lora_mode=lora_mode, **options)
    if not isinstance(backend, GenerationBackend):
        raise TypeError(f"backend {name!r} built a {type(backend).__name__}, which is not a "
                        "GenerationBackend")
    return backend
