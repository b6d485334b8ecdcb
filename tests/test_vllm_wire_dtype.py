"""A bf16 vLLM maker stores what its engine serves (`VLLMBackend.stored_dtype`), so a LoRA trainer sends it
adapters in bf16, half the bytes of float32, and what the engine serves is bit for bit what a float32
adapter gives (the engine rounds every adapter it loads to its dtype). Skipped where `vllm` does not import.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from detached_rl.generation.vllm import vllm_available

if not vllm_available():
    pytest.skip("vllm is not importable (optional; see docs/vllm-notes.md for the install recipe)",
                allow_module_level=True)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from safetensors.torch import load_file  # noqa: E402

from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner  # noqa: E402
from detached_rl.core.prompts import CyclingPrompts  # noqa: E402
from detached_rl.generation.vllm import mirror_dtype  # noqa: E402
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels  # noqa: E402
from detached_rl.models import SamplingConfig  # noqa: E402
from detached_rl.models.actor import Actor  # noqa: E402
from detached_rl.models.loaders import tiny_causal_lm  # noqa: E402
from detached_rl.models.lora import LoraSettings, apply_lora  # noqa: E402
from detached_rl.strategies.optim import OptimizerConfig  # noqa: E402
from detached_rl.trainer.config import TrainerConfig  # noqa: E402
from detached_rl.trainer.core import TrainerCore  # noqa: E402

from .helpers import LowTokenReward, ObjectStore, arithmetic_prompts, naive_strategy  # noqa: E402

SAMPLING = SamplingConfig(max_new_tokens=8)
SETTINGS = LoraSettings(r=8, alpha=16, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"))


def lora_policy() -> Actor:
    """A tiny llama (head size 32, which vLLM's CPU attention needs) with a LoRA adapter, in float32."""
    model, tokenizer = tiny_causal_lm("llama", seed=0, hidden_size=128, intermediate_size=256)
    torch.manual_seed(0)
    return Actor(apply_lora(model, SETTINGS), tokenizer)


def test_the_mirror_takes_the_engines_dtype_where_it_is_narrower_and_never_in_merge_mode():
    policy = lora_policy().model
    assert mirror_dtype(policy, "bfloat16", "keep") == torch.bfloat16
    assert mirror_dtype(policy, "float16", "keep") == torch.float16
    assert mirror_dtype(policy, "float32", "keep") is None
    assert mirror_dtype(policy, "bfloat16", "merge") is None  # the engine rounds W0 + s·B·A, not its parts
    assert mirror_dtype(copy.deepcopy(policy).to(torch.bfloat16), "bfloat16", "keep") is None


def test_a_bf16_vllm_maker_is_sent_bf16_adapters_and_serves_what_float32_ones_give():
    policy = lora_policy()
    learner = GRPOLearner(copy.deepcopy(policy), naive_strategy(),
                          GRPOConfig(sampling=SAMPLING, actor_optimizer=OptimizerConfig(lr=1e-2)))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8, weight_sync="lora"))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    maker = ExperienceMaker("maker_0", MakerModels(actor=copy.deepcopy(policy), reward=LowTokenReward()),
                            CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=2, group_size=4, sampling=SAMPLING,
                                        backend="vllm",
                                        backend_options={"dtype": "bfloat16", "max_model_len": 256}),
                            strategy=naive_strategy())
    try:
        sink = maker.backend.lora_sink
        assert maker.backend.stored_dtype == torch.bfloat16  # no weight_cast_dtype in the config
        assert maker.receiver.serving_dtype == "bfloat16"
        assert {layout.dtype for layout in sink.layout().values()} == {torch.bfloat16}
        # its own base, proved by fingerprint: the first update is the adapter alone, in bf16
        assert maker.base_fingerprint == trainer.weights.cast_base_fingerprints["bfloat16"]
        first = trainer.weights.register("maker_0", maker.base_fingerprint, store.put,
                                       serving_dtype=maker.receiver.serving_dtype)
        assert first.manifest.kind == "lora" and first.manifest.metadata["wire_dtype"] == "bfloat16"
        maker.apply_weight_update(first, store.fetch, reset=True)
        adapter = {key: value.clone() for key, value in learner.policy.model.state_dict().items()
                   if key in sink.spec.adapter_names}
        float32_bytes = sum(value.numel() * 4 for value in adapter.values())
        assert sum(spec.nbytes for spec in first.manifest.tensors) == float32_bytes // 2
        for step in range(1, 3):
            trainer.push_experience(maker.make_experience())
            trainer.train_step()
            trainer.weights.publish(store.put, lambda update, names: {
                name: maker.apply_weight_update(update, store.fetch) for name in names})
            assert maker.policy_version == step
            assert trainer.weights.latest_update.manifest.kind == "lora"
            # What the engine loaded for this version, against the trainer's float32 adapter as the engine
            # would round it (vLLM casts an adapter to its dtype when it loads one).
            served = load_file(os.path.join(sink.serving_request.lora_path, "adapter_model.safetensors"))
            trained = learner.policy.model.state_dict()
            assert any(not torch.equal(trained[key], adapter[key]) for key in adapter)  # it trained
            for key, peft_key in sink.spec.adapter_names.items():
                assert served[peft_key].dtype == torch.bfloat16
                assert torch.equal(served[peft_key], trained[key].to(torch.bfloat16)), key
        assert maker.make_experience()  # and it generates with them
    finally:
        maker.backend.close()
