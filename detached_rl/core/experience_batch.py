"""The padded batch form of experiences: `ExperienceBatch`, `collate` and its inverse `uncollate`.

Batch format (built by `collate` on the trainer): prompts are left-padded to the longest prompt, responses
right-padded to the longest response, so every response starts at column `prompt_len` of `sequences`.
`collate(..., device=)` pads on the host (in pinned memory when the batch goes to a CUDA device) and copies
the batch over once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from detached_rl.core.devices import pin_for, to_device
from detached_rl.core.experience import Experience
from detached_rl.core.experience_checks import TOKEN_FIELDS, ExperienceValidationError


@dataclass
class ExperienceBatch:
    """A padded batch of experiences. B = batch size, P = longest prompt, R = longest response.

    `sequences` [B, P+R] holds left-padded prompts then right-padded responses;
    `attention_mask` [B, P+R] marks real tokens; `response_mask` [B, R] marks response
    tokens. Token fields are [B, R] float32, 0 at padding. A scalar reward sits at the
    last response token of `token_rewards`; `scores` [B] is each sequence's total reward.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    prompt_length: int
    log_probs: torch.Tensor
    token_rewards: torch.Tensor
    scores: torch.Tensor
    scalar_reward: torch.Tensor
    policy_versions: torch.Tensor
    ids: list[str]
    makers: list[str]
    group_ids: list[str | None]
    infos: list[dict[str, Any]]
    values: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    old_log_probs: torch.Tensor | None = None  # trainer-side: the proximal policy's log-probs
    loss_weights: torch.Tensor | None = None  # trainer-side: per-token loss weights (importance weights)

    @property
    def size(self) -> int:
        """Number of sequences."""
        return int(self.sequences.shape[0])

    @property
    def response_ids(self) -> torch.Tensor:
        """[B, R] response token ids (padding where `response_mask` is 0)."""
        return self.sequences[:, self.prompt_length :]

    @property
    def num_response_tokens(self) -> int:
        """Count of valid response tokens in the batch."""
        return int(self.response_mask.sum())

    def select(self, rows: Sequence[int] | torch.Tensor) -> ExperienceBatch:
        """The sub-batch of the given rows, with padding columns no row uses trimmed away."""
        positions = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        index = torch.as_tensor(positions, dtype=torch.long, device=self.sequences.device)
        used_prompt_columns = self.attention_mask[index, : self.prompt_length].any(0)
        # Both trim bounds in one device-to-host transfer: the first prompt column any row uses
        # (prompts are never empty) and the longest response.
        prompt_start, response_length = torch.stack(
            [used_prompt_columns.int().argmax(), self.response_mask[index].sum(1).max()]).tolist()
        response_length = max(response_length, 1)
        end = self.prompt_length + response_length
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                picked[f.name] = [value[i] for i in positions]
            elif f.name in ("sequences", "attention_mask"):
                picked[f.name] = value[index, prompt_start:end]
            elif isinstance(value, torch.Tensor) and value.dim() == 2:
                picked[f.name] = value[index, :response_length]
            elif isinstance(value, torch.Tensor):
                picked[f.name] = value[index]
            else:
                picked[f.name] = value
        picked["prompt_length"] = self.prompt_length - prompt_start
        return ExperienceBatch(**picked)

    def to(self, device: torch.device | str) -> ExperienceBatch:
        """Return a copy with every tensor moved to `device` (from the host to CUDA: pinned, non-blocking)."""
        return ExperienceBatch(
            **{
                f.name: to_device(getattr(self, f.name), device)
                if isinstance(getattr(self, f.name), torch.Tensor)
                else getattr(self, f.name)
                for f in fields(self)
            }
        )


def collate(experiences: Sequence[Experience], pad_token_id: int = 0,
            device: torch.device | str | None = None) -> ExperienceBatch:
    """Pad a list of experiences into one batch (prompts left-padded, responses right-padded).

    The batch is padded where the experiences are (the host, for experiences off the wire) and
    then moved to `device` in one copy per tensor; for a CUDA `device` it is padded in pinned
    memory and copied without blocking. None: it stays where the experiences are.
    """
    if len(experiences) == 0:
        raise ValueError("collate: experiences is empty")
    for name in TOKEN_FIELDS:
        present = [getattr(e, name) is not None for e in experiences]
        if any(present) and not all(present):
            raise ExperienceValidationError(name, "present on some experiences of the batch but not all")
    batch_size = len(experiences)
    prompt_len = max(e.prompt_ids.numel() for e in experiences)
    response_len = max(e.response_length for e in experiences)
    where = experiences[0].prompt_ids.device
    on = {"device": where, "pin_memory": where.type == "cpu" and pin_for(device)}
    sequences = torch.full((batch_size, prompt_len + response_len), pad_token_id, dtype=torch.long, **on)
    attention_mask = torch.zeros((batch_size, prompt_len + response_len), dtype=torch.long, **on)
    response_mask = torch.zeros((batch_size, response_len), dtype=torch.long, **on)
    log_probs = torch.zeros((batch_size, response_len), **on)
    token_rewards = torch.zeros((batch_size, response_len), **on)
    optional = {
        name: (torch.zeros((batch_size, response_len), **on) if getattr(experiences[0], name) is not None
               else None)
        for name in TOKEN_FIELDS
    }
    for row, exp in enumerate(experiences):
        p, r = exp.prompt_ids.numel(), exp.response_length
        sequences[row, prompt_len - p : prompt_len] = exp.prompt_ids
        sequences[row, prompt_len : prompt_len + r] = exp.response_ids
        attention_mask[row, prompt_len - p : prompt_len + r] = 1
        response_mask[row, :r] = 1
        log_probs[row, :r] = exp.log_probs.float()
        if exp.reward.dim() == 0:
            token_rewards[row, r - 1] = exp.reward.float()
        else:
            token_rewards[row, :r] = exp.reward.float()
        for name, target in optional.items():
            if target is not None:
                target[row, :r] = getattr(exp, name).float()
    batch = ExperienceBatch(
        sequences=sequences,
        attention_mask=attention_mask,
        response_mask=response_mask,
        prompt_length=prompt_len,
        log_probs=log_probs,
        token_rewards=token_rewards,
        scores=token_rewards.sum(dim=1),
        scalar_reward=torch.tensor([e.reward.dim() == 0 for e in experiences], device=where),
        policy_versions=torch.tensor([e.policy_version for e in experiences], dtype=torch.long, device=where),
        ids=[e.id for e in experiences],
        makers=[e.maker for e in experiences],
        group_ids=[e.group_id for e in experiences],
        infos=[dict(e.info) for e in experiences],
        **optional,
    )
    return batch if device is None else batch.to(device)


def uncollate(batch: ExperienceBatch) -> list[Experience]:
    """Split a padded batch back into ragged experiences (inverse of `collate`)."""
    out = []
    # Per-row lengths and flags read back once (not one device sync per row); tensors
    # stay on the batch's device.
    prompt_lengths = batch.attention_mask[:, : batch.prompt_length].sum(1).tolist()
    response_lengths = batch.response_mask.sum(1).tolist()
    scalar_rewards = batch.scalar_reward.tolist()
    policy_versions = batch.policy_versions.tolist()
    for row in range(batch.size):
        r, p = response_lengths[row], prompt_lengths[row]
        prompt_ids = batch.sequences[row, batch.prompt_length - p : batch.prompt_length]  # left-padded
        if scalar_rewards[row]:
            reward = batch.token_rewards[row, r - 1].clone()
        else:
            reward = batch.token_rewards[row, :r].clone()
        optional = {
            name: getattr(batch, name)[row, :r].clone() if getattr(batch, name) is not None else None
            for name in TOKEN_FIELDS
        }
        out.append(
            Experience(
                prompt_ids=prompt_ids.clone(),
                response_ids=batch.response_ids[row, :r].clone(),
                log_probs=batch.log_probs[row, :r].clone(),
                reward=reward,
                policy_version=int(policy_versions[row]),
                maker=batch.makers[row],
                id=batch.ids[row],
                group_id=batch.group_ids[row],
                info=dict(batch.infos[row]),
                **optional,
            )
        )
    return out
