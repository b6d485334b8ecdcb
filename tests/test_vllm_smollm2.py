"""vLLM against the HF backend on the packaged SmolLM2-135M-Instruct: greedy answers and behaviour log-probs.

float32 engine: the same answers as HF `generate` (ties aside) and log-probs within `FP32_TOLERANCE` of the
trainer's recompute. bfloat16 engine (the default): the greedy agreement and the log-prob gap are printed
and bounded, since bf16 rounding flips near-tied tokens.
"""

from __future__ import annotations

import pytest
import torch

from detached_rl.generation.vllm import vllm_available

from .helpers import needs_smollm2

if not vllm_available():
    pytest.skip("vllm is not importable (optional; see docs/vllm-notes.md)", allow_module_level=True)

from detached_rl.core.sampling import SamplingConfig, process_logits, token_log_probs  # noqa: E402
from detached_rl.generation.hf import HFGenerationBackend  # noqa: E402
from detached_rl.generation.vllm import VLLMBackend  # noqa: E402
from detached_rl.models import Actor, load_smollm2  # noqa: E402
from detached_rl.rewards.tasks import make_problems  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.e2e, needs_smollm2]

GREEDY = SamplingConfig(max_new_tokens=24, do_sample=False)
SAMPLED = SamplingConfig(max_new_tokens=24, temperature=0.8)
FP32_TOLERANCE = 2e-3
PROMPTS = [problem.messages for problem in make_problems("word_problems", 8, seed=3, split="test")]


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_smollm2()
    actor = Actor(model, tokenizer)
    hf = HFGenerationBackend.from_actor(actor).generate_text(PROMPTS, GREEDY)
    return actor, hf


def recompute(actor: Actor, prompt: torch.Tensor, response: torch.Tensor,
              sampling: SamplingConfig) -> torch.Tensor:
    sequence = torch.cat([prompt, response]).unsqueeze(0)
    with torch.no_grad():
        logits = actor.model(input_ids=sequence).logits[0, prompt.numel() - 1 : -1].float()
    return token_log_probs(process_logits(logits, sampling), response)


def compare(actor: Actor, hf, dtype: str) -> tuple[int, float]:
    """(greedy answers equal to HF's, max |behaviour - recompute| over sampled
    tokens) for a `dtype` engine."""
    backend = VLLMBackend.from_actor(actor, dtype=dtype, max_model_len=1024)
    try:
        greedy = backend.generate_text(PROMPTS, GREEDY)
        equal = sum(torch.equal(a, b) for a, b in zip(greedy.response_ids, hf.response_ids, strict=True))
        torch.manual_seed(0)
        sampled = backend.generate_text(PROMPTS, SAMPLED)
        gap = max(float((lp - recompute(actor, p, r, SAMPLED)).abs().max())
                  for p, r, lp in zip(sampled.prompt_ids, sampled.response_ids, sampled.log_probs,
                                      strict=True))
    finally:
        backend.close()
    print(f"SmolLM2, vLLM {dtype} vs HF float32: greedy answers equal {equal}/{len(PROMPTS)}, "
          f"max |log-prob gap| {gap:.2e}")
    return equal, gap


def test_float32_engine_answers_as_hf_does(smollm2):
    equal, gap = compare(*smollm2, "float32")
    assert equal >= len(PROMPTS) - 1 and gap < FP32_TOLERANCE


def test_bfloat16_engine_mismatch_is_bounded(smollm2):
    # Measured: 8/16 identical chat answers and a log-prob gap up to 0.21 (docs/vllm-notes.md §2).
    equal, gap = compare(*smollm2, "bfloat16")
    assert equal >= len(PROMPTS) // 4 and gap < 1.0
