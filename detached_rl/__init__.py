"""detached-rl: distributed RLHF / RLVR of language models with long-lived, named Ray actors."""

from __future__ import annotations

import logging

__version__ = "0.1.0"

# bitsandbytes (installed for colossalai's optimizers) warns at import, which peft triggers, that an
# optional CPU 4-bit kernel package is missing; nothing here quantises to 4 bits.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)

# Each name is imported on first use: `import detached_rl` (and so `detached_rl.config`) loads neither torch
# nor Ray.
_LAZY = {
    "Experience": "detached_rl.core.experience",
    "ExperienceValidationError": "detached_rl.core.experience",
    "ExperienceBatch": "detached_rl.core.experience_batch",
    "collate": "detached_rl.core.experience_batch",
    "uncollate": "detached_rl.core.experience_batch",
    "ReplayBuffer": "detached_rl.core.replay_buffer",
    "ExperienceMakerHolder": "detached_rl.actors",
    "DetachedPPOTrainer": "detached_rl.actors",
    "DetachedGRPOTrainer": "detached_rl.actors",
    "attach": "detached_rl.actors",
    "start_trainer_group": "detached_rl.actors",
}


def __getattr__(name: str):
    """Import the public names on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'detached_rl' has no attribute {name!r}")


__all__ = [
    "DetachedGRPOTrainer",
    "DetachedPPOTrainer",
    "ExperienceMakerHolder",
    "Experience",
    "ExperienceBatch",
    "ExperienceValidationError",
    "ReplayBuffer",
    "attach",
    "__version__",
    "collate",
    "start_trainer_group",
    "uncollate",
]
