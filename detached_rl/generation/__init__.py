"""Generation backends behind `GenerationBackend`, each taking weight updates through its own `WeightSink`."""

from detached_rl.generation.base import (
    LORA_MODES,
    GenerationBackend,
    GenerationOutput,
    ModuleWeightSink,
    SinkCommit,
    TensorLayout,
    WeightSink,
    left_pad,
)
from detached_rl.generation.hf import HFGenerationBackend, MergedLoraSink
from detached_rl.generation.registry import GENERATION_BACKENDS, backend_factory, build_generation_backend
from detached_rl.generation.vllm_config import VLLMConfig, engine_environment

__all__ = [
    "GENERATION_BACKENDS",
    "LORA_MODES",
    "GenerationBackend",
    "GenerationOutput",
    "HFGenerationBackend",
    "MergedLoraSink",
    "ModuleWeightSink",
    "SinkCommit",
    "TensorLayout",
    "VLLMConfig",
    "WeightSink",
    "backend_factory",
    "build_generation_backend",
    "engine_environment",
    "left_pad",
]
