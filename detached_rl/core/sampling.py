"""Sampling settings and the logit processing that defines the behaviour distribution.

A generation backend returns, for each generated token, the log softmax of the logits the
token was actually sampled from: after temperature, min-p, top-k and top-p (vLLM's order; the HF
backend builds Hugging Face's warpers in that order, whose tie rules vLLM shares), renormalised
over the tokens kept. `process_logits` reproduces that processing so a trainer's forward pass
recomputes exactly those log-probs, and the PPO ratio of an on-policy sample is 1 whatever
truncates the sampling. Conventions: logits [..., V], the vocabulary on the last dimension;
filtered entries become -inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The functions import torch where they run: `SamplingConfig` is part of the run config, which loads no torch.


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled. `top_k=0`, `top_p=1.0` and `min_p=0.0` switch those filters off."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    # Keep the tokens at least this likely relative to the most likely one (after temperature).
    min_p: float = 0.0
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
        if not 0 <= self.min_p < 1:
            raise ValueError(f"SamplingConfig.min_p must be in [0, 1) (0 = off), got {self.min_p}")

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p leave tokens out of the sampled distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def process_logits(logits: torch.Tensor, sampling: SamplingConfig | None) -> torch.Tensor:
    """Apply temperature, min-p, top-k and top-p to logits [..., V]; filtered entries become -inf.

    Greedy decoding (`do_sample=False`) and `sampling=None` leave logits unchanged.
    """
    import torch

    if sampling is None or not sampling.do_sample:
        return logits
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if sampling.min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = sampling.min_p * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))  # the most likely token always stays
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
    import torch

    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension; -inf logits (filtered tokens) contribute 0."""
    import torch

    filtered = torch.isinf(logits)
    # Zero the -inf log-probs before the product: exp(-inf) * -inf is NaN in the
    # backward pass even where masked.
    log_p = torch.log_softmax(logits, dim=-1).masked_fill(filtered, 0.0)
    p_log_p = torch.where(filtered, torch.zeros_like(log_p), log_p.exp() * log_p)
    return -p_log_p.sum(dim=-1)
