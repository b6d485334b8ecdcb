"""The generation backend interface: prompts in, responses and behaviour log-probs out, weights in through a
sink.

A maker generates only through a `GenerationBackend` and applies weight updates only through
its `weight_sink`, so an inference engine that owns its weights (vLLM) fits behind the same
seam as Hugging Face `generate`. A new backend provides:

* `generate(prompt_ids, sampling)`: one response per prompt (1-D token-id tensors), with the
  behaviour log-prob of every response token computed from the logits as `process_logits`
  processes them (temperature, top-k, top-p), so the trainer's recomputation matches; a
  response ends at (and includes) the first of `sampling.stop_token_ids` (default: the
  tokenizer's eos), `finished` says whether it did.
* `generate_text(prompts, sampling)`: the same from text or chat prompts, encoded with the
  policy's tokenizer (`Actor.encode_prompts`), with `prompt_ids` filled in.
* `engine`: "<backend>:<dtype>" of the behaviour log-probs ("hf:float32", "vllm:bfloat16"), stamped
  into each experience's `info["engine"]`; trainers correct log-probs of any engine but their own.
* `weight_sink`: a `WeightSink` (see `detached_rl.weights.update`) that takes the policy's
  verified updates under the trainer's state-dict names: `layout` (the keys, shapes and dtypes
  it accepts), `state` (the tensors as served, for fingerprints), `stage` (outside the lock),
  `write` (under the generation lock: in mode "in_place" once per chunk) and `commit` (make
  the update serve; `SinkCommit.kind` is "full" or "lora", and a LoRA update's adapter config
  is `metadata["lora"]`). The `WeightReceiver` keeps versions, manifests, checksums and
  refusals; a refused update never reaches the sink.
* a factory `(actor, lora_mode="keep", **options) -> backend`, registered by name in
  `detached_rl.generation.registry.GENERATION_BACKENDS` ("module:attribute", imported on first
  use), chosen with `MakerConfig.backend` and given `MakerConfig.backend_options`. With
  `lora_mode="merge"` the backend serves W = W0 + scaling·B·A and refreshes it on every update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from detached_rl.core.sampling import SamplingConfig
from detached_rl.weights.sink import ModuleWeightSink, SinkCommit, TensorLayout, WeightSink

if TYPE_CHECKING:
    from detached_rl.models.actor import Prompt

__all__ = [
    "GenerationBackend",
    "GenerationOutput",
    "ModuleWeightSink",
    "SinkCommit",
    "TensorLayout",
    "WeightSink",
    "left_pad",
]


@dataclass
class GenerationOutput:
    """Ragged responses: one 1-D tensor of ids and one of behaviour log-probs per prompt."""

    response_ids: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    finished: list[bool] = field(default_factory=list)  # True when the response ended with a stop token
    prompt_ids: list[torch.Tensor] = field(default_factory=list)  # filled by `generate_text`


@runtime_checkable
class GenerationBackend(Protocol):
    """Turns prompts into responses with behaviour log-probs and takes weight updates (see the module doc)."""

    def generate(self, prompt_ids: Sequence[torch.Tensor], sampling: SamplingConfig) -> GenerationOutput:
        """Generate one response per prompt."""
        ...

    def generate_text(self, prompts: Sequence[Prompt],
                      sampling: SamplingConfig | None = None) -> GenerationOutput:
        """Encode text or chat prompts with the policy's tokenizer and generate; `prompt_ids` filled in."""
        ...

    @property
    def weight_sink(self) -> WeightSink:
        """Where the policy's verified weight updates are written."""
        ...

    @property
    def engine(self) -> str:
        """The engine of the behaviour log-probs, "<backend>:<dtype>" ("hf:float32", "vllm:bfloat16")."""
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
