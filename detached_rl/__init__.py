"""detached-rl: distributed RLHF / RLVR of language models with long-lived, named Ray actors."""

from __future__ import annotations

__version__ = "0.1.0"

from detached_rl.experience import Experience, ExperienceBatch, ExperienceValidationError, collate, uncollate

__all__ = [
    "Experience",
    "ExperienceBatch",
    "ExperienceValidationError",
    "__version__",
    "collate",
    "uncollate",
]
