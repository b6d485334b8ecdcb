"""LoRA updates are checked against the served adapter's config, not only its shapes (the `check_update` sink
hook), and what vLLM's keep mode can serve is decided from the model before any engine
starts (no vLLM needed here)."""

import copy
import re

import pytest
import torch

from detached_rl.generation.hf import HFGenerationBackend, LoraModuleSink, MergedLoraSink
from detached_rl.generation.vllm_lora import KeepModeLayout, engine_lora_rank
from detached_rl.models import (
    Actor,
    LoraSettings,
    apply_lora,
    lora_config_dict,
    lora_state_dict,
    tiny_causal_lm,
)
from detached_rl.models.lora import check_lora_config, check_lora_update
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import WeightUpdateError, build_weight_update

from .helpers import ObjectStore

SETTINGS = LoraSettings(r=4, alpha=8, target_modules=("q_proj", "v_proj"))


def lora_llama(settings: LoraSettings = SETTINGS, seed: int = 0):
    model, tokenizer = tiny_causal_lm("llama", seed=0)
    torch.manual_seed(seed)
    return apply_lora(model, settings), tokenizer


def test_config_check_names_the_field_that_differs():
    model, _ = lora_llama()
    mine = lora_config_dict(model)
    check_lora_config(mine, dict(mine), "here")
    check_lora_config(mine, {**mine, "alpha": 8.0, "target_modules": ["v_proj", "q_proj"]}, "here")
    for field, value in [("r", 8), ("alpha", 16), ("scaling", 4.0), ("target_modules", ["q_proj"]),
                         ("fan_in_fan_out", True), ("bias", "all"), ("modules_to_save", ["lm_head"])]:
        with pytest.raises(ValueError, match=re.escape(f"here: LoRA {field} is {value!r} in the update")):
            check_lora_config(mine, {**mine, field: value}, "here")
    with pytest.raises(ValueError, match="lacks 'scaling'"):
        check_lora_config(mine, {key: v for key, v in mine.items() if key != "scaling"}, "here")
    with pytest.raises(ValueError, match="is a list, not a mapping"):
        check_lora_config(mine, [], "here")
    with pytest.raises(ValueError, match=r"must carry its adapter config in metadata\['lora'\]"):
        check_lora_update(mine, "lora", {"trainer_run": "a"}, "here")
    # a full update's tensors say it all but alpha: checked if sent
    check_lora_update(mine, "full", {}, "here")
    with pytest.raises(ValueError, match="LoRA alpha"):
        check_lora_update(mine, "full", {"lora": {**mine, "alpha": 2}}, "here")


@pytest.mark.parametrize("lora_mode", ["keep", "merge"])
def test_the_receiver_refuses_a_lora_update_for_another_config_before_fetching(lora_mode):
    maker, tokenizer = lora_llama(seed=1)
    backend = HFGenerationBackend.from_actor(Actor(maker, tokenizer), lora_mode=lora_mode)
    sink = backend.weight_sink
    assert isinstance(sink, LoraModuleSink if lora_mode == "keep" else MergedLoraSink)
    receiver = WeightReceiver({"actor": sink})
    trainer, _ = lora_llama(seed=2)
    config = lora_config_dict(trainer)
    store = ObjectStore()
    fetched = []

    def fetch(ref):
        fetched.append(ref)
        return store.fetch(ref)

    before = {key: tensor.clone() for key, tensor in sink.state().items()}
    for metadata, message in [({}, r"metadata\['lora'\]"),
                              ({"lora": {**config, "alpha": 32}}, "LoRA alpha is 32"),
                              ({"lora": {**config, "r": 8}}, "LoRA r is 8"),
                              ({"lora": {**config, "target_modules": ["q_proj"]}}, "LoRA target_modules")]:
        update, _ = build_weight_update({"actor": lora_state_dict(trainer)}, 1, store.put, kind="lora",
                                        metadata=metadata)
        with pytest.raises(WeightUpdateError, match=rf"^v1: model 'actor': .*{message}"):
            receiver.receive(update, fetch)
    assert fetched == [] and receiver.version == 0 and receiver.consistent
    assert all(torch.equal(sink.state()[key], tensor) for key, tensor in before.items())
    update, _ = build_weight_update({"actor": lora_state_dict(trainer)}, 1, store.put, kind="lora",
                                    metadata={"lora": config})
    assert receiver.receive(update, fetch).applied and receiver.version == 1


def test_sinks_without_the_hook_and_models_the_update_does_not_name_are_not_asked():
    checked = []

    class Recording(LoraModuleSink):
        def check_update(self, kind, metadata):
            checked.append(kind)
            super().check_update(kind, metadata)

    policy, _ = lora_llama()
    plain, _ = tiny_causal_lm("llama", seed=3)
    receiver = WeightReceiver({"actor": Recording(policy), "critic": plain})
    store = ObjectStore()
    update, _ = build_weight_update({"critic": plain.state_dict()}, 1, store.put, kind="lora")
    assert receiver.receive(update, store.fetch).applied and checked == []


def lora_keys(model):
    return [key for key in model.state_dict() if "lora_" in key]


def test_keep_mode_layout_maps_peft_and_loralib_keys_to_plain_names_and_a_peft_adapter():
    model, _ = lora_llama(LoraSettings(r=4, alpha=8, target_modules=("q_proj", "down_proj")))
    layout = KeepModeLayout.from_lora_model(model)
    plain = tiny_causal_lm("llama", seed=0)[0]
    assert sorted(layout.plain_names.values()) == sorted(plain.state_dict())
    state = model.state_dict()
    for key, name in layout.plain_names.items():
        assert torch.equal(state[key], plain.state_dict()[name])
    assert sorted(layout.adapter_names) == sorted(lora_keys(model))
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert layout.adapter_names[q_a] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert layout.adapter_config | {"target_modules": None} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "target_modules": None,
        "bias": "none",
        "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None}
    assert sorted(layout.adapter_config["target_modules"]) == ["down_proj", "q_proj"]
    rslora = copy.deepcopy(model)
    rslora.peft_config["default"].use_rslora = True
    assert KeepModeLayout.from_lora_model(rslora).adapter_config["use_rslora"]

    loralib_model, _ = lora_llama(LoraSettings(backend="loralib", r=4, alpha=8, target_modules=("q_proj",)))
    layout = KeepModeLayout.from_lora_model(loralib_model)
    assert layout.hf_model is loralib_model
    assert set(layout.plain_names) == set(layout.plain_names.values()) == set(plain.state_dict())
    assert layout.adapter_names["model.layers.1.self_attn.q_proj.lora_B"] == (
        "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight")


@pytest.mark.parametrize(("build", "named"), [
    (lambda: lora_llama(LoraSettings(r=4, alpha=8, target_modules=("q_proj",)))[0].base_model.model,
     "outside a PeftModel"),
    (lambda: dora(), "use_dora"),
    (lambda: lora_llama(LoraSettings(r=4, alpha=8, modules_to_save=("lm_head",)))[0], "modules_to_save"),
    (lambda: lora_llama(LoraSettings(r=4, alpha=8, bias="all"))[0], "bias='all'"),
    (lambda: apply_lora(tiny_causal_lm("gpt2", seed=0)[0], LoraSettings(r=4, alpha=8)), "fan_in_fan_out"),
    (lambda: lora_llama(LoraSettings(backend="loralib", r=4, alpha=8, target_modules=("q_proj",),
                                     merged_enable=(True,)))[0], "loralib MergedLinear"),
], ids=["no-peftmodel", "dora", "modules_to_save", "bias", "conv1d", "mergedlinear"])
def test_keep_mode_refuses_what_vllm_adapters_cannot_serve_and_suggests_merge(build, named):
    with pytest.raises(ValueError, match=rf"does not support .*{named}.*; use lora_mode: merge"):
        KeepModeLayout.from_lora_model(build())


def dora():
    import peft

    model, _ = tiny_causal_lm("llama", seed=0)
    return peft.get_peft_model(model,
                               peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True))


def test_engine_lora_rank_rounds_up_to_a_rank_vllm_accepts():
    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 33, 300, 512)] == [1, 8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="LoRA rank 513"):
        engine_lora_rank(513)
