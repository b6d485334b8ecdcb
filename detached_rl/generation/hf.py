"""Generation with Hugging Face `generate` inside the maker process; weights written into the torch model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from detached_rl.core.sampling import SamplingConfig, token_log_probs
from detached_rl.core.weight_sink import ModuleWeightSink, SinkCommit, WeightSink
from detached_rl.generation.base import LORA_MODES, GenerationOutput, left_pad
from detached_rl.models.actor import Actor, Prompt
from detached_rl.models.lora import lora_backend
from detached_rl.models.lora_merge import LoraMergeTarget
from detached_rl.models.shared_prefix import run_distinct_prompts, supports_shared_prefix

__all__ = ["HFGenerationBackend", "MergedLoraSink"]


class MergedLoraSink(ModuleWeightSink):
    """Writes W0, A and B (trainer naming) into a `LoraMergeTarget`; commit re-merges the weights they touch."""

    def __init__(self, target: LoraMergeTarget) -> None:
        super().__init__(target)
        self.target = target

    def commit(self, update: SinkCommit) -> None:
        """Recompute W = W0 + scaling·B·A of the adapted modules whose W0, A or B was written."""
        self.target.refresh(set(update.keys))


class HFGenerationBackend:
    """Generation with Hugging Face `generate`; behaviour log-probs come from the processed scores.

    Updates go into the torch model through `weight_sink` (by default a `ModuleWeightSink` over
    `model`). `from_actor` builds one for a policy, encoding text prompts with its tokenizer.
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, eos_token_id: int | Sequence[int],
                 share_prompts: bool = True, *,
                 encode_prompts: Callable[[Sequence[Prompt]], list[torch.Tensor]] | None = None,
                 weight_sink: WeightSink | None = None) -> None:
        self.model = model
        # Rows with the same prompt (GRPO groups) prefill it once: see `detached_rl.models.shared_prefix`.
        self.share_prompts = share_prompts and supports_shared_prefix(model)
        self.pad_token_id = pad_token_id
        self.eos_token_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
        self.encode_prompts = encode_prompts
        self.weight_sink: WeightSink = weight_sink if weight_sink is not None else ModuleWeightSink(model)

    @classmethod
    def from_actor(cls, actor: Actor, lora_mode: str = "keep") -> HFGenerationBackend:
        """A backend generating with `actor`'s model and tokenizer.

        `lora_mode="merge"` (LoRA policies): generate with a plain copy holding W = W0 + scaling·B·A,
        which every update re-merges (`MergedLoraSink`); "keep": with the model as it is.
        """
        if lora_mode not in LORA_MODES:
            raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {lora_mode!r}")
        sink: WeightSink | None = None
        if lora_mode == "merge":
            if lora_backend(actor.model) is None:
                raise ValueError("lora_mode='merge' needs a policy that carries a LoRA adapter")
            target = LoraMergeTarget.from_lora_model(actor.model)
            sink = MergedLoraSink(target)
            actor = Actor(target.model, actor.tokenizer, share_prompts=actor.share_prompts)
        tokenizer = actor.tokenizer
        return cls(actor.model, tokenizer.pad_token_id, tokenizer.eos_token_id, share_prompts=actor.share_prompts,
                   encode_prompts=actor.encode_prompts, weight_sink=sink)

    def generate_text(self, prompts: Sequence[Prompt], sampling: SamplingConfig | None = None) -> GenerationOutput:
        """One response per text, chat or token-id prompt: response ids, behaviour log-probs and prompt ids."""
        if self.encode_prompts is None:
            raise ValueError("HFGenerationBackend.generate_text needs encode_prompts (see from_actor)")
        prompt_ids = self.encode_prompts(prompts)
        output = self.generate(prompt_ids, sampling or SamplingConfig())
        output.prompt_ids = prompt_ids
        return output

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
