"""Shared-prompt forward passes: the same logits, log-probs and gradients as the plain forward."""

import pytest
import torch

from detached_rl.generation import HFGenerationBackend
from detached_rl.models import Actor, SamplingConfig
from detached_rl.models._forward import forward_kwargs, position_ids_from_mask
from detached_rl.models.loaders import tiny_causal_lm
from detached_rl.models.shared_prefix import (
    SUPPORTED_MODEL_TYPES,
    distinct_prompts,
    first_row_of_each,
    shared_prefix_logits,
    supports_shared_prefix,
)

PROMPT, RESPONSE = 7, 5


def grouped_batch(groups: int = 2, group_size: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts (the second one shorter) repeated per group, then ragged right-padded responses."""
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 50, (groups, PROMPT), generator=generator)
    prompt_mask = torch.ones(groups, PROMPT, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompts[1, :2] = 0
    rows = groups * group_size
    sequences = torch.cat([prompts.repeat_interleave(group_size, 0),
                           torch.randint(3, 50, (rows, RESPONSE), generator=generator)], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(group_size, 0),
                      torch.ones(rows, RESPONSE, dtype=torch.long)], 1)
    mask[-1, -2:] = 0
    sequences[-1, -2:] = 0
    return sequences, mask


def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
def test_shared_prompt_forward_equals_the_plain_forward_with_gradients(model_type):
    model, _ = tiny_causal_lm(model_type, seed=0)
    assert supports_shared_prefix(model)
    sequences, mask = grouped_batch()
    plain = model(input_ids=sequences, **forward_kwargs(model, mask)).logits[:, PROMPT - 1:-1]
    plain.square().mean().backward()
    plain_grads = gradients(model)
    shared = shared_prefix_logits(model, sequences, mask, RESPONSE)
    shared.square().mean().backward()
    shared_grads = gradients(model)
    scored = mask[:, PROMPT:].bool()
    torch.testing.assert_close(shared[scored], plain[scored], atol=1e-5, rtol=1e-5)
    assert len(shared_grads) == len(plain_grads) > 0
    for got, want in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_distinct_prompts_maps_rows_to_their_prompt_and_distinct_batches_use_the_plain_forward():
    sequences, mask = grouped_batch(groups=2, group_size=3)
    first, inverse = distinct_prompts(sequences, mask, PROMPT)
    assert sorted(first.tolist()) == [0, 3]  # the first row of each group
    assert inverse.tolist() in ([0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 0, 0])
    assert torch.equal(sequences[first[inverse], :PROMPT], sequences[:, :PROMPT])
    model, _ = tiny_causal_lm("llama", seed=0)
    one_each = sequences[[0, 3]], mask[[0, 3]]
    assert shared_prefix_logits(model, *one_each, RESPONSE) is None


def test_actor_log_probs_and_entropy_are_the_same_with_and_without_sharing():
    model, tokenizer = tiny_causal_lm("llama", seed=0)
    sequences, mask = grouped_batch()
    response_mask = mask[:, PROMPT:]
    sampling = SamplingConfig(temperature=0.7, top_k=20)
    shared, plain = Actor(model, tokenizer), Actor(model, tokenizer, share_prompts=False)
    assert shared.share_prompts and not plain.share_prompts
    for got, want in zip(shared(sequences, mask, response_mask, sampling, return_entropy=True),
                         plain(sequences, mask, response_mask, sampling, return_entropy=True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["gpt2", "opt", "bloom"])
def test_architectures_whose_cache_does_not_reproduce_the_plain_forward_are_not_shared(model_type):
    model, tokenizer = tiny_causal_lm(model_type, seed=0)
    assert not supports_shared_prefix(model) and not Actor(model, tokenizer).share_prompts


@pytest.mark.parametrize("do_sample", [False, True])
def test_generation_prefills_each_distinct_prompt_once_and_samples_the_same(do_sample):
    model, tokenizer = tiny_causal_lm("llama", seed=0)
    shared = HFGenerationBackend.from_actor(Actor(model, tokenizer))
    plain = HFGenerationBackend.from_actor(Actor(model, tokenizer, share_prompts=False))
    assert shared.share_prompts and not plain.share_prompts
    prompts = [p for p in ("What is 2 + 3?", "Name a colour.") for _ in range(4)]
    sampling = SamplingConfig(max_new_tokens=8, do_sample=do_sample, temperature=0.9)
    prompt_forwards = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: prompt_forwards.append(
        kwargs["input_ids"].shape), with_kwargs=True)
    torch.manual_seed(3)
    got = shared.generate_text(prompts, sampling)
    hook.remove()
    torch.manual_seed(3)
    want = plain.generate_text(prompts, sampling)
    assert prompt_forwards[0][0] == 2  # the prefill ran on the 2 distinct prompts, not on 8 rows
    for got_ids, want_ids, got_lp, want_lp in zip(got.response_ids, want.response_ids, got.log_probs,
                                                  want.log_probs, strict=True):
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ devices
# Every tensor the shared-prefix code builds must be on the device of its inputs (on an H100 a CPU `first`
# scattered with a CUDA index crashed every GRPO group). On the CPU such a bug is invisible, so: the
# data-independent helpers run on `meta` inputs and must return `meta` tensors; the data-dependent ones
# (`torch.unique`) run on CPU inputs while tensor constructors default to `meta` (a tensor built without
# `device=` then lands on meta) and must return CPU tensors with the values they have outside that block.
META = torch.device("meta")
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                      reason="no CUDA device here; the GPU lane runs it"))


def test_index_and_position_helpers_return_tensors_on_the_inputs_device():
    sequences, mask = grouped_batch()
    inverse = torch.tensor([0, 0, 0, 1, 1, 1])
    assert first_row_of_each(inverse, 2).tolist() == [0, 3]
    assert first_row_of_each(inverse.to(META), 2).device == META
    assert position_ids_from_mask(mask.to(META)).device == META


def test_distinct_prompts_builds_its_indices_on_the_device_of_the_batch():
    sequences, mask = grouped_batch()
    want = distinct_prompts(sequences, mask, PROMPT)
    with torch.device(META):
        got = distinct_prompts(sequences, mask, PROMPT)
    assert [t.device.type for t in got] == ["cpu", "cpu"]
    for value, expected in zip(got, want, strict=True):
        assert torch.equal(value, expected)


# mistral is left out: its sliding-window cache layer (transformers) builds a 0-d CPU tensor and moves it to
# the cache's device, which is right on CUDA but cannot be copied out of meta.
@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES - {"mistral"}))
def test_shared_prompt_log_probs_build_nothing_off_the_batch_device(model_type):
    model, tokenizer = tiny_causal_lm(model_type, seed=0)
    sequences, mask = grouped_batch()
    actor, sampling = Actor(model, tokenizer), SamplingConfig(temperature=0.7, top_k=20, top_p=0.9)
    want = actor(sequences, mask, mask[:, PROMPT:], sampling, return_entropy=True)
    with torch.device(META):
        got = actor(sequences, mask, mask[:, PROMPT:], sampling, return_entropy=True)
    for value, expected in zip(got, want, strict=True):
        assert value.device.type == "cpu"
        torch.testing.assert_close(value, expected, atol=0, rtol=0)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
def test_shared_prompt_forward_runs_where_the_model_is(model_type, device):
    model, tokenizer = tiny_causal_lm(model_type, seed=0)
    model.to(device)
    sequences, mask = (t.to(device) for t in grouped_batch())
    first, inverse = distinct_prompts(sequences, mask, PROMPT)
    assert first.device == inverse.device == sequences.device
    plain = model(input_ids=sequences, **forward_kwargs(model, mask)).logits[:, PROMPT - 1:-1]
    shared = shared_prefix_logits(model, sequences, mask, RESPONSE)
    shared.square().mean().backward()
    assert shared.device == sequences.device and all(p.grad.device == shared.device
                                                      for p in model.parameters() if p.grad is not None)
    scored = mask[:, PROMPT:].bool()
    torch.testing.assert_close(shared[scored], plain[scored], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_generation_prefills_shared_prompts_where_the_model_is(device):
    model, tokenizer = tiny_causal_lm("llama", seed=0)
    backend = HFGenerationBackend.from_actor(Actor(model.to(device), tokenizer))
    out = backend.generate_text([p for p in ("What is 2 + 3?", "Name a colour.") for _ in range(3)],
                                SamplingConfig(max_new_tokens=4, do_sample=False))
    assert backend.share_prompts and len(out.response_ids) == len(out.log_probs) == 6
    for ids, log_probs in zip(out.response_ids, out.log_probs, strict=True):
        assert ids.device.type == log_probs.device.type == "cpu" and ids.numel() == log_probs.numel() > 0
        assert bool(torch.isfinite(log_probs).all()) and bool((log_probs <= 1e-4).all())
