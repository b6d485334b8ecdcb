"""A maker generating with vLLM (real CPU engine) against a GRPO trainer with a LoRA policy and LoRA-only
updates.

Each sample's `policy_version` names the adapter it was generated with while updates arrive continuously;
the experience carries the engine tag the trainers correct for.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from detached_rl.generation.vllm import vllm_available

if not vllm_available():
    pytest.skip("vllm is not importable (optional; see docs/vllm-notes.md)", allow_module_level=True)

from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner  # noqa: E402
from detached_rl.core.prompts import CyclingPrompts  # noqa: E402
from detached_rl.core.replay_buffer import RejectedPushError  # noqa: E402
from detached_rl.core.sampling import SamplingConfig, process_logits, token_log_probs  # noqa: E402
from detached_rl.generation.vllm_config import VLLMConfig  # noqa: E402
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels  # noqa: E402
from detached_rl.models.actor import Actor  # noqa: E402
from detached_rl.models.loaders import tiny_causal_lm  # noqa: E402
from detached_rl.models.lora import (  # noqa: E402
    LoraSettings,
    apply_lora,
    load_lora_state_dict,
    lora_state_dict,
)
from detached_rl.strategies.optim import OptimizerConfig  # noqa: E402
from detached_rl.trainer.config import TrainerConfig  # noqa: E402
from detached_rl.trainer.core import TrainerCore  # noqa: E402

from .helpers import LowTokenReward, ObjectStore, arithmetic_prompts, naive_strategy  # noqa: E402

SAMPLING = SamplingConfig(max_new_tokens=8, temperature=0.9, top_k=40)
TOLERANCE = 1e-3  # float32 engine vs the float32 recompute


def lora_actor(seed: int = 0) -> Actor:
    model, tokenizer = tiny_causal_lm("llama", seed=seed, hidden_size=128, intermediate_size=256)
    return Actor(apply_lora(model, LoraSettings(r=8, alpha=16)), tokenizer)


@pytest.fixture(scope="module")
def pair():
    learner = GRPOLearner(lora_actor(), naive_strategy(), GRPOConfig(sampling=SAMPLING,
                                                                actor_optimizer=OptimizerConfig(lr=1e-2)))
    trainer = TrainerCore("trainer", learner, TrainerConfig(train_batch_size=8, weight_sync="lora"))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    maker = ExperienceMaker(
        "maker", MakerModels(actor=lora_actor(seed=0), reward=LowTokenReward()),  # the trainer's base
        CyclingPrompts(arithmetic_prompts()),
        # "auto": vLLM, as this process can serve the policy with it (head size 32).
        MakerConfig(experience_batch_size=2, group_size=4, sampling=SAMPLING, backend="auto",
                    vllm=VLLMConfig(dtype="float32", max_model_len=256, lora_versions_kept=3)),
        strategy=naive_strategy())
    # First contact: the engine's own base is the trainer's (its fingerprint, from the engine's weights), so
    # only the adapter crosses.
    first = trainer.weights.register("maker", maker.registration_fingerprint, store.put)
    assert first.manifest.kind == "lora"
    maker.apply_weight_update(first, store.fetch, reset=True)
    yield maker, trainer, store
    maker.backend.close()


def recompute(actor: Actor, prompt: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    sequence = torch.cat([prompt, response]).unsqueeze(0)
    with torch.no_grad():
        logits = actor.model(input_ids=sequence).logits[0, prompt.numel() - 1 : -1].float()
    return token_log_probs(process_logits(logits, SAMPLING), response)


def test_experience_carries_the_engine_and_trains(pair):
    maker, trainer, store = pair
    assert maker.backend_name == "vllm" and maker.status()["backend"] == "vllm"
    experiences = maker.make_experience()
    assert len(experiences) == 8 and all(e.info["engine"] == "vllm:float32" for e in experiences)
    assert trainer.push_experience(experiences).accepted == 8
    metrics = trainer.train_step()
    # Samples from another engine: the trainer recomputes, weighs (TIS) and reports the mismatch.
    assert metrics["mismatch/max_abs_log_prob_diff"] < TOLERANCE and metrics["mismatch/masked_tokens"] == 0


def test_continuous_generation_during_lora_updates_never_mixes_versions(pair):
    maker, trainer, store = pair
    update, _ = trainer.weights.snapshot(store.put)  # the maker catches up with the trained version first
    maker.apply_weight_update(update, store.fetch)
    assert maker.policy_version == trainer.policy_version
    adapters = {trainer.policy_version: lora_state_dict(trainer.learner.actor.model)}
    done = threading.Event()
    errors: list[BaseException] = []

    def keep_updating():
        try:
            for _ in range(5):
                with trainer.weights_lock:
                    with torch.no_grad():
                        for name, p in trainer.learner.actor.model.named_parameters():
                            if "lora_" in name:
                                p.add_(0.05 * torch.randn_like(p))
                    trainer.policy_version += 1
                    adapters[trainer.policy_version] = lora_state_dict(trainer.learner.actor.model)
                update, _ = trainer.weights.snapshot(store.put)
                assert update.manifest.kind == "lora"
                maker.apply_weight_update(update, store.fetch)
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
        finally:
            done.set()

    updater = threading.Thread(target=keep_updating)
    updater.start()
    experiences = []
    while not done.is_set() or not experiences:
        experiences += maker.make_experience()
    updater.join()
    assert not errors, errors
    versions = {e.policy_version for e in experiences}
    assert len(versions) >= 2, "the test must see several versions"
    assert maker.backend.lora_sink.adapter_ids[-1] == maker.policy_version + 1
    scratch = copy.deepcopy(trainer.learner.actor)
    for e in experiences:
        load_lora_state_dict(scratch.model, adapters[e.policy_version])
        torch.testing.assert_close(e.log_probs, recompute(scratch, e.prompt_ids, e.response_ids),
                                   atol=TOLERANCE, rtol=0, msg=f"v{e.policy_version}")


def test_an_engine_that_keeps_its_previous_adapter_is_caught_within_one_version(pair):
    """The engine's sink stops switching adapters (verl #7495: an adapter "synced" that the engine never
    served) while the maker reports each new version: its probe (vLLM's prompt log-probs under the adapter it
    serves) is not the trainer's for that version, and the push is refused naming it."""
    maker, trainer, store = pair
    update, _ = trainer.weights.snapshot(store.put)
    maker.apply_weight_update(update, store.fetch)
    assert trainer.push_experience(maker.make_experience()).accepted == 8  # the honest engine proves it
    sink = maker.backend.lora_sink
    served = sink.serving_request
    with trainer.weights_lock:  # the policy moves on by a visible step
        with torch.no_grad():
            for name, p in trainer.learner.actor.model.named_parameters():
                if "lora_" in name:
                    p.add_(0.05 * torch.randn_like(p))
        trainer.policy_version += 1
        trainer.served.record(trainer.policy_version)
    sink.commit = lambda update: None  # the fault: the engine keeps serving the previous adapter
    try:
        update, _ = trainer.weights.snapshot(store.put)
        maker.apply_weight_update(update, store.fetch)
        assert maker.policy_version == trainer.policy_version and sink.serving_request is served
        named = f"serves another policy than the v{trainer.policy_version}"
        with pytest.raises(RejectedPushError, match=named):
            trainer.push_experience(maker.make_experience())
        assert trainer.status()["provenance"]["served_mismatch"]["maker"]["version"] == trainer.policy_version
    finally:
        del sink.commit
