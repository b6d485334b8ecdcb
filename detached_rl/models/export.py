"""Export a trained policy: the LoRA adapter in peft format and a merged model `from_pretrained` loads.

`policy_files` writes both into a temporary directory and returns the files as bytes keyed
by relative path ("adapter/adapter_config.json", "merged/model.safetensors", ...), so a
trainer actor can hand them to a driver on another node; `write_files` puts them on disk.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedTokenizerBase

from detached_rl.models.lora import lora_backend, lora_config_dict, lora_state_dict, merged_model

ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """The adapter of a LoRA model: peft's `save_pretrained` format; loralib:
    safetensors + lora_config.json."""
    directory = Path(directory)
    backend = lora_backend(model)
    if backend is None:
        raise ValueError("save_adapter: the model has no LoRA adapter")
    directory.mkdir(parents=True, exist_ok=True)
    if backend == "peft":
        model.save_pretrained(directory, safe_serialization=True)
    else:
        save_file({k: v.contiguous() for k, v in lora_state_dict(model).items()},
                  directory / "lora_model.safetensors")
        (directory / "lora_config.json").write_text(json.dumps(lora_config_dict(model), indent=2))
    return directory


def save_merged(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None, directory: str | Path) -> Path:
    """A plain model directory (LoRA merged into the weights) with its tokenizer; `model` is unchanged."""
    directory = Path(directory)
    plain = merged_model(model) if lora_backend(model) is not None else model
    if not hasattr(plain, "save_pretrained"):
        raise ValueError(f"save_merged: {type(plain).__name__} is not a Hugging Face model")
    plain.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory


def policy_files(model: nn.Module, tokenizer: PreTrainedTokenizerBase | None) -> dict[str, bytes]:
    """The adapter (if any) and the merged model as {relative path: bytes}."""
    with tempfile.TemporaryDirectory(prefix="detached_rl_export_") as tmp:
        root = Path(tmp)
        if lora_backend(model) is not None:
            save_adapter(model, root / ADAPTER_DIR)
            if tokenizer is not None:
                tokenizer.save_pretrained(root / ADAPTER_DIR)
        save_merged(model, tokenizer, root / MERGED_DIR)
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def write_files(files: dict[str, bytes], root: str | Path) -> list[Path]:
    """Write {relative path: bytes} under `root`; refuses paths that would leave it."""
    root = Path(root).resolve()
    written = []
    for relative, data in files.items():
        target = (root / relative).resolve()
        if root not in target.parents:
            raise ValueError(f"write_files: path {relative!r} leaves {root}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        written.append(target)
    return written
