"""Generation backends: the protocol, updates through the HF backend's weight sink, the backend registry."""

import copy

import pytest
import torch

from detached_rl.core.prompts import CyclingPrompts
from detached_rl.core.weight_receiver import WeightReceiver
from detached_rl.core.weight_sync import WeightUpdateError, build_weight_update
from detached_rl.generation import (
    GENERATION_BACKENDS,
    GenerationBackend,
    HFGenerationBackend,
    MergedLoraSink,
    ModuleWeightSink,
    WeightSink,
    build_generation_backend,
)
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.models import (
    Actor,
    LoraSettings,
    SamplingConfig,
    apply_lora,
    lora_config_dict,
    tiny_causal_lm,
)

from .helpers import ObjectStore, arithmetic_prompts, tiny_maker_models

GREEDY = SamplingConfig(max_new_tokens=8, do_sample=False)
PROMPTS = ["What is 2 + 3?", "hi", "Name a colour."]


def greedy(backend):
    """(response ids, behaviour log-probs) of a greedy generation."""
    out = backend.generate_text(PROMPTS, GREEDY)
    return out.response_ids, out.log_probs


def fresh_backend(state, lora=False):
    """A backend on a newly built tiny llama (with a LoRA adapter if `lora`) loaded with `state`."""
    model, tokenizer = tiny_causal_lm("llama", seed=0)
    model = lora_model(seed=0) if lora else model
    model.load_state_dict(state)
    return HFGenerationBackend.from_actor(Actor(model, tokenizer))


def lora_model(seed):
    """A tiny llama (base seed 0) with a peft LoRA adapter whose B is random (seed), so the adapter matters."""
    model = apply_lora(tiny_causal_lm("llama", seed=0)[0], LoraSettings(r=4, alpha=8))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def assert_same_generation(got, want, exact=True):
    for got_ids, want_ids in zip(got[0], want[0], strict=True):
        assert torch.equal(got_ids, want_ids)
    for got_lp, want_lp in zip(got[1], want[1], strict=True):
        if exact:
            assert torch.equal(got_lp, want_lp)
        else:
            torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)


def test_hf_backend_satisfies_the_protocol_and_its_sink_the_sink_protocol():
    actor = Actor(*tiny_causal_lm("llama", seed=0))
    backend = HFGenerationBackend.from_actor(actor)
    assert isinstance(backend, GenerationBackend) and isinstance(backend.weight_sink, WeightSink)
    assert isinstance(backend.weight_sink, ModuleWeightSink) and backend.weight_sink.module is actor.model
    merged = HFGenerationBackend.from_actor(Actor(lora_model(1), actor.tokenizer), lora_mode="merge")
    assert isinstance(merged, GenerationBackend) and isinstance(merged.weight_sink, MergedLoraSink)
    # A generator without a weight sink is not a backend.
    assert not isinstance(actor, GenerationBackend)


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_full_update_through_the_sink_changes_exactly_what_generation_uses(mode):
    model, tokenizer = tiny_causal_lm("llama", seed=0)
    backend = HFGenerationBackend.from_actor(Actor(model, tokenizer))
    before = greedy(backend)
    assert_same_generation(before, greedy(fresh_backend(tiny_causal_lm("llama", seed=0)[0].state_dict())))
    trained = tiny_causal_lm("llama", seed=1)[0].state_dict()
    store = ObjectStore()
    update, _ = build_weight_update({"actor": trained}, 1, store.put, chunk_bytes=60_000)
    receiver = WeightReceiver({"actor": backend.weight_sink}, mode=mode)
    assert receiver.apply(update, store.fetch).applied and receiver.version == 1
    after = greedy(backend)
    assert_same_generation(after, greedy(fresh_backend(trained)))
    assert any(not torch.equal(a, b) for a, b in zip(before[1], after[1], strict=True))


@pytest.mark.parametrize("lora_mode", ["keep", "merge"])
def test_a_lora_update_through_the_sink_changes_exactly_what_generation_uses(lora_mode):
    tokenizer = tiny_causal_lm("llama", seed=0)[1]
    backend = HFGenerationBackend.from_actor(Actor(lora_model(seed=1), tokenizer), lora_mode=lora_mode)
    before = greedy(backend)
    trainer = lora_model(seed=2)
    adapter = {key: p.detach() for key, p in trainer.named_parameters() if p.requires_grad}
    store = ObjectStore()
    update, _ = build_weight_update({"actor": adapter}, 1, store.put, kind="lora",
                                    metadata={"lora": lora_config_dict(trainer)})
    commits = []
    sink = backend.weight_sink
    receiver = WeightReceiver({"actor": sink})
    receiver.after_swap = lambda names: commits.append(names)
    assert receiver.apply(update, store.fetch).applied
    assert commits == [{f"actor/{key}" for key in adapter}]
    after = greedy(backend)
    # merge mode computes with W0 + s·B·A, the LoRA model with W0·x + s·B·(A·x): equal up to rounding.
    assert_same_generation(after, greedy(fresh_backend(trainer.state_dict(), lora=True)), exact=lora_mode == "keep")
    assert any(not torch.allclose(a, b) for a, b in zip(before[1], after[1], strict=True))


@pytest.mark.parametrize(("mode", "lora_mode", "corrupt"), [
    ("staged", "keep", -1), ("staged", "merge", -1), ("in_place", "keep", 0), ("in_place", "merge", 0),
])
def test_a_refused_update_leaves_the_sink_weights_untouched(mode, lora_mode, corrupt):
    tokenizer = tiny_causal_lm("llama", seed=0)[1]
    backend = HFGenerationBackend.from_actor(Actor(lora_model(seed=1), tokenizer), lora_mode=lora_mode)
    sink = backend.weight_sink
    state_before = {key: tensor.clone() for key, tensor in sink.state().items()}
    served_before = {key: t.clone() for key, t in backend.model.state_dict().items()}
    generated_before = greedy(backend)
    store = ObjectStore()
    update, _ = build_weight_update({"actor": lora_model(seed=2).state_dict()}, 1, store.put, chunk_bytes=60_000)
    assert update.manifest.num_chunks > 1
    chunk = store.objects[update.chunk_refs[corrupt]]
    name = next(iter(chunk))
    chunk[name] = chunk[name].clone()
    chunk[name].view(-1)[0] += 1.0
    receiver = WeightReceiver({"actor": sink}, mode=mode)
    with pytest.raises(WeightUpdateError, match="checksum mismatch"):
        receiver.apply(update, store.fetch)
    assert receiver.version == 0 and receiver.consistent
    state_after = sink.state()
    assert all(torch.equal(state_after[key], tensor) for key, tensor in state_before.items())
    served_after = backend.model.state_dict()
    assert all(torch.equal(served_after[key], tensor) for key, tensor in served_before.items())
    assert_same_generation(greedy(backend), generated_before)


def test_unknown_backend_names_and_unfitting_options_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"MakerConfig\.backend must be one of \['hf'\], got 'vllm'"):
        MakerConfig(backend="vllm")
    actor = Actor(*tiny_causal_lm("llama", seed=0))
    with pytest.raises(ValueError, match=r"MakerConfig\.backend must be one of"):
        build_generation_backend("nope", actor)
    with pytest.raises(ValueError, match=r"MakerConfig\.backend_options \['gpu_memory_utilization'\]"):
        ExperienceMaker("maker_0", tiny_maker_models(), CyclingPrompts(arithmetic_prompts()),
                        MakerConfig(backend_options={"gpu_memory_utilization": 0.5}))
    with pytest.raises(ValueError, match="lora_mode must be one of"):
        HFGenerationBackend.from_actor(actor, lora_mode="fuse")


class CountingSink(ModuleWeightSink):
    """A module sink that also counts the updates committed to it."""

    def __init__(self, module):
        super().__init__(module)
        self.commits = []

    def commit(self, update):
        super().commit(update)
        self.commits.append((update.version, update.kind, len(update.keys)))


def counting_backend(actor, lora_mode="keep", share_prompts=True):
    """The HF backend writing through a `CountingSink`; `share_prompts` stands for an engine's own option."""
    backend = HFGenerationBackend(actor.model, actor.tokenizer.pad_token_id, actor.tokenizer.eos_token_id,
                                  share_prompts=share_prompts, encode_prompts=actor.encode_prompts,
                                  weight_sink=CountingSink(actor.model))
    assert lora_mode == "keep"
    return backend


def test_the_maker_builds_a_registered_backend_with_its_options_and_updates_through_its_sink(monkeypatch):
    monkeypatch.setitem(GENERATION_BACKENDS, "counting", counting_backend)
    models = tiny_maker_models(seed=0)
    trained = {"actor": tiny_causal_lm("llama", seed=1)[0].state_dict(),
               "critic": copy.deepcopy(models.critic).state_dict()}
    config = MakerConfig(experience_batch_size=2, sampling=SamplingConfig(max_new_tokens=6), backend="counting",
                         backend_options={"share_prompts": False})
    maker = ExperienceMaker("maker_0", models, CyclingPrompts(arithmetic_prompts()), config)
    assert isinstance(maker.backend.weight_sink, CountingSink) and not maker.backend.share_prompts
    store = ObjectStore()
    update, _ = build_weight_update(trained, 4, store.put)
    assert maker.apply_weight_update(update, store.fetch).applied
    assert maker.backend.weight_sink.commits == [(4, "full", len(trained["actor"]))]
    experiences = maker.make_experience()
    assert len(experiences) == 2 and all(e.policy_version == 4 for e in experiences)
    assert_same_generation(greedy(maker.backend), greedy(fresh_backend(trained["actor"])))
