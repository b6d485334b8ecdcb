"""The reward interface makers score with, and its adapters (plain Python functions, re-tokenizing models).

A `RewardScorer` maps a padded batch (`sequences` [B, P+R], `attention_mask` [B, P+R],
`response_mask` [B, R], responses in the last R columns) plus optional per-sample
`metadata` dicts (e.g. the ground-truth answer) to one reward per sequence, [B] float32 on the
device of `sequences`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase

from detached_rl.core.decoding import decode_batch
from detached_rl.core.devices import to_device
from detached_rl.models.scalar_heads import RewardModel

RewardFunction = Callable[..., float | Mapping[str, float]]
"""fn(prompt: str, response: str, **metadata) -> reward, or a dict with key "reward" and components."""


@runtime_checkable
class RewardScorer(Protocol):
    """Anything that scores a padded batch of prompt + response sequences."""

    def score(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        metadata: list[dict[str, Any]] | None = None,
    ) -> torch.Tensor:
        """Rewards [B], float32 on the device of `sequences`, no gradient."""
        ...


class FunctionReward:
    """Turns a plain Python reward function of (prompt text, response text,
    **metadata) into a `RewardScorer`."""

    def __init__(self, fn: RewardFunction, tokenizer: PreTrainedTokenizerBase) -> None:
        self.fn = fn
        self.tokenizer = tokenizer

    def score_detailed(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        metadata: list[dict[str, Any]] | None = None,
    ) -> tuple[torch.Tensor, list[dict[str, float]]]:
        """Rewards [B] and, per sample, the components the function reported
        (empty when it returns a float)."""
        prompts, responses = decode_batch(self.tokenizer, sequences, attention_mask, response_mask)
        metadata = metadata or [{} for _ in prompts]
        if len(metadata) != len(prompts):
            raise ValueError(f"FunctionReward: metadata has {len(metadata)} entries for "
                             f"{len(prompts)} sequences")
        rewards, components = [], []
        for prompt, response, meta in zip(prompts, responses, metadata, strict=True):
            result = self.fn(prompt, response, **meta)
            if isinstance(result, Mapping):
                if "reward" not in result:
                    raise ValueError("reward function returned a dict without a 'reward' key: "
                                     f"{dict(result)}")
                parts = {key: float(value) for key, value in result.items() if key != "reward"}
                value = float(result["reward"])
            else:
                parts, value = {}, float(result)
            if not math.isfinite(value):
                raise ValueError(f"reward function returned a non-finite reward {value} for response "
                                 f"{response!r}")
            rewards.append(value)
            components.append(parts)
        return torch.tensor(rewards, dtype=torch.float32, device=sequences.device), components

    def score(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        metadata: list[dict[str, Any]] | None = None,
    ) -> torch.Tensor:
        """Rewards [B]."""
        return self.score_detailed(sequences, attention_mask, response_mask, metadata)[0]


class RetokenizingRewardModel:
    """Scores with a `RewardModel` whose tokenizer differs from the policy's (e.g. a BERT reward model).

    Each prompt + response is decoded with the policy tokenizer and re-encoded with the
    reward model's as a text pair, right-padded, truncated to `max_length`.
    """

    def __init__(
        self,
        model: RewardModel,
        tokenizer: PreTrainedTokenizerBase,
        policy_tokenizer: PreTrainedTokenizerBase,
        max_length: int = 512,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.policy_tokenizer = policy_tokenizer
        self.max_length = max_length

    def score(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        metadata: list[dict[str, Any]] | None = None,
    ) -> torch.Tensor:
        """Rewards [B] on the device of `sequences` (the reward model runs where its weights are)."""
        prompts, responses = decode_batch(self.policy_tokenizer, sequences, attention_mask, response_mask)
        encoded = self.tokenizer(
            prompts, responses, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        device = next(self.model.parameters()).device
        with torch.no_grad():
            rewards = self.model(to_device(encoded["input_ids"], device),
                                 to_device(encoded["attention_mask"], device))
        return rewards.float().to(sequences.device)
