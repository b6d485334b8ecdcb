"""coati's model and critic saving: `from_pretrained` directories or state dicts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from detached_rl.models.export import save_merged
from detached_rl.models.lora import lora_backend, merged_model

STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin")


def save_model(model: torch.nn.Module, tokenizer: Any, path: str | os.PathLike) -> Path:
    """`model` (LoRA merged) as a `from_pretrained` directory, or a state dict for a `.pt`/`.pth`/`.bin`."""
    path = Path(path)
    if path.suffix in STATE_DICT_SUFFIXES:
        plain = merged_model(model) if lora_backend(model) is not None else model
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({key: value.detach().cpu() for key, value in plain.state_dict().items()}, path)
        return path
    return save_merged(model, tokenizer, path)


VALUE_HEAD_FILE = "value_head.pt"


def save_critic(critic: torch.nn.Module, path: str | os.PathLike) -> Path:
    """A critic as a state dict (`.pt` path), or as its backbone's `from_pretrained` directory plus
    `value_head.pt` (the head's state dict)."""
    path = Path(path)
    if path.suffix in STATE_DICT_SUFFIXES:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({key: value.detach().cpu() for key, value in critic.state_dict().items()}, path)
        return path
    save_merged(critic.backbone, None, path)
    torch.save({key: value.detach().cpu() for key, value in critic.head.state_dict().items()},
               path / VALUE_HEAD_FILE)
    return path
