"""Atomic checkpoints: write everything to a staging directory, fsync it, then rename it into place.

A checkpoint `<dir>` is replaced in two renames: `<dir>` -> `.<dir>.old`, then the staging
directory `.<dir>.staging-<pid>-<random>` -> `<dir>`; each is made durable by an fsync of the
parent. A process killed at any point leaves a loadable checkpoint: the new one, or the previous
one as `.<dir>.old` (which `load_state` falls back to, saying so in the log). Staging directories
of dead processes are removed by the next save or load.

A checkpoint is two files and nothing is pickled: `tensors.safetensors` holds every tensor (and
NumPy array), `state.json` holds the rest of the nested state (dicts, lists, tuples, numbers,
strings) with references to the tensors by name. Loading one runs no code from the files.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

STATE_FILE = "state.json"
TENSOR_FILE = "tensors.safetensors"
FORMAT = "detached-rl-checkpoint/1"
STAGING_MARK = ".staging-"  # staging directories: .<name>.staging-<pid>-<random>

logger = logging.getLogger(__name__)
# Saves and loads of this process: a load never sees a save between its renames, and a save's
# staging directory (named after this pid, like a dead predecessor's would be) is never taken for stale.
_LOCK = threading.RLock()
_IN_PROGRESS: set[Path] = set()


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
            return {"__items__": [[encode(k, f"{path}<key>"), encode(v, f"{path}[{k!r}]")]
                                  for k, v in value.items()]}
        raise CheckpointError(f"checkpoint state at {path or 'the top'}: cannot store a "
                              f"{type(value).__name__}")

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
        raise FileNotFoundError(f"{directory} is not a detached-rl checkpoint (no {STATE_FILE} and "
                                f"{TENSOR_FILE})")
    document = json.loads((directory / STATE_FILE).read_text())
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(f"{directory / STATE_FILE}: format is not {FORMAT}")
    return decode_state(document["state"], load_file(str(directory / TENSOR_FILE)))


def save_atomic(state: dict[str, Any], directory: str | os.PathLike) -> Path:
    """Write `state` to `directory`, replacing an existing checkpoint only once the new one is complete."""
    return write_directory_atomically(directory, lambda staging: write_state(state, staging))


def write_directory_atomically(directory: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Let `write` fill a staging directory, fsync it, then swap it in for
    `directory` (see the module doc)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(directory)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}{STAGING_MARK}{os.getpid()}-",
                                    dir=directory.parent))
    with _LOCK:
        _IN_PROGRESS.add(staging.resolve())
    try:
        write(staging)
        _fsync_tree(staging)
        retired = previous_checkpoint(directory)
        with _LOCK:
            if directory.exists():
                # An existing `<dir>` is complete, so a `.old` beside it is the leftover of a finished swap.
                shutil.rmtree(retired, ignore_errors=True)
                directory.rename(retired)
                _fsync(directory.parent)
            staging.rename(directory)
            _fsync(directory.parent)
        if retired.exists():
            shutil.rmtree(retired, ignore_errors=True)
            _fsync(directory.parent)
    finally:
        with _LOCK:
            _IN_PROGRESS.discard(staging.resolve())
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def previous_checkpoint(directory: str | os.PathLike) -> Path:
    """Where a save keeps the checkpoint it replaces until the new one is in
    place: `.<name>.old` beside it."""
    directory = Path(directory)
    return directory.with_name(f".{directory.name}.old")


def has_checkpoint(directory: str | os.PathLike) -> bool:
    """True if `load_state(directory)` finds a checkpoint there or, after an
    interrupted save, its previous one."""
    return _is_complete(Path(directory)) or _is_complete(previous_checkpoint(directory))


def remove_stale_staging(directory: str | os.PathLike) -> list[Path]:
    """Delete the staging directories of `directory` left by killed saves; returns their paths.

    Stale means made by a process that is gone, or by this process but no save of it is using it
    (a restarted process may get the pid of its killed predecessor).
    """
    directory = Path(directory)
    prefix = f".{directory.name}{STAGING_MARK}"
    try:
        names = os.listdir(directory.parent)
    except FileNotFoundError:
        return []
    removed = []
    with _LOCK:
        for name in names:
            pid_text = name[len(prefix):].partition("-")[0] if name.startswith(prefix) else ""
            path = directory.parent / name
            if (pid_text.isdigit() and path.resolve() not in _IN_PROGRESS
                    and not _other_process_alive(int(pid_text))):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    if removed:
        logger.info("removed %d staging directories of interrupted saves of %s: %s",
                    len(removed), directory, ", ".join(p.name for p in removed))
    return removed


def _other_process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _is_complete(directory: Path) -> bool:
    return (directory / STATE_FILE).is_file() and (directory / TENSOR_FILE).is_file()


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so the tree is on disk before it is renamed in."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))


def load_state(directory: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint written by `save_atomic` (no unpickling), or its previous one
    after an interrupted save."""
    directory = Path(directory)
    with _LOCK:
        remove_stale_staging(directory)
        source = directory
        previous = previous_checkpoint(directory)
        if not _is_complete(directory) and _is_complete(previous):
            logger.warning("checkpoint %s is missing or incomplete (a save was interrupted between "
                           "its renames): loading the previous checkpoint %s", directory, previous)
            source = previous
        return read_state(source)


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
