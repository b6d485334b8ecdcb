"""Atomic checkpoints: write everything to a temporary directory, then rename it into place.

A crash during a save leaves the previous checkpoint whole. Checkpoints are pickled with
`torch.save` and hold Python objects (replay-buffer samples, RNG states): load only files
you wrote yourself.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "state.pt"


def save_atomic(state: dict[str, Any], directory: str | os.PathLike) -> Path:
    """Write `state` to `directory/state.pt`, replacing an existing checkpoint only once the new one is complete."""
    return write_directory_atomically(directory, lambda staging: torch.save(state, staging / STATE_FILE))


def write_directory_atomically(directory: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Let `write` fill a staging directory, then swap it in for `directory` (the old one stays whole until then)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        write(staging)
        if directory.exists():
            retired = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(retired, ignore_errors=True)
            directory.rename(retired)
            staging.rename(directory)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            staging.rename(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def load_state(directory: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by `save_atomic`."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a detached-rl checkpoint (no {STATE_FILE})")
    return torch.load(path, map_location="cpu", weights_only=False)


def rng_state() -> dict[str, Any]:
    """The random states of torch (CPU and CUDA), Python and NumPy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
