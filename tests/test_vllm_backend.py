"""The vLLM generation backend on a real engine (CPU), plain policies: skipped where `vllm` does not import.

LoRA policies (keep mode with versioned adapters, merge mode): tests/test_vllm_lora.py.

Install recipe: docs/vllm-notes.md. The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
on a tiny random llama whose head size (32) vLLM's CPU attention supports.
"""

from __future__ import annotations

import os

import pytest
import torch

from detached_rl.generation.vllm import vllm_available

if not vllm_available():
    pytest.skip("vllm is not importable (optional; see docs/vllm-notes.md for the install recipe)",
                allow_module_level=True)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from detached_rl.core.sampling import SamplingConfig, process_logits, token_log_probs  # noqa: E402
from detached_rl.generation import GenerationBackend  # noqa: E402
from detached_rl.generation.hf import HFGenerationBackend  # noqa: E402
from detached_rl.generation.vllm import VLLMBackend  # noqa: E402
from detached_rl.models.actor import Actor  # noqa: E402
from detached_rl.models.loaders import tiny_causal_lm  # noqa: E402
from detached_rl.weights.sink import SinkCommit  # noqa: E402

# float32 engine: the log-probs then match the trainer's float32 recompute up to kernel rounding.
LOG_PROB_TOLERANCE = 1e-3
PROMPTS = ["hello world", "the cat sat on", "one two three four", "abc"]


def tiny(seed: int = 0):
    return tiny_causal_lm("llama", seed=seed, hidden_size=128, intermediate_size=256)  # head size 32


def recompute(model, prompt: torch.Tensor, response: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """The trainer's view: processed log-probs of `response` after `prompt`, from one HF forward pass."""
    sequence = torch.cat([prompt, response]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=sequence).logits[0, prompt.numel() - 1 : -1].float()
    return token_log_probs(process_logits(logits, sampling), response)


@pytest.fixture(scope="module")
def engine():
    model, tokenizer = tiny()
    backend = VLLMBackend.from_actor(Actor(model, tokenizer), dtype="float32", max_model_len=512)
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in PROMPTS]
    yield backend, model, tokenizer, prompts
    backend.close()


def test_is_a_generation_backend(engine):
    backend, *_ = engine
    assert isinstance(backend, GenerationBackend)
    assert backend.lora_sink is None  # a plain policy: updates reload every weight


@pytest.mark.parametrize("sampling", [
    SamplingConfig(max_new_tokens=16, do_sample=False),
    SamplingConfig(max_new_tokens=16),
    SamplingConfig(max_new_tokens=16, temperature=0.7, top_k=20, top_p=0.9),
    SamplingConfig(max_new_tokens=16, temperature=1.3, top_p=0.8),
    SamplingConfig(max_new_tokens=16, temperature=1.1, min_p=0.05, top_k=40, top_p=0.95),
], ids=["greedy", "plain", "t0.7-k20-p0.9", "t1.3-p0.8", "t1.1-minp0.05-k40-p0.95"])
def test_behaviour_log_probs_match_the_trainers_recompute(engine, sampling):
    backend, model, _, prompts = engine
    grouped = [prompt for prompt in prompts for _ in range(3)]  # groups go to vLLM as n=3
    torch.manual_seed(0)
    out = backend.generate(grouped, sampling)
    assert len(out.response_ids) == len(grouped) == len(out.log_probs) == len(out.finished)
    for prompt, response, log_probs in zip(grouped, out.response_ids, out.log_probs, strict=True):
        assert response.numel() == log_probs.numel() > 0
        torch.testing.assert_close(log_probs, recompute(model, prompt, response, sampling),
                                   atol=LOG_PROB_TOLERANCE, rtol=0)


def test_seeded_by_torch_and_stops_at_stop_ids(engine):
    backend, _, _, prompts = engine
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.9)
    torch.manual_seed(5)
    first = backend.generate(prompts, sampling)
    torch.manual_seed(5)
    second = backend.generate(prompts, sampling)
    assert all(torch.equal(a, b) for a, b in zip(first.response_ids, second.response_ids, strict=True))
    greedy = SamplingConfig(max_new_tokens=12, do_sample=False)
    free = backend.generate(prompts[:1], greedy).response_ids[0]
    stop = int(free[2])
    cut = backend.generate(prompts[:1],
                           SamplingConfig(max_new_tokens=12, do_sample=False, stop_token_ids=(stop,)))
    end = free.tolist().index(stop) + 1
    assert cut.response_ids[0].tolist() == free[:end].tolist()
    assert cut.finished == [True]


def test_full_update_through_the_sink_changes_greedy_output_as_hf_does(engine):
    backend, _, tokenizer, prompts = engine
    greedy = SamplingConfig(max_new_tokens=16, do_sample=False)
    hf_model, _ = tiny()
    hf = HFGenerationBackend.from_actor(Actor(hf_model, tokenizer))
    before = backend.generate(prompts, greedy).response_ids
    assert all(torch.equal(a, b)
               for a, b in zip(before, hf.generate(prompts, greedy).response_ids, strict=True))
    new_model, _ = tiny(seed=7)
    state = new_model.state_dict()
    sink = backend.weight_sink
    assert set(sink.layout()) == set(state)
    sink.write(sink.stage(state))
    sink.commit(SinkCommit(1, "full", frozenset(state), {}))
    hf.weight_sink.write(hf.weight_sink.stage(state))
    after = backend.generate(prompts, greedy).response_ids
    expected = hf.generate(prompts, greedy).response_ids
    assert all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    # sampled log-probs follow the new weights too
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.8, top_k=30)
    out = backend.generate(prompts, sampling)
    for prompt, response, log_probs in zip(prompts, out.response_ids, out.log_probs, strict=True):
        torch.testing.assert_close(log_probs, recompute(hf_model, prompt, response, sampling),
                                   atol=LOG_PROB_TOLERANCE, rtol=0)
