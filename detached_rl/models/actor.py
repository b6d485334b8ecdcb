"""Actor: a causal-LM policy that encodes prompts and recomputes log-probs (a
generation backend generates)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from detached_rl.core.sampling import SamplingConfig, entropy_from_logits, process_logits, token_log_probs
from detached_rl.models._forward import accepts_argument, disable_dropout, forward_kwargs
from detached_rl.models.shared_prefix import shared_prefix_logits, supports_shared_prefix

Prompt = str | Sequence[Mapping[str, str]] | Sequence[int] | torch.Tensor


def reference_sampling(sampling: SamplingConfig | None) -> SamplingConfig | None:
    """The distribution reference log-probs are scored on: `sampling`'s temperature, the full vocabulary.

    One convention (docs/algorithms-and-rewards.md, "KL to the reference"): behaviour log-probs, and the
    trainer's recomputation for the PPO ratio, come from the processed distribution (temperature, min-p,
    top-k, top-p); reference log-probs, wherever they are computed (maker, reference scorer, GRPO trainer),
    come from the temperature-scaled full distribution. The reference's own top-k/top-p would give -inf to a
    sampled token outside it (its top-k is not the policy's); over the full vocabulary every token the policy
    can sample has a finite log-prob, and the KL estimates KL(sampling policy || reference).
    """
    if sampling is None or not sampling.truncates:
        return sampling
    return dataclasses.replace(sampling, top_k=0, top_p=1.0, min_p=0.0)


class Actor(nn.Module):
    """Wraps any `AutoModelForCausalLM` (plain, peft or DDP-wrapped) as an RL policy.

    Sequence layout (as `detached_rl.collate` builds it): `sequences` [B, P+R] holds
    left-padded prompts then right-padded responses; `response_mask` [B, R] marks the
    response tokens, which occupy the last R columns. `log_probs[:, t]` is the
    log-probability of `sequences[:, P+t]` given everything before it; 0 where masked.
    With `deterministic` (default) dropout is switched off, so an unchanged policy
    reproduces its behaviour log-probs in train mode too. With `share_prompts` (default),
    rows with the same prompt (a GRPO group) run that prompt through the model once
    (`shared_prefix`), on the architectures where that reproduces the plain forward.
    Generation goes through a backend built for the actor, e.g.
    `HFGenerationBackend.from_actor(actor).generate_text(prompts, sampling)`.
    """

    def __init__(
        self,
        model: PreTrainedModel | nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        deterministic: bool = True,
        share_prompts: bool = True,
    ) -> None:
        super().__init__()
        self.model = disable_dropout(model) if deterministic else model
        self.share_prompts = share_prompts and supports_shared_prefix(model)
        self.tokenizer = tokenizer

    def encode_prompts(self, prompts: Sequence[Prompt], chat: bool = True) -> list[torch.Tensor]:
        """Token ids of each prompt: strings and message lists go through the chat
        template when there is one."""
        encoded = []
        for prompt in prompts:
            if isinstance(prompt, torch.Tensor):
                ids = prompt.long().flatten().tolist()
            elif isinstance(prompt, str):
                if chat and self.tokenizer.chat_template:
                    ids = self._chat_ids([{"role": "user", "content": prompt}])
                else:
                    ids = self.tokenizer(prompt)["input_ids"]
            elif len(prompt) > 0 and isinstance(prompt[0], Mapping):
                ids = self._chat_ids(list(prompt))
            else:
                ids = list(prompt)
            if len(ids) == 0:
                raise ValueError(f"prompt {prompt!r} encodes to no tokens")
            encoded.append(torch.tensor(ids, dtype=torch.long))
        return encoded

    def _chat_ids(self, messages: list[Any]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, Mapping) else out)

    def forward(
        self,
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
        response_mask: torch.Tensor,
        sampling: SamplingConfig | None = None,
        return_entropy: bool = False,
        entropy_grad: bool = True,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [B, R] of the response tokens, from one forward pass (0 where masked).

        With `sampling`, logits are processed as during generation (temperature, top-k,
        top-p), so an unchanged model reproduces the behaviour log-probs. With
        `return_entropy`, also the entropy [B, R] of each position's (processed) distribution;
        `entropy_grad=False` computes it outside autograd (a metric only: no graph over [B, R, V]).
        """
        if sequences.shape != attention_mask.shape:
            raise ValueError(
                f"Actor.log_probs: attention_mask shape {tuple(attention_mask.shape)} "
                f"!= sequences shape {tuple(sequences.shape)}"
            )
        response_length = response_mask.shape[1]
        if response_mask.shape[0] != sequences.shape[0] or response_length >= sequences.shape[1]:
            raise ValueError(
                f"Actor.log_probs: response_mask shape {tuple(response_mask.shape)} does not fit "
                f"sequences shape {tuple(sequences.shape)}"
            )
        logits = None
        if self.share_prompts:
            logits = shared_prefix_logits(self.model, sequences, attention_mask, response_length)
        if logits is None:
            kwargs: dict[str, Any] = forward_kwargs(self.model, attention_mask)
            if accepts_argument(self.model, "logits_to_keep"):
                kwargs["logits_to_keep"] = response_length + 1  # skip the LM head on prompt positions
            # logits at position i predict token i + 1: the R positions before each response token.
            logits = self.model(input_ids=sequences, **kwargs).logits[:, -(response_length + 1) : -1]
        logits = logits.float()
        logits = process_logits(logits, sampling)
        targets = sequences[:, -response_length:]
        log_probs = token_log_probs(logits, targets).masked_fill(response_mask == 0, 0.0)
        if not return_entropy:
            return log_probs
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
        return log_probs, entropy.masked_fill(response_mask == 0, 0.0)

    log_probs = forward
