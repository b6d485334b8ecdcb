"""Generation backends behind `GenerationBackend`, each taking weight updates through its own sink."""

from detached_rl.generation.base import GenerationBackend, GenerationOutput, left_pad

__all__ = ["GenerationBackend", "GenerationOutput", "left_pad"]
