"""Generation with Hugging Face `generate` inside the maker process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from detached_rl.core.sampling import SamplingConfig, token_log_probs
from detached_rl.generation.base import GenerationOutput, left_pad
from detached_rl.models.shared_prefix import run_distinct_prompts, supports_shared_prefix


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
