"""Experience: one generated response with everything a trainer needs, as it travels between actors.

Wire format: one `Experience` per response, ragged (no padding). Tensors are 1-D and on
the CPU when they travel; ids are int64, float fields are any floating dtype.
Token-aligned fields (`log_probs`, `values`, `ref_log_probs`, `advantages`, `returns`,
a per-token `reward`) have one entry per response token: entry t belongs to
`response_ids[t]` (its log-prob given the prompt and `response_ids[:t]`).

`validate` checks a sample (`detached_rl.core.experience_checks` holds the checks and their bounds);
strings and `info` count in `nbytes`, the replay buffer's budget unit. The padded batch form
(`ExperienceBatch`, `collate`) is in `detached_rl.core.experience_batch`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from detached_rl.core.experience_checks import (
    DEFAULT_MAX_ABS_REWARD,
    ESTIMATE_SCALE,
    LOG_PROB_BOUND,
    MAX_ABS_REWARD_LIMIT,
    MAX_INFO_BYTES,
    MAX_NAME_BYTES,
    TOKEN_FIELDS,
    TRAINING_DTYPE,
    ExperienceValidationError,
    short_repr,
    validate_experience,
)

# The checks' names, importable from here too: they are the contract of `Experience.validate`.
__all__ = [
    "DEFAULT_MAX_ABS_REWARD", "ESTIMATE_SCALE", "LOG_PROB_BOUND", "MAX_ABS_REWARD_LIMIT", "MAX_INFO_BYTES",
    "MAX_NAME_BYTES", "TOKEN_FIELDS", "TRAINING_DTYPE", "Experience", "ExperienceValidationError",
    "new_experience_id", "short_repr",
]


def new_experience_id() -> str:
    """Return a fresh unique experience id."""
    return uuid.uuid4().hex


@dataclass
class Experience:
    """One response to one prompt, scored, tagged with the policy version that produced it."""

    prompt_ids: torch.Tensor
    response_ids: torch.Tensor
    log_probs: torch.Tensor
    reward: torch.Tensor
    policy_version: int = 0
    maker: str = ""
    id: str = field(default_factory=new_experience_id)
    values: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    group_id: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def response_length(self) -> int:
        """Number of response tokens."""
        return int(self.response_ids.numel())

    @property
    def score(self) -> float:
        """The sequence-level reward: the scalar reward, or the sum of a per-token
        reward (summed in float64)."""
        return float(self.reward.detach().to(torch.float64).sum())

    def nbytes(self) -> int:
        """Bytes the sample holds: its tensors, its strings (UTF-8) and its `info` (as
        JSON); the buffer's budget unit."""
        total = 0
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
            elif isinstance(value, str):
                total += len(value.encode("utf-8", "surrogatepass"))
        return total + _info_nbytes(self.info)

    def validate(self, vocab_size: int | None = None,
                 max_abs_reward: float = MAX_ABS_REWARD_LIMIT) -> Experience:
        """Check shapes, dtypes, values and sizes; raise `ExperienceValidationError` naming the bad field.

        Rewards must lie within `max_abs_reward` (the trainer's `trainer.max_abs_reward`), values, returns and
        advantages within `ESTIMATE_SCALE` times it, log-probs within `LOG_PROB_BOUND`; all finite in float32.
        """
        return validate_experience(self, vocab_size, max_abs_reward)

    def to(self, device: torch.device | str) -> Experience:
        """Return a copy with every tensor moved to `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device) if isinstance(getattr(self, f.name), torch.Tensor)
            else getattr(self, f.name)
            for f in fields(self)
        }
        return Experience(**moved)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict (tensors as lists)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.tolist() if isinstance(value, torch.Tensor) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Experience:
        """Rebuild an experience from `to_dict` output; unknown keys are refused."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ExperienceValidationError(unknown[0], f"unknown field (known: {sorted(known)})")
        kwargs = dict(data)
        for name in ("prompt_ids", "response_ids"):
            if name in kwargs:
                kwargs[name] = torch.tensor(kwargs[name], dtype=torch.long)
        for name in ("log_probs", "reward", *TOKEN_FIELDS):
            if kwargs.get(name) is not None:
                kwargs[name] = torch.tensor(kwargs[name], dtype=torch.float32)
        return cls(**kwargs)


def _info_nbytes(info: Any) -> int:
    try:
        return len(json.dumps(info, allow_nan=True))  # ASCII (non-ASCII is escaped): characters are bytes
    except (TypeError, ValueError):  # an unvalidated sample (a restored state): count its text form
        return len(repr(info))
