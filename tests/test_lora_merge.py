"""Tests for detached_rl.models.lora_merge: merge-mode makers that set W = W0 + s·B·A (no Ray)."""

from __future__ import annotations

import pytest
import torch

from detached_rl.models import LoraSettings, apply_lora, lora_state_dict, tiny_causal_lm
from detached_rl.models.lora_backend import base_keys
from detached_rl.models.lora_merge import LoraMergeTarget
from detached_rl.weights.base_fingerprint import base_fingerprint
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import build_weight_update

from .helpers import has_lora_modules, lane_device, model_device

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
    pytest.mark.filterwarnings("ignore:Input and output embeddings are no longer tied:UserWarning"),
    pytest.mark.filterwarnings("ignore:Model with `tie_word_embeddings=True`:UserWarning"),
]

IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 2, 7], [3, 4, 100, 120, 8, 6, 5, 11]])
CASES = {
    "peft-llama": ("llama", dict(backend="peft")),
    "peft-gpt2-conv1d": ("gpt2", dict(backend="peft")),
    "loralib-llama": ("llama", dict(backend="loralib")),
    "loralib-gpt2-fan_in_fan_out": ("gpt2", dict(backend="loralib")),
    "loralib-gpt2-merged": ("gpt2", dict(backend="loralib", merged_enable=(True, False, True))),
    "loralib-gpt2-bias-lora_only": ("gpt2", dict(backend="loralib", bias="lora_only")),
    "peft-gpt2-bias-lora_only": ("gpt2", dict(backend="peft", bias="lora_only")),
    "peft-gpt2-bias-all": ("gpt2", dict(backend="peft", bias="all")),
    "peft-llama-modules_to_save": ("llama", dict(backend="peft", modules_to_save=("lm_head",))),
    # GPT-2 ties lm_head to wte: the original_module copy *is* the embedding.
    "peft-gpt2-modules_to_save-tied": ("gpt2", dict(backend="peft", modules_to_save=("lm_head",))),
}
cases = pytest.mark.parametrize("case", list(CASES))


def build(case: str, seed: int = 0) -> torch.nn.Module:
    arch, kwargs = CASES[case]
    model, _ = tiny_causal_lm(arch, seed=seed)
    torch.manual_seed(seed)
    return apply_lora(model, LoraSettings(r=4, alpha=8, **kwargs)).eval().to(lane_device())


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS.to(model_device(model))).logits


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return (logits(a) - logits(b)).abs().max().item()


class Trainer:
    """A LoRA model and its optimizer; `step` changes every trainable tensor."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)

    def step(self) -> None:
        self.model.train()
        ids = IDS.to(model_device(self.model))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.model.eval()


def copy_into(target: LoraMergeTarget, update: dict[str, torch.Tensor]) -> None:
    state = target.state_dict()
    with torch.no_grad():
        for key, tensor in update.items():
            state[key].copy_(tensor)


@cases
def test_lora_only_updates_track_the_trainer(case: str) -> None:
    trainer = Trainer(build(case))
    base = logits(trainer.model)
    for _ in range(3):
        trainer.step()
    target = LoraMergeTarget.from_lora_model(build(case))
    assert not has_lora_modules(target.model)
    for _ in range(5):
        trainer.step()
        update = lora_state_dict(trainer.model)
        copy_into(target, update)
        target.refresh(set(update))
        assert max_diff(target.model, trainer.model) <= 1e-5
    assert (logits(trainer.model) - base).abs().max() > 1e-2  # B != 0: the test is not vacuous

    # Set, not add: the same update again (A, B and refresh) changes nothing.
    before = logits(target.model)
    for _ in range(3):
        copy_into(target, update)
        target.refresh(set(update))
    torch.testing.assert_close(logits(target.model), before, atol=0, rtol=0)


@cases
def test_full_update_onto_a_different_base(case: str) -> None:
    trainer = Trainer(build(case))
    for _ in range(3):
        trainer.step()
    target = LoraMergeTarget.from_lora_model(build(case, seed=1))
    assert max_diff(target, trainer.model) > 1e-2
    copy_into(target, trainer.model.state_dict())
    target.refresh()
    assert max_diff(target, trainer.model) <= 1e-5
    assert base_fingerprint(target) == base_fingerprint(trainer.model)


@cases
def test_state_dict_mirrors_the_lora_model(case: str) -> None:
    lora = build(case)
    target = LoraMergeTarget.from_lora_model(lora)
    expected = {k: (tuple(v.shape), v.dtype) for k, v in lora.state_dict().items()}
    assert {k: (tuple(v.shape), v.dtype) for k, v in target.state_dict().items()} == expected
    assert target.adapter_config["backend"] == CASES[case][1]["backend"]

    plain = {t.data_ptr() for t in target.model.state_dict().values()}
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    for key, tensor in target.state_dict().items():
        kept = "lora_" in key or key.endswith("base_layer.weight") or "original_module" in key
        if CASES[case][1]["backend"] == "loralib" and key.endswith(".weight"):
            kept = kept or key.removesuffix(".weight") + ".lora_A" in expected
        if "original_module" in key and CASES[case][0] == "gpt2":
            kept = False  # tied to transformer.wte, which the plain model uses
        assert (tensor.data_ptr() not in plain) == kept, key
        if key in trainable and "lora_" not in key:  # trainable biases, modules_to_save copies
            assert tensor.data_ptr() in plain, key


def test_plain_tensor_copy_updates_the_plain_model_directly() -> None:
    target = LoraMergeTarget.from_lora_model(build("peft-gpt2-bias-lora_only"))
    key = "base_model.model.transformer.h.0.attn.c_attn.base_layer.bias"
    target.state_dict()[key].add_(1.0)
    assert torch.equal(target.model.transformer.h[0].attn.c_attn.bias, target.state_dict()[key])


def test_weight_receiver_lora_updates_with_after_swap() -> None:
    trainer = Trainer(build("peft-gpt2-conv1d"))
    target = LoraMergeTarget.from_lora_model(build("peft-gpt2-conv1d", seed=1))
    receiver = WeightReceiver(
        {"actor": target}, after_swap=lambda names: target.refresh({n.partition("/")[2] for n in names})
    )
    chunks: list[dict[str, torch.Tensor]] = []

    def put(chunk: dict[str, torch.Tensor]) -> int:
        chunks.append({k: v.clone() for k, v in chunk.items()})
        return len(chunks) - 1

    update, _ = build_weight_update({"actor": trainer.model.state_dict()}, 1, put, chunk_bytes=50_000)
    receiver.receive(update, chunks.__getitem__)
    assert max_diff(target, trainer.model) <= 1e-5
    for version in range(2, 5):
        trainer.step()
        update, _ = build_weight_update({"actor": lora_state_dict(trainer.model)}, version, put, kind="lora")
        assert receiver.receive(update, chunks.__getitem__).applied
        assert max_diff(target, trainer.model) <= 1e-5
    assert receiver.fingerprint == receiver.refresh_fingerprint()


def test_refresh_selects_modules_by_name() -> None:
    trainer = Trainer(build("peft-llama"))
    trainer.step()
    target = LoraMergeTarget.from_lora_model(trainer.model)
    prefix = "base_model.model.model.layers.0.self_attn."
    w0, other = prefix + "q_proj.base_layer.weight", prefix + "v_proj.base_layer.weight"
    q_proj, v_proj = (
        target.model.model.layers[0].self_attn.q_proj,
        target.model.model.layers[0].self_attn.v_proj,
    )
    state = target.state_dict()
    state[w0].add_(0.5)
    state[other].add_(0.5)
    before = q_proj.weight.clone(), v_proj.weight.clone()
    target.refresh({w0, "model.norm.weight"})  # names that are not W0/A/B of a module are ignored
    torch.testing.assert_close(q_proj.weight, before[0] + 0.5)
    assert torch.equal(v_proj.weight, before[1])
    target.refresh()
    torch.testing.assert_close(v_proj.weight, before[1] + 0.5)


def test_bfloat16_keeps_dtypes() -> None:
    model, _ = tiny_causal_lm("gpt2", dtype=torch.bfloat16)
    lora = apply_lora(model, LoraSettings(backend="loralib", r=4, merged_enable=(True, False, True))).eval()
    lora.to(lane_device())
    Trainer(lora).step()
    target = LoraMergeTarget.from_lora_model(lora)
    assert {k: v.dtype for k, v in target.state_dict().items()} == {
        k: v.dtype for k, v in lora.state_dict().items()
    }
    assert all(p.dtype == torch.bfloat16 for p in target.model.parameters())
    assert max_diff(target, lora) <= 0.1


def test_base_fingerprint() -> None:
    trainer = Trainer(build("peft-llama"))
    before = base_fingerprint(trainer.model)
    target = LoraMergeTarget.from_lora_model(build("peft-llama"))
    assert base_keys(target) == base_keys(trainer.model)
    assert not any("lora_" in key for key in base_keys(target))
    assert base_fingerprint(target) == before
    assert base_fingerprint(LoraMergeTarget.from_lora_model(build("peft-llama", seed=1))) != before

    for _ in range(2):
        trainer.step()
        update = lora_state_dict(trainer.model)
        copy_into(target, update)
        target.refresh(set(update))
    assert base_fingerprint(trainer.model) == before
    assert base_fingerprint(target) == before

    w0 = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    target.state_dict()[w0][0, 0] += 1.0
    assert base_fingerprint(target) != before


@pytest.mark.parametrize("case", ["loralib-gpt2-bias-lora_only", "peft-gpt2-modules_to_save-tied"])
def test_base_keys_leave_out_trainable_tensors(case: str) -> None:
    lora = build(case)
    keys = set(base_keys(lora))
    assert keys == set(lora.state_dict()) - set(lora_state_dict(lora))
    assert set(base_keys(LoraMergeTarget.from_lora_model(lora))) == keys


def test_refuses_models_without_lora_and_tied_adapted_weights() -> None:
    plain, _ = tiny_causal_lm("llama")
    with pytest.raises(ValueError, match="no LoRA"):
        LoraMergeTarget.from_lora_model(plain)
    with pytest.raises(ValueError, match="no LoRA"):
        base_fingerprint(plain)
    tied, _ = tiny_causal_lm("gpt2")
    tied = apply_lora(tied, LoraSettings(backend="peft", r=4, target_modules=("lm_head",)))
    with pytest.raises(ValueError, match="tied"):
        LoraMergeTarget.from_lora_model(tied)
