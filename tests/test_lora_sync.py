"""LoRA-only weight updates: exact (set, not add) in keep and merge modes, for peft and loralib."""

import functools
import logging
import pickle

import pytest
import torch

from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.models import Actor, Critic, LoraSettings, SamplingConfig, apply_lora
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from detached_rl.weights.base_fingerprint import (
    BaseCheckedSink,
    base_fingerprint,
    base_keys,
    base_model_label,
)
from detached_rl.weights.sink import ModuleWeightSink
from detached_rl.weights.update import OffTrainerError, WeightUpdateError, build_weight_update

from .helpers import (
    LowTokenReward,
    ObjectStore,
    arithmetic_prompts,
    lane_device,
    lora_actor_critic,
    lora_maker_models,
    model_device,
    naive_strategy,
    needs_smollm2,
    tiny_critic,
)

SAMPLING = SamplingConfig(max_new_tokens=6)
PROBE = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])


def make_lora_pair(backend, mode, maker_seed=3):
    actor, critic = lora_actor_critic(backend, seed=0)
    learner = PPOLearner(actor, critic, naive_strategy(),
                         PPOConfig(sampling=SAMPLING, actor_optimizer=OptimizerConfig(lr=1e-2)))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8, weight_sync="lora"))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    maker = ExperienceMaker("maker_0", lora_maker_models(backend, seed=maker_seed),
                            CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=8, sampling=SAMPLING, lora_mode=mode),
                            strategy=naive_strategy())
    return trainer, maker, store


def logits_of(model):
    """The model's logits on PROBE, on the CPU (makers and trainers may sit on different devices)."""
    with torch.no_grad():
        return model(PROBE.to(model_device(model))).logits.cpu()


@pytest.mark.parametrize("backend", ["peft", "loralib"])
@pytest.mark.parametrize("mode", ["keep", "merge"])
def test_five_lora_updates_keep_the_maker_exactly_on_the_trainer(backend, mode):
    trainer, maker, store = make_lora_pair(backend, mode)
    # Another seed: the maker's base differs, so registration hands it a full update first.
    first = trainer.weights.register("maker_0", maker.base_fingerprint, store.put)
    assert first.manifest.kind == "full"
    maker.apply_weight_update(first, store.fetch)
    assert maker.base_fingerprint == trainer.weights.base_fingerprint
    trainer_model = trainer.learner.actor.model
    for step in range(5):
        trainer.push_experience(maker.make_experience())
        trainer.train_step()
        metrics = trainer.weights.publish(store.put, lambda u, makers: {
            m: maker.apply_weight_update(u, store.fetch) for m in makers})
        update = trainer.weights.latest_update
        assert update.manifest.kind == "lora" and update.manifest.metadata["lora"]["r"] == 4
        assert maker.policy_version == step + 1 and metrics["weight_sync/makers_updated"] == 1
        difference = (logits_of(maker.backend.model) - logits_of(trainer_model)).abs().max().item()
        assert difference <= 1e-5, f"step {step}: max |logit diff| {difference}"
    if mode == "merge":
        assert not any("lora" in type(m).__module__.lower() for m in maker.backend.model.modules())


def test_lora_update_is_refused_when_the_base_differs():
    trainer, maker, store = make_lora_pair("peft", "keep")
    maker.apply_weight_update(trainer.weights.register("maker_0", maker.base_fingerprint, store.put),
                              store.fetch)
    trainer.push_experience(maker.make_experience())
    trainer.train_step()
    trainer.weights.publish(store.put, lambda u, makers: {})
    lora_update = trainer.weights.latest_update
    stranger = ExperienceMaker("maker_1", lora_maker_models("peft", seed=9),
                               CyclingPrompts(arithmetic_prompts()),
                               MakerConfig(experience_batch_size=8, sampling=SAMPLING),
                               strategy=naive_strategy())
    before = logits_of(stranger.backend.model)
    with pytest.raises(OffTrainerError, match="model 'actor': base fingerprint mismatch"):
        stranger.apply_weight_update(lora_update, store.fetch)
    assert stranger.policy_version == -1 and torch.equal(before, logits_of(stranger.backend.model))
    assert "base fingerprint mismatch" in stranger.resync_reason  # registering again fixes it
    # Registration knows: a matching base gets the LoRA update, any other base a full one.
    assert trainer.weights.register("maker_0", maker.base_fingerprint, store.put) is lora_update
    assert trainer.weights.register("maker_1", stranger.base_fingerprint, store.put).manifest.kind == "full"


def test_a_lora_update_behind_a_waiting_full_one_is_checked_against_that_full_ones_base():
    trainer, maker, store = make_lora_pair("peft", "keep")  # the maker's base differs from the trainer's
    push = functools.partial(maker.apply_weight_update, fetch=store.fetch, swap="at_safe_point")
    with maker.generation_lock:  # mid-batch: the registration's full update waits for the safe point
        assert push(trainer.weights.register("maker_0", maker.base_fingerprint, store.put)).staged
    assert maker.receiver.pending_version == 0 and maker.base_fingerprint != trainer.weights.base_fingerprint
    trainer.policy_version += 1  # a training step (what it trains does not matter here)
    lora_update, _ = trainer.weights.snapshot(store.put)
    assert lora_update.manifest.kind == "lora"
    # The receiver swaps the waiting full update in first, then checks the LoRA update against that base.
    result = push(lora_update)
    assert result.applied and maker.policy_version == 1 and maker.receiver.pending_version is None
    assert maker.base_fingerprint == trainer.weights.base_fingerprint and maker.receiver.swapped == 2
    assert torch.equal(logits_of(maker.backend.model), logits_of(trainer.learner.actor.model))


def test_a_base_mismatch_names_the_checkpoint_and_hub_commit_on_both_sides():
    """A maker that loaded another revision of the trainer's Hub model is told which (issue 47.1)."""
    model = lora_actor_critic("peft", seed=0)[0].model
    model.config._name_or_path, model.config._commit_hash = "acme/tiny-llama", "3f2c" * 10
    served = base_model_label(model)
    assert served == "acme/tiny-llama@3f2c3f2c3f2c"
    sink = BaseCheckedSink(ModuleWeightSink(model), base_keys(model), base_model=served)
    sent = {"base_fingerprint": "another", "base_model": "acme/tiny-llama@aaaaaaaaaaaa"}
    with pytest.raises(OffTrainerError, match=r"for base weights another \(acme/tiny-llama@aaaaaaaaaaaa\), "
                       r"this maker holds \w+ \(acme/tiny-llama@3f2c3f2c3f2c\)"):
        sink.check_update("lora", sent)


def test_the_base_check_is_the_policy_sinks_and_fingerprints_again_only_after_a_base_write():
    model = lora_actor_critic("peft", seed=0)[0].model
    inner = ModuleWeightSink(model)
    sink = BaseCheckedSink(inner, base_keys(model))
    assert sink.fingerprint == base_fingerprint(model) and sink.cast_dtype is None
    sink.check_update("lora", {"base_fingerprint": base_fingerprint(model)})
    sink.check_update("full", {"base_fingerprint": "another"})  # a full update brings its own base
    with pytest.raises(OffTrainerError, match="base fingerprint mismatch"):
        sink.check_update("lora", {"base_fingerprint": "another"})
    adapter = next(key for key in sink.layout() if "lora_A" in key)
    base = next(key for key in sorted(sink.keys) if key.endswith("q_proj.base_layer.weight"))
    cached = sink.fingerprint
    sink.write({adapter: torch.ones_like(inner.state()[adapter])})
    assert sink.fingerprint is cached  # adapters are no part of the base: nothing to fingerprint again
    sink.write({base: inner.state()[base] + 1})
    assert sink.fingerprint != cached and sink.fingerprint == base_fingerprint(model)
    # A casting maker fingerprints its base cast to its coarsest stored dtype, as its trainer does.
    assert BaseCheckedSink(inner, base_keys(model), casts=True).fingerprint == base_fingerprint(
        model, torch.float32)


def test_rank_mismatch_is_refused_with_the_key_named():
    trainer, maker, store = make_lora_pair("peft", "keep")
    maker.apply_weight_update(trainer.weights.register("maker_0", None, store.put), store.fetch)
    # The same adapter at rank 8 instead of 4: every A and B has the wrong shape.
    actor_state = {k: torch.zeros(8, v.shape[1], device=v.device) if "lora_A" in k
                   else torch.zeros(v.shape[0], 8, device=v.device) if "lora_B" in k else v
                   for k, v in trainer.weights.synced_state(trainable_only=True)["actor"].items()}
    bad, _ = build_weight_update({"actor": actor_state}, 1, store.put, kind="lora",
                                 metadata={"base_fingerprint": trainer.weights.base_fingerprint,
                                           "trainer_run": trainer.run_id})
    before = logits_of(maker.backend.model)
    with pytest.raises(WeightUpdateError, match="shape mismatch.*lora_A"):
        maker.apply_weight_update(bad, store.fetch)
    assert maker.policy_version == 0 and torch.equal(before, logits_of(maker.backend.model))


def test_trainer_refuses_lora_sync_without_an_adapter():
    from .helpers import tiny_actor_critic

    actor, critic = tiny_actor_critic()
    learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(sampling=SAMPLING))
    with pytest.raises(ValueError, match="weight_sync='lora' needs a LoRA policy"):
        TrainerCore("t", learner, TrainerConfig(weight_sync="lora"))
    with pytest.raises(ValueError, match="TrainerConfig.weight_sync"):
        TrainerConfig(weight_sync="delta")


def payload_bytes(update, store):
    """Serialized bytes of the chunks plus the manifest: what crosses the wire."""
    chunks = sum(len(pickle.dumps(store.fetch(ref), protocol=5)) for ref in update.chunk_refs)
    return chunks + len(pickle.dumps(update.manifest, protocol=5))


@pytest.mark.slow
@needs_smollm2
def test_smollm2_lora_update_is_under_one_percent_of_a_full_update():
    from detached_rl.models import Actor, Critic, LoraSettings, apply_lora, load_smollm2
    from detached_rl.models.scalar_heads import backbone_of

    model, tokenizer = load_smollm2(device=lane_device())
    policy = apply_lora(model, LoraSettings(r=8, alpha=16, target_modules=("q_proj", "v_proj")))
    critic = Critic(backbone_of(load_smollm2(device=lane_device())[0]))
    for p in critic.backbone.parameters():
        p.requires_grad_(False)  # a value head on a frozen backbone: the critic's update is tiny too
    learner = PPOLearner(Actor(policy, tokenizer), critic, naive_strategy(), PPOConfig())
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(weight_sync="lora"))
    store = ObjectStore()
    full, full_stats = trainer.weights.snapshot(store.put)
    lora, lora_stats = trainer.weights.snapshot(store.put)
    assert full.manifest.kind == "full" and lora.manifest.kind == "lora"
    adapter_bytes = sum(p.numel() * p.element_size() for p in policy.parameters() if p.requires_grad)
    head_bytes = sum(p.numel() * p.element_size() for p in critic.head.parameters())
    assert adapter_bytes == 460_800 * 4  # r=8 on q_proj and v_proj of 30 layers, fp32
    assert lora_stats.bytes == adapter_bytes + head_bytes
    payload = payload_bytes(lora, store)
    print(f"full {full_stats.bytes / 2**20:.1f} MiB, LoRA {lora_stats.bytes / 2**20:.3f} MiB "
          f"({lora_stats.bytes / full_stats.bytes:.3%}), payload {payload} bytes = "
          f"{payload / (adapter_bytes + head_bytes):.4f} x raw")
    assert lora_stats.bytes < 0.01 * full_stats.bytes
    assert payload <= 1.05 * (adapter_bytes + head_bytes)


def lora_critic_models(backend: str, seed: int) -> tuple[Actor, Critic]:
    actor, _ = lora_actor_critic("peft", seed=seed)
    critic = apply_lora(tiny_critic("llama", seed=seed + 1), LoraSettings(backend=backend, r=4, alpha=8))
    return actor, critic.to(lane_device())


def ppo_pair(actor: Actor, critic: Critic,
             maker_critic: Critic) -> tuple[TrainerCore, ExperienceMaker, ObjectStore]:
    learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(
        sampling=SAMPLING, actor_optimizer=OptimizerConfig(lr=1e-2),
        critic_optimizer=OptimizerConfig(lr=1e-2)))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8, weight_sync="lora"))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    maker_actor, _ = lora_actor_critic("peft", seed=0)
    models = MakerModels(actor=maker_actor, critic=maker_critic.to(lane_device()), reward=LowTokenReward())
    maker = ExperienceMaker("maker_0", models, CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=8, sampling=SAMPLING),
                            strategy=naive_strategy())
    maker.apply_weight_update(trainer.weights.register("maker_0", maker.base_fingerprint, store.put),
                              store.fetch)
    return trainer, maker, store


def trainable_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def sync_once(trainer: TrainerCore, maker: ExperienceMaker, store: ObjectStore) -> dict[str, float]:
    trainer.push_experience(maker.make_experience())
    trainer.train_step()
    return trainer.weights.publish(store.put, lambda u, makers: {m: maker.apply_weight_update(u, store.fetch)
                                                              for m in makers})


@pytest.mark.parametrize("backend", ["peft", "loralib"])
def test_a_lora_critic_trains_and_its_lora_updates_carry_adapters_and_head(backend):
    actor, critic = lora_critic_models(backend, seed=0)
    trainer, maker, store = ppo_pair(actor, critic, lora_critic_models(backend, seed=0)[1])
    assert trainer.weights.synced_in_full == {}
    metrics = sync_once(trainer, maker, store)
    assert trainer.weights.latest_update.manifest.kind == "lora" and maker.policy_version == 1
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
    assert trainer.weights.synced_in_full == {"critic": size}
    assert "critic has no LoRA" in caplog.text and "weight_sync/bytes/critic" in caplog.text
    # the critic changes every step: it ships every time, and says so
    metrics = sync_once(trainer, maker, store)
    assert metrics["weight_sync/bytes/critic"] == size
    assert trainer.weights.latest_update.manifest.kind == "lora"

    critic.requires_grad_(False)  # frozen: after the full update a LoRA-only update carries none of it
    metrics = trainer.weights.publish(store.put, lambda u, makers: {})
    update = trainer.weights.latest_update
    assert update.manifest.kind == "lora" and metrics["weight_sync/bytes/actor"] > 0
    assert metrics["weight_sync/bytes/critic"] == 0
    assert not any(spec.name.startswith("critic/") for spec in update.manifest.tensors)
