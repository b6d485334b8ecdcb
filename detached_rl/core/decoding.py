"""Decoding a padded prompt + response batch back to text (for reward functions)."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase


def decode_batch(
    tokenizer: PreTrainedTokenizerBase,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[list[str], list[str]]:
    """Prompt texts and response texts of a padded batch (special tokens dropped)."""
    # The tokenizer reads Python lists: one copy of the batch to the host, not two per row.
    sequences, attention_mask, response_mask = sequences.cpu(), attention_mask.cpu(), response_mask.cpu()
    response_length = response_mask.shape[1]
    prompt_part = sequences[:, :-response_length]
    prompt_mask = attention_mask[:, :-response_length].bool()
    response_part = sequences[:, -response_length:]
    prompts = [
        tokenizer.decode(prompt_part[row][prompt_mask[row]].tolist(), skip_special_tokens=True)
        for row in range(sequences.shape[0])
    ]
    responses = [
        tokenizer.decode(response_part[row][response_mask[row].bool()].tolist(), skip_special_tokens=True)
        for row in range(sequences.shape[0])
    ]
    return prompts, responses
