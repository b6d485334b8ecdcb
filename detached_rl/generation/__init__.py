"""Generation backends behind `GenerationBackend`, each taking weight updates through its own `WeightSink`.

The names a config picks (backends, LoRA modes) and `VLLMConfig` are torch-free (`registry`, `vllm_config`);
every public name here is imported on first use.
"""

from detached_rl.core.lazy import lazy_exports

# Public name -> its module, imported on first use (importing the package loads no torch).
_LAZY = {
    "GenerationBackend": "detached_rl.generation.base",
    "GenerationOutput": "detached_rl.generation.base",
    "ModuleWeightSink": "detached_rl.generation.base",
    "SinkCommit": "detached_rl.generation.base",
    "TensorLayout": "detached_rl.generation.base",
    "WeightSink": "detached_rl.generation.base",
    "left_pad": "detached_rl.generation.base",
    "HFGenerationBackend": "detached_rl.generation.hf",
    "MergedLoraSink": "detached_rl.generation.hf",
    "GENERATION_BACKENDS": "detached_rl.generation.registry",
    "LORA_MODES": "detached_rl.generation.registry",
    "backend_factory": "detached_rl.generation.registry",
    "build_generation_backend": "detached_rl.generation.registry",
    "VLLMConfig": "detached_rl.generation.vllm_config",
    "engine_environment": "detached_rl.generation.vllm_config",
}
__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = sorted(_LAZY)
