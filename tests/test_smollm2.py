"""The packaged SmolLM2-135M-Instruct loads offline, generates and reproduces its behaviour log-probs."""

import time

import pytest
import torch

from detached_rl import Experience, collate
from detached_rl.generation import HFGenerationBackend
from detached_rl.models import Actor, SamplingConfig, load_smollm2, smollm2_dir
from detached_rl.rewards.functions import last_number

from .helpers import lane_device, needs_smollm2

pytestmark = [pytest.mark.slow, needs_smollm2]


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2(device=lane_device())


def test_cached_copy_reloads_fast_and_is_plain_safetensors():
    path = smollm2_dir()
    assert (path / "model.safetensors").exists() and (path / "tokenizer.json").exists()
    start = time.perf_counter()
    model, _ = load_smollm2()
    elapsed = time.perf_counter() - start
    print(f"SmolLM2 reload from {path}: {elapsed:.2f} s")
    assert model.config.model_type == "llama" and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_generates_an_answer_and_recomputes_log_probs(smollm2):
    model, tokenizer = smollm2
    actor = Actor(model, tokenizer)
    generator = HFGenerationBackend.from_actor(actor)
    greedy = generator.generate_text(["What is 12 + 11?"], SamplingConfig(max_new_tokens=16, do_sample=False))
    text = tokenizer.decode(greedy.response_ids[0], skip_special_tokens=True)
    assert last_number(text) is not None, text
    torch.manual_seed(0)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.7, top_p=0.95)
    out = generator.generate_text(["What is 3 + 4?", "Name a colour."], sampling)
    batch = collate(
        [Experience(p, r, lp, torch.tensor(0.0)) for p, r, lp in
         zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True)],
        tokenizer.pad_token_id,
    ).to(lane_device())
    with torch.no_grad():
        recomputed = actor.log_probs(batch.sequences, batch.attention_mask, batch.response_mask, sampling)
    assert float((recomputed - batch.log_probs).abs().max()) < 1e-3
