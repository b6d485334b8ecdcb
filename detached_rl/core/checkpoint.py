"""Atomic checkpoints: write everything to a temporary directory, then rename it into place.

A crash during a save leaves the previous checkpoint whole. A checkpoint is two files and
nothing is pickled: `tensors.safetensors` holds every tensor (and NumPy array), `state.json`
holds the rest of the nested state (dicts, lists, tuples, numbers, strings) with references
to the tensors by name. Loading one runs no code from the files.
"""

from __future__ import annotations

import base64
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "state.json"
TENSOR_FILE = "tensors.safetensors"
FORMAT = "detached-rl-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or read; the message names the path inside the state."""


def encode_state(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split nested state into a JSON-able tree and the tensors it references by name."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[tuple[int, int]] = set()

    def tensor_ref(value: torch.Tensor, path: str) -> str:
        key = f"t{len(tensors)}"
        tensor = value.detach().cpu().contiguous()
        span = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if tensor.numel() and span in storages:  # safetensors refuses tensors that share memory
            tensor = tensor.clone()
        storages.add((tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()))
        tensors[key] = tensor
        return key

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            return {"__tensor__": tensor_ref(value, path)}
        if isinstance(value, np.ndarray):
            return {"__ndarray__": tensor_ref(torch.from_numpy(np.ascontiguousarray(value)), path)}
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, bytes):
            return {"__bytes__": base64.b64encode(value).decode()}
        if isinstance(value, tuple):
            return {"__tuple__": [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: encode(v, f"{path}.{k}") for k, v in value.items()}
            return {"__items__": [[encode(k, f"{path}<key>"), encode(v, f"{path}[{k!r}]")] for k, v in value.items()]}
        raise CheckpointError(f"checkpoint state at {path or 'the top'}: cannot store a {type(value).__name__}")

    return encode(state, ""), tensors


def decode_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild what `encode_state` split (tensors on the CPU)."""
    def decode(value: Any) -> Any:
        if isinstance(value, list):
            return [decode(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "__tensor__" in value or "__ndarray__" in value:
            key = value.get("__tensor__", value.get("__ndarray__"))
            if key not in tensors:
                raise CheckpointError(f"checkpoint references tensor {key!r}, which {TENSOR_FILE} lacks")
            return tensors[key] if "__tensor__" in value else tensors[key].numpy()
        if "__tuple__" in value:
            return tuple(decode(v) for v in value["__tuple__"])
        if "__bytes__" in value:
            return base64.b64decode(value["__bytes__"])
        if "__items__" in value:
            return {_hashable(decode(k)): decode(v) for k, v in value["__items__"]}
        return {k: decode(v) for k, v in value.items()}

    return decode(tree)


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list | tuple) else key


def write_state(state: Any, directory: Path) -> None:
    """Write `state` into an existing directory as safetensors + JSON (not atomic: see `save_atomic`)."""
    tree, tensors = encode_state(state)
    save_file(tensors, str(directory / TENSOR_FILE))
    (directory / STATE_FILE).write_text(json.dumps({"format": FORMAT, "state": tree}))


def read_state(directory: str | os.PathLike) -> Any:
    """Read what `write_state` wrote; refuses anything else."""
    directory = Path(directory)
    if not (directory / STATE_FILE).is_file() or not (directory / TENSOR_FILE).is_file():
        raise FileNotFoundError(f"{directory} is not a detached-rl checkpoint (no {STATE_FILE} and {TENSOR_FILE})")
    document = json.loads((directory / STATE_FILE).read_text())
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(f"{directory / STATE_FILE}: format is not {FORMAT}")
    return decode_state(document["state"], load_file(str(directory / TENSOR_FILE)))


def save_atomic(state: dict[str, Any], directory: str | os.PathLike) -> Path:
    """Write `state` to `directory`, replacing an existing checkpoint only once the new one is complete."""
    return write_directory_atomically(directory, lambda staging: write_state(state, staging))


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
    """Read a checkpoint written by `save_atomic` (no unpickling)."""
    return read_state(directory)


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
