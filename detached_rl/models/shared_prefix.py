"""Forward passes that run each distinct prompt once: GRPO groups share their prompt.

A GRPO batch holds `group_size` responses per prompt, and prompts are often longer than the
responses (the default job: ~105 prompt tokens, <= 40 response tokens, 8 responses per prompt).
A plain forward computes every prompt `group_size` times. Here the distinct prompts go through
the model once, with the key/value cache kept (and differentiable); the cache is then indexed
out to every row (`index_select`, whose backward sums the rows' gradients into their prompt),
and only the response tokens go through the model on top of it. The logits equal the plain
forward's up to floating-point summation order; gradients flow through the shared prompt.

Layout (as `collate` builds it): `sequences` [B, P + R] is the left-padded prompt region
[B, P] followed by the response region [B, R]; `attention_mask` covers both.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from detached_rl.models._forward import accepts_argument, innermost_model, position_ids_from_mask

# Architectures whose cached forward is checked against the plain one (tests/test_shared_prefix.py):
# positions from `position_ids` and a `DynamicCache` the rows can be indexed in.
# GPT-2 and OPT are left out (their cached forward does not reproduce the padded plain one), Bloom too
# (no `position_ids`).
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt_neox"})


def supports_shared_prefix(model: nn.Module) -> bool:
    """True when `model` is an architecture whose prompt cache can be shared across rows."""
    inner = innermost_model(model)
    return (getattr(inner.config, "model_type", None) in SUPPORTED_MODEL_TYPES
            and accepts_argument(model, "past_key_values") and accepts_argument(model, "position_ids"))


def distinct_prompts(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct prompt [U], row -> distinct prompt index [B]) over the prompt region,
    both on the device of `sequences`."""
    region = torch.cat([sequences[:, :prompt_length], attention_mask[:, :prompt_length].long()], dim=1)
    distinct, inverse = torch.unique(region, dim=0, return_inverse=True)
    return first_row_of_each(inverse, distinct.shape[0]), inverse


def first_row_of_each(inverse: torch.Tensor, count: int) -> torch.Tensor:
    """For row -> group index `inverse` [B] over `count` groups, the first row of each group [count]."""
    rows = inverse.shape[0]
    first = torch.full((count,), rows, dtype=torch.long, device=inverse.device)
    return first.scatter_reduce(0, inverse, torch.arange(rows, device=inverse.device), reduce="amin")


def run_distinct_prompts(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                         prompt_length: int) -> tuple[Any, torch.Tensor] | None:
    """Run the first `prompt_length` columns of each distinct prompt once, keeping the cache, and index that
    cache out to every row: (the model's output for the distinct prompts, row -> distinct prompt index [B]);
    None when no two rows share a prompt (the plain forward is as cheap)."""
    prompt_rows, rows = distinct_prompts(sequences, attention_mask, prompt_length)
    if prompt_rows.numel() == sequences.shape[0]:
        return None
    prefix = model(input_ids=sequences[prompt_rows, :prompt_length],
                   attention_mask=attention_mask[prompt_rows, :prompt_length],
                   position_ids=position_ids_from_mask(attention_mask)[prompt_rows, :prompt_length],
                   use_cache=True, logits_to_keep=1)
    prefix.past_key_values.reorder_cache(rows)  # distinct prompts -> every row (differentiable index_select)
    return prefix, rows


def shared_prefix_logits(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                         response_length: int) -> torch.Tensor | None:
    """Logits [B, R, V] predicting each response token (position j predicts response token j), with
    each distinct prompt run once; None when no two rows share a prompt (the plain forward is as cheap)."""
    prompt_length = sequences.shape[1] - response_length
    shared = run_distinct_prompts(model, sequences, attention_mask, prompt_length)
    if shared is None:
        return None
    prefix, rows = shared
    first_token_logits = prefix.logits[:, -1:].index_select(0, rows)
    if response_length == 1:
        return first_token_logits
    end = prompt_length + response_length - 1  # the last response token predicts nothing we score
    positions = position_ids_from_mask(attention_mask)
    rest = model(input_ids=sequences[:, prompt_length:end], attention_mask=attention_mask[:, :end],
                 position_ids=positions[:, prompt_length:end], past_key_values=prefix.past_key_values,
                 use_cache=True).logits
    return torch.cat([first_token_logits, rest], dim=1)
