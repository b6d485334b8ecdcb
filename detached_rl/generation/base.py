"""The generation backend interface: prompts (token ids) in, responses and behaviour log-probs out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from detached_rl.core.sampling import SamplingConfig


@dataclass
class GenerationOutput:
    """Ragged responses: one 1-D tensor of ids and one of behaviour log-probs per prompt."""

    response_ids: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    finished: list[bool] = field(default_factory=list)  # True when the response ended with a stop token
    prompt_ids: list[torch.Tensor] = field(default_factory=list)  # filled by `Actor.generate`


@runtime_checkable
class GenerationBackend(Protocol):
    """Turns prompts into responses with behaviour log-probs (HF `generate` now, vLLM later)."""

    def generate(self, prompt_ids: Sequence[torch.Tensor], sampling: SamplingConfig) -> GenerationOutput:
        """Generate one response per prompt."""
        ...


def left_pad(sequences: Sequence[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D id tensors into (ids [B, L], attention_mask [B, L])."""
    if len(sequences) == 0:
        raise ValueError("left_pad: no sequences")
    length = max(s.numel() for s in sequences)
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq.numel() == 0:
            raise ValueError(f"left_pad: sequence {row} is empty")
        ids[row, length - seq.numel() :] = seq
        mask[row, length - seq.numel() :] = 1
    return ids, mask
