"""Tests for detached_rl.models.lora on tiny random Llama (nn.Linear) and GPT-2 (Conv1D) models."""

from __future__ import annotations

import copy
import json

import loralib
import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig
from transformers.pytorch_utils import Conv1D

from detached_rl.models import Critic, tiny_causal_lm
from detached_rl.models.lora import (
    LoraSettings,
    apply_lora,
    count_parameters,
    default_target_modules,
    load_lora_state_dict,
    lora_backend,
    lora_config_dict,
    lora_state_dict,
    mark_only_lora_trainable,
    merged_model,
)
from detached_rl.models.scalar_heads import backbone_of

from .helpers import has_lora_modules, lane_device, model_device, tiny_critic

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

R = 4
BACKENDS = ("peft", "loralib")
ARCHS = ("llama", "gpt2")
# LoRA parameters r·(in + out) per adapted module, worked out from the configs below (2 layers each).
EXPECTED_TRAINABLE = {
    # q_proj 32 -> 32, v_proj 32 -> 16 (2 kv heads of size 8)
    "llama": 2 * (R * (32 + 32) + R * (32 + 16)),
    # c_attn 32 -> 96 (q, k, v stacked)
    "gpt2": 2 * R * (32 + 96),
}
IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 2, 7], [3, 4, 100, 120, 8, 6, 5, 11]])


def build_base(arch: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    else:
        config = GPT2Config(
            vocab_size=128,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    return AutoModelForCausalLM.from_config(config).eval().to(lane_device())


def build_lora(arch: str, backend: str, seed: int = 0, **kwargs) -> torch.nn.Module:
    return apply_lora(build_base(arch, seed), LoraSettings(backend=backend, r=R, alpha=8, **kwargs)).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS.to(model_device(model))).logits


def train_steps(model: torch.nn.Module, steps: int = 3) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    ids = IDS.to(model_device(model))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


both = pytest.mark.parametrize("backend", BACKENDS)
archs = pytest.mark.parametrize("arch", ARCHS)


@both
@archs
def test_only_lora_parameters_trainable(arch: str, backend: str) -> None:
    base_total = count_parameters(build_base(arch))[1]
    model = build_lora(arch, backend)
    assert lora_backend(model) == backend
    trainable, total = count_parameters(model)
    assert trainable == EXPECTED_TRAINABLE[arch]
    assert total == base_total + trainable
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)


@both
@archs
def test_init_equals_base(arch: str, backend: str) -> None:
    expected = logits(build_base(arch))
    torch.testing.assert_close(logits(build_lora(arch, backend)), expected, atol=1e-6, rtol=0)


@both
@archs
def test_training_moves_only_lora_and_merge_matches(arch: str, backend: str) -> None:
    base = build_base(arch)
    model = build_lora(arch, backend)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    train_steps(model)
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    lora_logits = logits(model)
    assert (lora_logits - logits(base)).abs().max() > 1e-4

    merged = merged_model(model)
    assert type(merged) is type(base)
    assert lora_backend(merged) is None and not has_lora_modules(merged)
    assert (logits(merged) - lora_logits).abs().max() <= 1e-5
    # the LoRA model itself is untouched
    assert lora_backend(model) == backend
    torch.testing.assert_close(logits(model), lora_logits, atol=0, rtol=0)
    if arch == "gpt2":
        assert isinstance(merged.transformer.h[0].attn.c_attn, Conv1D)


@both
@archs
def test_state_dict_round_trip_sets(arch: str, backend: str) -> None:
    source = build_lora(arch, backend)
    train_steps(source)
    state = lora_state_dict(source)
    n_modules = {"llama": 4, "gpt2": 2}[arch]
    assert len(state) == 2 * n_modules
    assert all("lora_A" in k or "lora_B" in k for k in state)

    torch.manual_seed(123)  # a different LoRA A init in the target
    target = apply_lora(build_base(arch), LoraSettings(backend=backend, r=R, alpha=8)).eval()
    assert not torch.allclose(logits(target), logits(source))
    load_lora_state_dict(target, state)
    torch.testing.assert_close(logits(target), logits(source), atol=0, rtol=0)
    load_lora_state_dict(target, state)  # set, not add: a second load changes nothing
    torch.testing.assert_close(logits(target), logits(source), atol=0, rtol=0)

    # the returned tensors are clones, not views of the parameters
    before = logits(source)
    for t in state.values():
        t.add_(1.0)
    torch.testing.assert_close(logits(source), before, atol=0, rtol=0)


@both
def test_load_refuses_bad_state_and_changes_nothing(backend: str) -> None:
    model = build_lora("llama", backend)
    train_steps(model)
    original = lora_state_dict(model)
    keys = list(original)
    fresh = {k: torch.randn_like(v) for k, v in original.items()}

    device = model_device(model)
    unknown = {**fresh, "model.not_a_lora.weight": torch.zeros(1, device=device)}
    missing = {k: v for k, v in fresh.items() if k != keys[-1]}
    wrong_shape = {**fresh, keys[-1]: torch.zeros(3, 3, device=device)}
    for bad, key in ((unknown, "model.not_a_lora.weight"), (missing, keys[-1]), (wrong_shape, keys[-1])):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_lora_state_dict(model, bad)
        after = lora_state_dict(model)
        assert all(torch.equal(after[k], original[k]) for k in keys)


def test_loralib_merged_linear_on_gpt2_c_attn() -> None:
    base = build_base("gpt2")
    model = build_lora("gpt2", "loralib", merged_enable=(True, False, True))
    c_attn = model.transformer.h[0].attn.c_attn
    assert isinstance(c_attn, loralib.MergedLinear) and c_attn.enable_lora == [True, False, True]
    # A: (2r, in), B: (2 * out/3, r)
    assert count_parameters(model)[0] == 2 * (2 * R * 32 + 64 * R)
    torch.testing.assert_close(logits(model), logits(base), atol=1e-6, rtol=0)

    train_steps(model)
    merged = merged_model(model)
    assert not has_lora_modules(merged)
    assert (logits(merged) - logits(model)).abs().max() <= 1e-5
    # the key block (middle third of the Conv1D outputs) is not adapted
    merged_w = merged.transformer.h[0].attn.c_attn.weight
    base_w = base.transformer.h[0].attn.c_attn.weight
    torch.testing.assert_close(merged_w[:, 32:64], base_w[:, 32:64], atol=0, rtol=0)
    assert not torch.allclose(merged_w[:, :32], base_w[:, :32])

    target = build_lora("gpt2", "loralib", seed=0, merged_enable=(True, False, True))
    load_lora_state_dict(target, lora_state_dict(model))
    torch.testing.assert_close(logits(target), logits(model), atol=0, rtol=0)


@archs
def test_loralib_weights_do_not_depend_on_mode(arch: str) -> None:
    model = build_lora(arch, "loralib")
    train_steps(model)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    eval_logits = logits(model.eval())
    model.train()
    model.eval()
    model.train()
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())
    torch.testing.assert_close(logits(model.eval()), eval_logits, atol=0, rtol=0)
    assert all(not m.merged for m in model.modules() if isinstance(m, loralib.LoRALayer))


@both
@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_bias_modes_on_gpt2(backend: str, bias: str) -> None:
    model = build_lora("gpt2", backend, bias=bias)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    biases = {n for n in trainable if n.endswith("bias")}
    if bias == "lora_only":
        assert len(biases) == 2 and all("c_attn" in n for n in biases)
    else:
        assert biases == {n for n, _ in model.named_parameters() if n.endswith("bias")}
        assert len(biases) > 2
    state = lora_state_dict(model)
    assert set(state) == trainable

    train_steps(model)
    merged = merged_model(model)
    assert (logits(merged) - logits(model)).abs().max() <= 1e-5
    target = build_lora("gpt2", backend, bias=bias)
    load_lora_state_dict(target, lora_state_dict(model))
    torch.testing.assert_close(logits(target), logits(model), atol=0, rtol=0)


def test_peft_modules_to_save() -> None:
    model = build_lora("llama", "peft", modules_to_save=("lm_head",))
    state = lora_state_dict(model)
    saved = [k for k in state if "modules_to_save" in k]
    assert saved == ["base_model.model.lm_head.modules_to_save.default.weight"]
    assert count_parameters(model)[0] == EXPECTED_TRAINABLE["llama"] + 128 * 32

    train_steps(model)
    merged = merged_model(model)
    assert not has_lora_modules(merged)
    assert (logits(merged) - logits(model)).abs().max() <= 1e-5
    target = build_lora("llama", "peft", modules_to_save=("lm_head",))
    load_lora_state_dict(target, lora_state_dict(model))
    torch.testing.assert_close(logits(target), logits(model), atol=0, rtol=0)
    assert lora_config_dict(model)["modules_to_save"] == ["lm_head"]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("backend", {"backend": "deepspeed"}),
        ("r", {"r": 0}),
        ("alpha", {"alpha": 0}),
        ("dropout", {"dropout": 1.0}),
        ("dropout", {"dropout": -0.1}),
        ("bias", {"bias": "some"}),
        ("target_modules", {"target_modules": ()}),
        ("modules_to_save", {"backend": "loralib", "modules_to_save": ("lm_head",)}),
        ("merged_enable", {"backend": "peft", "merged_enable": (True, False, True)}),
        ("merged_enable", {"backend": "loralib", "merged_enable": (False, False, False)}),
    ],
)
def test_bad_settings_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=rf"LoraSettings\.{field}\b"):
        LoraSettings(**kwargs)


def test_settings_scaling() -> None:
    assert LoraSettings(r=4, alpha=8).scaling == 2.0


@both
def test_unmatched_target_is_named(backend: str) -> None:
    model = build_base("llama")
    with pytest.raises(ValueError, match="not_there"):
        apply_lora(model, LoraSettings(backend=backend, target_modules=("q_proj", "not_there")))
    assert lora_backend(model) is None


def test_loralib_explicit_fan_in_fan_out_must_fit() -> None:
    with pytest.raises(ValueError, match="fan_in_fan_out"):
        apply_lora(build_base("gpt2"), LoraSettings(backend="loralib", fan_in_fan_out=False))


def test_apply_twice_refused() -> None:
    model = build_lora("llama", "loralib")
    with pytest.raises(ValueError, match="already"):
        apply_lora(model, LoraSettings(backend="loralib"))


def test_default_target_modules() -> None:
    assert default_target_modules(build_base("llama")) == ("q_proj", "v_proj")
    assert default_target_modules(build_base("gpt2")) == ("c_attn",)
    with pytest.raises(ValueError, match="target_modules"):
        default_target_modules(torch.nn.Linear(2, 2))


@both
@archs
def test_config_dict(arch: str, backend: str) -> None:
    config = json.loads(json.dumps(lora_config_dict(build_lora(arch, backend))))
    assert config == {
        "backend": backend,
        "r": R,
        "alpha": 8,
        "scaling": 2.0,
        "target_modules": ["q_proj", "v_proj"] if arch == "llama" else ["c_attn"],
        "fan_in_fan_out": arch == "gpt2",
        "bias": "none",
        "modules_to_save": None,
    }


@both
def test_mark_only_lora_trainable(backend: str) -> None:
    model = build_lora("gpt2", backend)
    for p in model.parameters():
        p.requires_grad_(True)
    mark_only_lora_trainable(model)
    assert count_parameters(model)[0] == EXPECTED_TRAINABLE["gpt2"]
    mark_only_lora_trainable(model, bias="lora_only")
    assert count_parameters(model)[0] == EXPECTED_TRAINABLE["gpt2"] + 2 * 96


def test_lora_backend_and_merge_without_lora() -> None:
    base = build_base("llama")
    assert lora_backend(base) is None
    with pytest.raises(ValueError):
        merged_model(base)
    assert lora_backend(copy.deepcopy(build_lora("llama", "peft"))) == "peft"


@pytest.mark.parametrize("backend", ["peft", "loralib"])
@pytest.mark.parametrize("where", ["backbone", "critic"])
def test_lora_on_a_critic_trains_the_adapters_and_the_head(backend, where):
    plain = tiny_critic()
    settings = LoraSettings(backend=backend, r=4, alpha=8)
    # what the issue did: LoRA on the body, then the head (peft's causal-LM wrapper failed)
    if where == "backbone":
        critic = Critic(apply_lora(backbone_of(tiny_causal_lm("opt", seed=1)[0]), settings), head=plain.head)
    else:
        critic = apply_lora(tiny_critic(), settings)
    assert lora_backend(critic) == backend and lora_config_dict(critic)["r"] == 4
    trainable = {name for name, p in critic.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} <= trainable
    assert all("lora_" in name for name in trainable - {"head.weight", "head.bias"})
    sequences = torch.tensor([[3, 4, 5, 6, 7]])
    args = (sequences, torch.ones_like(sequences), torch.ones(1, 3))
    with torch.no_grad():
        for p in critic.parameters():
            if p.requires_grad:
                p.add_(0.01)  # B starts at 0: move it, so the adapters change the values
        values = critic(*args)
        assert not torch.allclose(values, plain(*args))
        assert torch.allclose(merged_model(critic)(*args), values, atol=1e-5)
    assert lora_backend(merged_model(critic)) is None
