"""Sampling settings, logit processing and the generation backend interface.

A backend turns prompts (token ids) into responses and the *behaviour* log-probs of each
generated token: log softmax of the logits the token was actually sampled from, after
temperature, top-k and top-p (the same order and tie rules as Hugging Face's warpers).
`process_logits` reproduces that processing so a forward pass can recompute them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import GenerationConfig, PreTrainedModel

from detached_rl.models.shared_prefix import run_distinct_prompts, supports_shared_prefix


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled. `top_k=0` and `top_p=1.0` switch those filters off."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    do_sample: bool = True
    stop_token_ids: tuple[int, ...] | None = None  # None: the tokenizer's eos token

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingConfig.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"SamplingConfig.temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")


@dataclass
class GenerationOutput:
    """Ragged responses: one 1-D tensor of ids and one of behaviour log-probs per prompt."""

    response_ids: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    finished: list[bool] = field(default_factory=list)  # True when the response ended with a stop token
    prompt_ids: list[torch.Tensor] = field(default_factory=list)  # filled by `Actor.generate`


def process_logits(logits: torch.Tensor, sampling: SamplingConfig | None) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits [..., V]; filtered entries become -inf.

    Greedy decoding (`do_sample=False`) and `sampling=None` leave logits unchanged.
    """
    if sampling is None or not sampling.do_sample:
        return logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.top_k > 0:
        k = min(sampling.top_k, logits.shape[-1])
        kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, descending=False, dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1 - sampling.top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for logits [..., V] and tokens [...], without materialising log_softmax."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension; -inf logits (filtered tokens) contribute 0."""
    log_p = torch.log_softmax(logits, dim=-1)
    p_log_p = torch.where(torch.isinf(logits), torch.zeros_like(log_p), log_p.exp() * log_p)
    return -p_log_p.sum(dim=-1)


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


class HFGenerationBackend:
    """Generation with Hugging Face `generate`; behaviour log-probs come from the processed scores."""

    def __init__(self, model: PreTrainedModel, pad_token_id: int, eos_token_id: int | Sequence[int],
                 share_prompts: bool = True) -> None:
        self.model = model
        # Rows with the same prompt (GRPO groups) prefill it once: see `detached_rl.models.shared_prefix`.
        self.share_prompts = share_prompts and supports_shared_prefix(model)
        self.pad_token_id = pad_token_id
        self.eos_token_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)

    def generate(self, prompt_ids: Sequence[torch.Tensor], sampling: SamplingConfig) -> GenerationOutput:
        """Generate one response per prompt (batched, left-padded)."""
        device = next(self.model.parameters()).device
        input_ids, attention_mask = left_pad(prompt_ids, self.pad_token_id)
        stop_ids = sampling.stop_token_ids or self.eos_token_ids
        # Explicit values when sampling: unset fields would be filled from the model's and
        # transformers' defaults (top_k=50), and the log-probs would not match `process_logits`.
        warpers = (
            dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
            if sampling.do_sample else {}
        )
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.do_sample,
            repetition_penalty=1.0,
            **warpers,
            eos_token_id=list(stop_ids),
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
                out = self.model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                    **self._shared_prompt_cache(input_ids, attention_mask),
                )
        finally:
            self.model.train(was_training)
        generated = out.sequences[:, input_ids.shape[1] :]
        # out.scores[t] holds the processed logits step t sampled from; one step at a time
        # keeps memory at [B, V] instead of [B, T, V].
        log_probs = torch.stack(
            [token_log_probs(step.float(), generated[:, t]) for t, step in enumerate(out.scores)], dim=1
        ).cpu()
        generated = generated.cpu()
        stop = torch.tensor(stop_ids)
        responses, behaviour, finished = [], [], []
        for row in range(generated.shape[0]):
            is_stop = torch.isin(generated[row], stop).nonzero()
            length = int(is_stop[0]) + 1 if is_stop.numel() else generated.shape[1]
            responses.append(generated[row, :length].clone())
            behaviour.append(log_probs[row, :length].clone())
            finished.append(bool(is_stop.numel()))
        return GenerationOutput(responses, behaviour, finished)

    def _shared_prompt_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, Any]:
        """`past_key_values` holding every row's prompt (but its last token) computed once per distinct prompt,
        when rows repeat a prompt (GRPO groups) on an architecture that allows it; else nothing."""
        if input_ids.shape[1] < 2 or not self.share_prompts:
            return {}
        # generate runs the last prompt token itself, for the first logits: cache all but that column
        shared = run_distinct_prompts(self.model, input_ids, attention_mask, input_ids.shape[1] - 1)
        if shared is None:
            return {}
        return {"past_key_values": shared[0].past_key_values}
