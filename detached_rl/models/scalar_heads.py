"""Critic and reward model: a transformer backbone with a scalar head."""

from __future__ import annotations

import os

import torch
from torch import nn
from transformers import AutoModel, PreTrainedModel

from detached_rl.models._forward import disable_dropout, forward_kwargs


def backbone_of(model: PreTrainedModel) -> PreTrainedModel:
    """The transformer body of a `*ForCausalLM` model (itself when it has no LM head)."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) and base is not model else model


def _hidden_size(backbone: nn.Module) -> int:
    config = backbone.config
    return int(getattr(config, "hidden_size", None) or config.get_text_config().hidden_size)


class _ScalarHeadModel(nn.Module):
    def __init__(self, backbone: PreTrainedModel, head: nn.Linear | None = None,
                 deterministic: bool = True) -> None:
        super().__init__()
        self.backbone = disable_dropout(backbone) if deterministic else backbone
        hidden = _hidden_size(backbone)
        if head is None:
            head = nn.Linear(hidden, 1)
            # Small init (as OpenRLHF): initial values near 0, so early advantages are not noise.
            nn.init.normal_(head.weight, std=1.0 / (hidden + 1))
            nn.init.zeros_(head.bias)
            param = next(backbone.parameters())
            head.to(device=param.device, dtype=param.dtype)
        self.head = head

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None):
        """Build from a local model directory (its LM head, if any, is dropped; the scalar head is new)."""
        backbone = AutoModel.from_pretrained(path, local_files_only=True, dtype=dtype or torch.float32)
        return cls(backbone)

    def hidden_states(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last-layer hidden states [B, L, H]."""
        out = self.backbone(input_ids=sequences, **forward_kwargs(self.backbone, attention_mask))
        return out.last_hidden_state

    def token_values(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The head applied at every position [B, L], in float32."""
        hidden = self.hidden_states(sequences, attention_mask)
        return self.head(hidden).squeeze(-1).float()


class Critic(_ScalarHeadModel):
    """Value function: a causal-LM backbone with a scalar value head.

    `values[:, t]` is V(prompt + response[:t]): the head at the position just before
    response token t, aligned with `Actor.log_probs`; 0 where `response_mask` is 0.
    """

    def forward(
        self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
    ) -> torch.Tensor:
        """Values [B, R] of the states before each response token."""
        response_length = response_mask.shape[1]
        if response_mask.shape[0] != sequences.shape[0] or response_length >= sequences.shape[1]:
            raise ValueError(
                f"Critic: response_mask shape {tuple(response_mask.shape)} does not fit "
                f"sequences shape {tuple(sequences.shape)}"
            )
        values = self.token_values(sequences, attention_mask)[:, -(response_length + 1) : -1]
        return values.masked_fill(response_mask == 0, 0.0)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index [B] of the last real token of each row (works with left and right padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * (attention_mask != 0)).argmax(dim=1)


class RewardModel(_ScalarHeadModel):
    """Sequence scorer: a backbone (causal LM or encoder such as BERT) with a scalar
    head read at the last token."""

    def forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One reward per sequence [B]: the head at the last real token."""
        values = self.token_values(sequences, attention_mask)
        return values.gather(1, last_token_index(attention_mask).unsqueeze(1)).squeeze(1)

    def score(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor | None = None,
        metadata: list[dict] | None = None,
    ) -> torch.Tensor:
        """Rewards [B] without gradient (the `RewardScorer` interface)."""
        with torch.no_grad():
            return self(sequences, attention_mask)
