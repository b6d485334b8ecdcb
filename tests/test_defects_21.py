"""The four defects issue 21 found on the way: a reference scored with the sampling filter (-inf log-probs), LoRA on
a critic (and what LoRA-only updates carry for a critic), the Ray namespace actors default to, and a `strategy=`
of the wrong type. (The namespace followed inside actors is tested on Ray in tests/test_actors_ray.py.)"""

from __future__ import annotations

import logging

import pytest
import torch

from detached_rl import Experience
from detached_rl.actors.trainer import PPOTrainerShell
from detached_rl.actors.transport import DEFAULT_NAMESPACE, _anonymous, resolve_namespace
from detached_rl.algorithms import metrics as names
from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.algorithms.mismatch import masked_kl
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.experience_batch import collate
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.core.replay_buffer import ReplayBuffer
from detached_rl.generation import HFGenerationBackend
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.models import (
    Actor,
    Critic,
    LoraSettings,
    SamplingConfig,
    apply_lora,
    lora_config_dict,
    merged_model,
    reference_sampling,
    tiny_causal_lm,
)
from detached_rl.models.lora import lora_backend
from detached_rl.models.scalar_heads import backbone_of
from detached_rl.scorer.core import Scorer
from detached_rl.scorer.requests import ScoreRequest
from detached_rl.strategies import NaiveStrategy, make_strategy
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore

from .helpers import (
    LowTokenReward,
    ObjectStore,
    arithmetic_prompts,
    lane_device,
    lora_actor_critic,
    make_experience,
    naive_strategy,
)

TOP_K = SamplingConfig(max_new_tokens=6, top_k=2, temperature=0.7)
SAMPLING = SamplingConfig(max_new_tokens=6)


# --------------------------------------------------------------------------- 1. reference log-probs


def outside_top_k_request(actor: Actor) -> ScoreRequest:
    """A one-row request whose last response token is the model's least likely one there (far outside any top-k)."""
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        first = int(actor.model(prompt.to(lane_device())).logits[0, -1].argmax())
        sequence = torch.tensor([[5, 6, 7, 8, first]])
        worst = int(actor.model(sequence.to(lane_device())).logits[0, -1].argmin())
    sequences = torch.tensor([[5, 6, 7, 8, first, worst]])
    return ScoreRequest(sequences, torch.ones_like(sequences), torch.ones(1, 2, dtype=torch.long))


def test_reference_sampling_keeps_the_temperature_and_drops_the_filters():
    assert reference_sampling(TOP_K) == SamplingConfig(max_new_tokens=6, temperature=0.7)
    assert reference_sampling(SamplingConfig(top_p=0.9, do_sample=False)).top_p == 1.0
    assert reference_sampling(SAMPLING) is SAMPLING and reference_sampling(None) is None


def test_a_reference_scorer_gives_a_token_outside_its_top_k_a_finite_log_prob():
    actor = Actor(*tiny_causal_lm("llama", seed=0)).to(lane_device())
    request = outside_top_k_request(actor)
    answer = Scorer("reference", actor, TOP_K, device=lane_device()).answer([request])[0]
    assert bool(torch.isfinite(answer.token_scores).all()), answer.token_scores
    # The temperature-scaled full distribution: temperature 0.7, no top-k.
    expected = actor.log_probs(*(t.to(lane_device()) for t in (request.sequences, request.attention_mask,
                                                               request.response_mask)),
                               SamplingConfig(max_new_tokens=6, temperature=0.7)).cpu()
    assert torch.allclose(answer.token_scores, expected, atol=1e-5)


def test_the_grpo_trainers_reference_scores_the_full_distribution():
    """A fresh policy and its reference copy agree on every token; under top-k the behaviour log-probs are
    renormalised over the top k, so KL(sampling policy || full reference) is -log(top-k mass) > 0, not 0."""
    learner = GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy(),
                          GRPOConfig(sampling=TOP_K, kl_coef=0.1, kl_kind="k1"))
    torch.manual_seed(0)
    prompts = ["q1", "q1", "q2", "q2"]
    out = HFGenerationBackend.from_actor(learner.policy).generate_text(prompts, TOP_K)
    experiences = [Experience(p, r, lp, torch.tensor(float(i % 2)), group_id=prompts[i]).validate()
                   for i, (p, r, lp) in enumerate(zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True))]
    batch = collate(experiences, learner.policy.tokenizer.pad_token_id, device=lane_device())
    with torch.no_grad():
        full = learner.reference(batch.sequences, batch.attention_mask, batch.response_mask, reference_sampling(TOP_K))
    kl = masked_kl(batch.log_probs, full, batch.response_mask, "k1")
    expected = float((kl * batch.response_mask).sum() / batch.response_mask.sum())
    metrics = learner.train_step(experiences, policy_version=0)
    assert expected > 0.01 and metrics[names.OBJECTIVE_KL] == pytest.approx(expected, rel=1e-4)


def test_a_replay_buffer_checkpointed_with_minus_inf_reference_log_probs_still_loads():
    """Before the convention a reference could send -inf; such samples are refused now, but a checkpointed buffer
    holding them loads (restoring does not re-validate) and the trainers leave those tokens out of the KL."""
    buffer = ReplayBuffer()
    buffer.append([make_experience(ref_log_probs=torch.tensor([-0.5, -1.0]))], 0)
    state = buffer.state_dict()
    state["samples"][0]["experience"]["ref_log_probs"] = torch.tensor([-0.5, float("-inf")])
    restored = ReplayBuffer()
    restored.load_state_dict(state)
    (sample,) = restored.sample(1, current_version=0)
    kl = masked_kl(sample.log_probs[None], sample.ref_log_probs[None], torch.ones(1, 2), "k3")
    assert bool(torch.isfinite(kl).all()) and float(kl[0, 1]) == 0.0


# --------------------------------------------------------------------------- 2. LoRA on a critic


def tiny_critic(model_type: str = "opt", seed: int = 1) -> Critic:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Critic(backbone_of(tiny_causal_lm(model_type, seed=seed)[0]))


@pytest.mark.parametrize("backend", ["peft", "loralib"])
@pytest.mark.parametrize("where", ["backbone", "critic"])
def test_lora_on_a_critic_trains_the_adapters_and_the_head(backend, where):
    plain = tiny_critic()
    settings = LoraSettings(backend=backend, r=4, alpha=8)
    if where == "backbone":  # what the issue did: LoRA on the body, then the head (peft's causal-LM wrapper failed)
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


def lora_critic_models(backend: str, seed: int) -> tuple[Actor, Critic]:
    actor, _ = lora_actor_critic("peft", seed=seed)
    critic = apply_lora(tiny_critic("llama", seed=seed + 1), LoraSettings(backend=backend, r=4, alpha=8))
    return actor, critic.to(lane_device())


def ppo_pair(actor: Actor, critic: Critic, maker_critic: Critic) -> tuple[TrainerCore, ExperienceMaker, ObjectStore]:
    learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(
        sampling=SAMPLING, actor_optimizer=OptimizerConfig(lr=1e-2), critic_optimizer=OptimizerConfig(lr=1e-2)))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8, weight_sync="lora"))
    store = ObjectStore()
    trainer.build_update(store.put)
    maker_actor, _ = lora_actor_critic("peft", seed=0)
    models = MakerModels(actor=maker_actor, critic=maker_critic.to(lane_device()), reward=LowTokenReward())
    maker = ExperienceMaker("maker_0", models, CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=8, sampling=SAMPLING), strategy=naive_strategy())
    maker.apply_weight_update(trainer.register_maker("maker_0", maker.base_fingerprint, store.put), store.fetch)
    return trainer, maker, store


def trainable_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def sync_once(trainer: TrainerCore, maker: ExperienceMaker, store: ObjectStore) -> dict[str, float]:
    trainer.push_experience(maker.make_experience())
    trainer.train_step()
    return trainer.sync_weights(store.put, lambda u, makers: {m: maker.apply_weight_update(u, store.fetch)
                                                              for m in makers})


@pytest.mark.parametrize("backend", ["peft", "loralib"])
def test_a_lora_critic_trains_and_its_lora_updates_carry_adapters_and_head(backend):
    actor, critic = lora_critic_models(backend, seed=0)
    trainer, maker, store = ppo_pair(actor, critic, lora_critic_models(backend, seed=0)[1])
    assert trainer.synced_in_full == {}
    metrics = sync_once(trainer, maker, store)
    assert trainer.latest_update.manifest.kind == "lora" and maker.policy_version == 1
    whole = sum(t.numel() * t.element_size() for t in critic.state_dict().values())
    assert metrics["weight_sync/bytes/critic"] == trainable_bytes(critic) < whole / 10
    assert metrics["weight_sync/bytes/actor"] == trainable_bytes(actor)
    probe = torch.tensor([[5, 6, 7, 8, 9, 10]], device=lane_device())
    args = (probe, torch.ones_like(probe), torch.ones(1, 3, device=lane_device()))
    with torch.no_grad():
        assert torch.allclose(maker.critic(*args), trainer.learner.critic(*args), atol=1e-5)


def test_lora_updates_carry_a_trained_critic_without_lora_whole_and_a_frozen_one_never(caplog):
    actor, critic = lora_actor_critic("peft", seed=0)
    with caplog.at_level(logging.WARNING, logger="detached_rl.trainer.core"):
        trainer, maker, store = ppo_pair(actor, critic, lora_actor_critic("peft", seed=0)[1])
    size = trainable_bytes(critic)
    assert trainer.synced_in_full == {"critic": size}
    assert "critic has no LoRA" in caplog.text and "weight_sync/bytes/critic" in caplog.text
    metrics = sync_once(trainer, maker, store)  # the critic changes every step: it ships every time, and says so
    assert metrics["weight_sync/bytes/critic"] == size and trainer.latest_update.manifest.kind == "lora"

    critic.requires_grad_(False)  # frozen: after the full update a LoRA-only update carries none of it
    metrics = trainer.sync_weights(store.put, lambda u, makers: {})
    update = trainer.latest_update
    assert update.manifest.kind == "lora" and metrics["weight_sync/bytes/actor"] > 0
    assert metrics["weight_sync/bytes/critic"] == 0
    assert not any(spec.name.startswith("critic/") for spec in update.manifest.tensors)


# --------------------------------------------------------------------------- 3. the namespace (without Ray)


def test_without_ray_or_with_an_anonymous_namespace_actors_meet_in_detached_rl():
    import ray

    assert not ray.is_initialized()
    assert resolve_namespace(None) == DEFAULT_NAMESPACE == "detached_rl"
    assert resolve_namespace("mine") == "mine"
    assert _anonymous("0b5328b7-3bd8-47e1-a403-cbcbf8c0f697")  # what ray.init() without a namespace gets
    assert not _anonymous("detached_rl") and not _anonymous("0B5328B7-3BD8-47E1-A403-CBCBF8C0F697")


# --------------------------------------------------------------------------- 4. strategy=


def naive_factory() -> NaiveStrategy:
    return NaiveStrategy(device=lane_device())


def test_a_callable_strategy_is_refused_at_construction_naming_strategy():
    with pytest.raises(TypeError, match=r"trainer 't': strategy must be a strategy name.*strategy_fn"):
        PPOTrainerShell("t", lora_actor_critic, strategy=naive_factory)
    with pytest.raises(TypeError, match="strategy must be a strategy name"):
        make_strategy(naive_factory)
    with pytest.raises(ValueError, match="strategy 'fsdp' is not available"):
        PPOTrainerShell("t", lora_actor_critic, strategy="fsdp")
    with pytest.raises(TypeError, match="GRPOLearner: strategy must be a detached_rl Strategy"):
        GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_factory)
    learner = GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy())
    learner.strategy = "naive"
    with pytest.raises(TypeError, match=r"TrainerCore 't': learner.strategy .*make_strategy"):
        TrainerCore("t", learner)
    actor, critic = lora_actor_critic("peft", seed=0)
    with pytest.raises(TypeError, match="maker 'm': strategy"):
        ExperienceMaker("m", MakerModels(actor=actor, critic=critic, reward=LowTokenReward()),
                        CyclingPrompts(arithmetic_prompts()), strategy=naive_factory)


def test_ppo_learner_refuses_a_callable_strategy():
    actor, critic = lora_actor_critic("peft", seed=0)
    with pytest.raises(TypeError, match="PPOLearner: strategy must be a detached_rl Strategy"):
        PPOLearner(actor, critic, naive_factory)
