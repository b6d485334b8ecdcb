"""Generation with Hugging Face `generate` inside the maker process; weights written into the torch model."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from detached_rl.core.devices import to_device
from detached_rl.core.sampling import SamplingConfig, token_log_probs
from detached_rl.generation.base import GenerationOutput, left_pad
from detached_rl.generation.registry import LORA_MODES
from detached_rl.models.actor import Actor, Prompt
from detached_rl.models.lora_backend import lora_backend
from detached_rl.models.shared_prefix import run_distinct_prompts, supports_shared_prefix
from detached_rl.weights.served_probe import model_probe
from detached_rl.weights.sink import ModuleWeightSink, SinkCommit, WeightSink

if TYPE_CHECKING:
    from detached_rl.models.lora_merge import LoraMergeTarget

__all__ = ["CACHE_IMPLEMENTATIONS", "GENERATION_DTYPES", "BehaviourLogProbs", "HFGenerationBackend",
           "LoraModuleSink",
           "MergedLoraSink"]

# `backend_options` values: "dynamic" is HF's default KV cache; "static" preallocates it (prompt +
# max_new_tokens), which HF compiles on CUDA for fast decode steps.
CACHE_IMPLEMENTATIONS = ("dynamic", "static")
# "auto": bfloat16 when the model is on a CUDA device that supports it, else the model's own dtype.
GENERATION_DTYPES = ("auto", "float32", "bfloat16", "float16")
# A static cache is sized up to a multiple of this: batches of other prompt lengths then reuse its shape
# instead of recompiling HF's compiled decode step for every new length.
STATIC_CACHE_BUCKET = 256


class BehaviourLogProbs(LogitsProcessor):
    """The last logits processor of `generate`: the behaviour log-prob of every sampled token, kept as [B] a
    step.

    At step t it is handed the processed scores of step t (what the token is sampled from, after
    temperature, top-k and top-p) and the ids up to step t-1. It keeps step t's scores, scores the
    token of step t-1 against the scores it kept from step t-1 and drops those: at most one [B, V]
    is held, instead of the [B, T, V] of `output_scores`. `finish` scores the last token.
    """

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self.steps.append(token_log_probs(self.previous.float(), input_ids[:, -1]))
        self.previous = scores
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """Behaviour log-probs [B, T] of `generated` [B, T] (the new tokens `generate` returned)."""
        steps = generated.shape[1]
        # A deferred stop check (HF on MPS) runs one step past the end and undoes it: drop what it added.
        if len(self.steps) < steps and self.previous is not None:
            self.steps.append(token_log_probs(self.previous.float(), generated[:, -1]))
        self.previous = None
        if len(self.steps) < steps:
            raise RuntimeError(f"scored {len(self.steps)} generation steps of {steps}")
        return torch.stack(self.steps[:steps], dim=1)


class LoraModuleSink(ModuleWeightSink):
    """A `ModuleWeightSink` over a LoRA model (keep mode) that refuses updates made
    for another adapter config."""

    def __init__(self, model: torch.nn.Module) -> None:
        from detached_rl.models.lora import lora_config_dict  # peft and loralib: only where LoRA is used

        super().__init__(model)
        self.adapter_config = lora_config_dict(model)

    def check_update(self, kind: str, metadata: Mapping[str, Any]) -> None:
        """ValueError naming the field where metadata["lora"] differs (a "lora" update must carry it)."""
        from detached_rl.models.lora import check_lora_update

        check_lora_update(self.adapter_config, kind, metadata, "LoRA adapter")


class MergedLoraSink(ModuleWeightSink):
    """Writes W0, A and B (trainer naming) into a `LoraMergeTarget`; commit
    re-merges the weights they touch."""

    def __init__(self, target: LoraMergeTarget) -> None:
        super().__init__(target)
        self.target = target

    def check_update(self, kind: str, metadata: Mapping[str, Any]) -> None:
        """ValueError naming the field where metadata["lora"] differs (a "lora" update must carry it)."""
        from detached_rl.models.lora import check_lora_update

        check_lora_update(self.target.adapter_config, kind, metadata, "merged LoRA adapter")

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
                 weight_sink: WeightSink | None = None, cache_implementation: str = "dynamic") -> None:
        if cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(f"MakerConfig.backend_options.cache_implementation must be one of "
                             f"{CACHE_IMPLEMENTATIONS}, got {cache_implementation!r}")
        self.model = model
        self.cache_implementation = cache_implementation
        # Rows with the same prompt (GRPO groups) prefill it once: see `detached_rl.models.shared_prefix`.
        # HF takes either a cache object or a cache implementation, so a static cache prefills every row.
        self.share_prompts = (share_prompts and supports_shared_prefix(model)
                              and cache_implementation == "dynamic")
        self.pad_token_id = pad_token_id
        self.eos_token_ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
        self.encode_prompts = encode_prompts
        self.weight_sink: WeightSink = weight_sink if weight_sink is not None else ModuleWeightSink(model)
        # The dtype `from_actor` cast the policy to (its `dtype` option), or None: the maker's receiver then
        # casts the trainer's updates to it, and the trainer may send them in it.
        self.stored_dtype: torch.dtype | None = None

    @property
    def engine(self) -> str:
        """The engine tag of the behaviour log-probs: "hf:<dtype the model
        generates in>", e.g. "hf:float32"."""
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.float32)
        return f"hf:{str(dtype).removeprefix('torch.')}"

    @classmethod
    def from_actor(cls, actor: Actor, lora_mode: str = "keep", *, cache_implementation: str = "dynamic",
                   dtype: str | None = None) -> HFGenerationBackend:
        """A backend generating with `actor`'s model and tokenizer (options: `MakerConfig.backend_options`).

        `lora_mode="merge"` (LoRA policies): generate with a plain copy holding W = W0 + scaling·B·A,
        which every update re-merges (`MergedLoraSink`); "keep": with the model as it is.
        `cache_implementation`: "dynamic" (HF's default) or "static" (a preallocated KV cache that HF
        compiles on CUDA; prompts are then not shared across a group's rows). `dtype`: cast the generating
        model to this dtype ("auto": bfloat16 on a CUDA device that supports it, unchanged elsewhere);
        None leaves it as loaded. A model cast here is the backend's `stored_dtype`: its maker casts the
        trainer's float32 weights to it (as with `MakerConfig.weight_cast_dtype`).
        """
        if lora_mode not in LORA_MODES:
            raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {lora_mode!r}")
        if dtype is not None and dtype not in GENERATION_DTYPES:
            raise ValueError(f"MakerConfig.backend_options.dtype must be one of {GENERATION_DTYPES} or null, "
                             f"got {dtype!r}")
        if cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(f"MakerConfig.backend_options.cache_implementation must be one of "
                             f"{CACHE_IMPLEMENTATIONS}, got {cache_implementation!r}")
        sink: WeightSink | None = None
        if lora_mode == "merge":
            if lora_backend(actor.model) is None:
                raise ValueError("lora_mode='merge' needs a policy that carries a LoRA adapter")
            from detached_rl.models.lora_merge import LoraMergeTarget

            target = LoraMergeTarget.from_lora_model(actor.model)
            sink = MergedLoraSink(target)
            actor = Actor(target.model, actor.tokenizer, share_prompts=actor.share_prompts)
        elif lora_backend(actor.model) is not None:
            sink = LoraModuleSink(actor.model)
        generation_dtype = resolve_generation_dtype(actor.model, dtype)
        loaded = next((p.dtype for p in actor.model.parameters() if p.is_floating_point()), None)
        if generation_dtype is not None:
            actor.model.to(generation_dtype)  # in place: the sink then writes (casts) into the cast weights
        tokenizer = actor.tokenizer
        backend = cls(actor.model, tokenizer.pad_token_id, tokenizer.eos_token_id,
                      share_prompts=actor.share_prompts,
                      encode_prompts=actor.encode_prompts, weight_sink=sink,
                      cache_implementation=cache_implementation)
        if generation_dtype is not None and generation_dtype != loaded:
            backend.stored_dtype = generation_dtype
        return backend

    def probe_log_probs(self, ids: torch.Tensor) -> list[float]:
        """The served model's log-probs of `ids[1:]` given their prefixes (`weights.served_probe`)."""
        return model_probe(self.model, ids)

    def generate_text(self, prompts: Sequence[Prompt],
                      sampling: SamplingConfig | None = None) -> GenerationOutput:
        """One response per text, chat or token-id prompt: response ids,
        behaviour log-probs and prompt ids."""
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
        # Temperature, min-p, top-k and top-p go in as our own processors (HF's warpers, in vLLM's
        # order: `process_logits`), so the recorder can run after them: HF puts user processors
        # before the warpers it builds. The config then names neutral values, explicitly: unset
        # fields would be filled from the model's and transformers' defaults (top_k=50), and the
        # log-probs would not match `process_logits`.
        recorder = BehaviourLogProbs()
        processors = LogitsProcessorList(sampling_warpers(sampling) + [recorder])
        neutral = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=None) if sampling.do_sample else {}
        static: dict[str, Any] = {}
        if self.cache_implementation == "static":
            length = input_ids.shape[1] + sampling.max_new_tokens
            bucketed = -(-length // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET
            static = dict(cache_implementation="static", max_cache_len=bucketed)
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.do_sample,
            repetition_penalty=1.0,
            **neutral,
            **static,
            eos_token_id=list(stop_ids),
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=False,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                input_ids, attention_mask = to_device(input_ids, device), to_device(attention_mask, device)
                sequences = self.model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                    logits_processor=processors, **self._shared_prompt_cache(input_ids, attention_mask),
                )
                generated = sequences[:, input_ids.shape[1] :]
                log_probs = recorder.finish(generated).cpu()
        finally:
            self.model.train(was_training)
        generated = generated.cpu()
        # One pass over [B, T]: a row ends at its first stop token (kept), else at the last generated column.
        is_stop = torch.isin(generated, torch.tensor(stop_ids, dtype=generated.dtype))
        finished = is_stop.any(dim=1)
        lengths = torch.where(finished, is_stop.int().argmax(dim=1) + 1, generated.shape[1]).tolist()
        responses = [generated[row, :length].clone() for row, length in enumerate(lengths)]
        behaviour = [log_probs[row, :length].clone() for row, length in enumerate(lengths)]
        return GenerationOutput(responses, behaviour, finished.tolist())

    def _shared_prompt_cache(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, Any]:
        """`past_key_values` holding every row's prompt (but its last token) computed once per distinct
        prompt, when rows repeat a prompt (GRPO groups) on an architecture that allows it; else nothing."""
        if input_ids.shape[1] < 2 or not self.share_prompts:
            return {}
        # generate runs the last prompt token itself, for the first logits: cache all but that column
        shared = run_distinct_prompts(self.model, input_ids, attention_mask, input_ids.shape[1] - 1)
        if shared is None:
            return {}
        return {"past_key_values": shared[0].past_key_values}


def sampling_warpers(sampling: SamplingConfig) -> list[LogitsProcessor]:
    """HF's temperature, min-p, top-k and top-p warpers for `sampling`, in `process_logits`'s order
    (none when greedy)."""
    if not sampling.do_sample:
        return []
    warpers: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p=sampling.min_p, min_tokens_to_keep=1))
    if sampling.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return warpers


def resolve_generation_dtype(model: torch.nn.Module, dtype: str | None) -> torch.dtype | None:
    """The dtype to cast the generating model to for `backend_options.dtype`, or None to leave it."""
    if dtype is None:
        return None
    if dtype == "auto":
        device = next(model.parameters()).device
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    return getattr(torch, dtype)
