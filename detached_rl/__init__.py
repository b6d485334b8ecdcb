"""detached-rl: distributed RLHF / RLVR of language models with long-lived, named Ray actors."""

from __future__ import annotations

__version__ = "0.1.0"

from detached_rl.experience import Experience, ExperienceBatch, ExperienceValidationError, collate, uncollate
from detached_rl.replay_buffer import ReplayBuffer

__all__ = [
    "Experience",
    "ExperienceBatch",
    "ExperienceValidationError",
    "ReplayBuffer",
    "__version__",
    "collate",
    "uncollate",
]
