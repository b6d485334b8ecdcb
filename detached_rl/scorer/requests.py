"""What a maker asks a scorer and what it answers: `ScoreRequest`, `ScoreAnswer`, and merging requests.

A `ScoreRequest` is one maker's padded batch. `sequences` [B, P+R] holds left-padded prompts and
right-padded responses; `attention_mask` [B, P+R]; `response_mask` [B, R] (responses are the last R
columns, as in `ExperienceBatch`); `metadata` one dict per row (e.g. the answer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


class ScoreRequestError(ValueError):
    """A malformed score request; the message names the field."""


@dataclass
class ScoreRequest:
    """A maker's padded batch to score (see the module docstring for the layout)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    metadata: list[dict[str, Any]] = field(default_factory=list)
    min_version: int = -1  # critic: answer with weights of at least this policy version

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return int(self.sequences.shape[0])

    @property
    def prompt_length(self) -> int:
        """P: columns before the responses."""
        return int(self.sequences.shape[1] - self.response_mask.shape[1])

    def validate(self) -> ScoreRequest:
        """Check shapes and dtypes; raise `ScoreRequestError` naming the field."""
        for name in ("sequences", "attention_mask", "response_mask"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                raise ScoreRequestError(f"{name}: expected a 2-D tensor, got {_describe(value)}")
            if value.dtype.is_floating_point or value.dtype == torch.bool:
                raise ScoreRequestError(f"{name}: expected an integer tensor, got {value.dtype}")
        rows, width = self.sequences.shape
        if rows < 1:
            raise ScoreRequestError("sequences: the batch is empty")
        if tuple(self.attention_mask.shape) != (rows, width):
            raise ScoreRequestError(f"attention_mask: shape {tuple(self.attention_mask.shape)} != sequences "
                                    f"{(rows, width)}")
        if self.response_mask.shape[0] != rows or not 1 <= self.response_mask.shape[1] < width:
            raise ScoreRequestError(f"response_mask: shape {tuple(self.response_mask.shape)} does not fit "
                                    f"sequences {(rows, width)} (needs [B, R] with 1 <= R < P+R)")
        if not bool(((self.response_mask == 0) | (self.response_mask == 1)).all()):
            raise ScoreRequestError("response_mask: values must be 0 or 1")
        if not isinstance(self.metadata, list) or (self.metadata and len(self.metadata) != rows):
            raise ScoreRequestError(f"metadata: expected a list of {rows} dicts")
        if not all(isinstance(m, dict) for m in self.metadata):
            raise ScoreRequestError("metadata: every entry must be a dict")
        return self


@dataclass
class ScoreAnswer:
    """A scorer's answer to one request: rewards [B] (+ components) or per-token scores [B, R]."""

    role: str
    rewards: torch.Tensor | None = None
    components: list[dict[str, float]] | None = None
    token_scores: torch.Tensor | None = None  # reference log-probs or critic values
    version: int | None = None  # critic: the weights' policy version
    batched_requests: int = 1  # how many requests the forward pass served
    seconds: float = 0.0


def merge_requests(requests: Sequence[ScoreRequest]) -> ScoreRequest:
    """One padded batch of several requests: prompts left-padded to the longest, responses right-padded."""
    prompt_length = max(r.prompt_length for r in requests)
    response_length = max(int(r.response_mask.shape[1]) for r in requests)

    def pad(value: torch.Tensor, left: int, right: int) -> torch.Tensor:
        return torch.nn.functional.pad(value, (left, right), value=0)

    sequences, attention, response = [], [], []
    for r in requests:
        left, right = prompt_length - r.prompt_length, response_length - int(r.response_mask.shape[1])
        sequences.append(pad(r.sequences, left, right))
        attention.append(pad(r.attention_mask, left, right))
        response.append(pad(r.response_mask, 0, right))
    metadata = [m for r in requests for m in (r.metadata or [{} for _ in range(r.size)])]
    return ScoreRequest(torch.cat(sequences), torch.cat(attention), torch.cat(response), metadata,
                        max(r.min_version for r in requests))


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__
