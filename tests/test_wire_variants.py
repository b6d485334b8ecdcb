"""A trainer's updates in its makers' serving dtypes (`weights.wire_variants`): a bf16 maker gets bf16
updates, full ones as sparse deltas on the version it acknowledged, else the full bf16 update; its weights
are, bit for bit, those of a bf16 maker given the plain fp32 updates."""

import torch

from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.models import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore

from .helpers import ObjectStore, arithmetic_prompts, naive_strategy, tiny_actor_critic, tiny_maker_models

SAMPLING = SamplingConfig(max_new_tokens=6)


def maker(name: str, dtype: torch.dtype | None) -> ExperienceMaker:
    """A maker serving its policy and critic in `dtype` (casting incoming weights), or as loaded (fp32)."""
    models = tiny_maker_models(seed=7, reference=False)
    if dtype is not None:
        models.actor.to(dtype)
        models.critic.to(dtype)
    return ExperienceMaker(name, models, CyclingPrompts(arithmetic_prompts()),
                           MakerConfig(experience_batch_size=4, sampling=SAMPLING,
                                       weight_cast_dtype=None if dtype is None else str(dtype)[6:]),
                           strategy=naive_strategy())


def make_trainer(**config) -> TrainerCore:
    actor, critic = tiny_actor_critic(seed=0)
    learner = PPOLearner(actor, critic, naive_strategy(),
                         PPOConfig(sampling=SAMPLING, actor_optimizer=OptimizerConfig(lr=1e-5),
                                   critic_optimizer=OptimizerConfig(lr=1e-5)))
    return TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=4, **config))


def register(trainer, store, m):
    answer = trainer.weights.register(m.name, m.registration_fingerprint, store.put,
                                    serving_dtype=m.receiver.serving_dtype)
    m.apply_weight_update(answer, store.fetch, reset=True)
    return answer


def assert_same(a: ExperienceMaker, b: ExperienceMaker) -> None:
    assert a.receiver.fingerprint == b.receiver.fingerprint
    for model in ("actor", "critic"):
        state_a, state_b = a.receiver.sinks[model].state(), b.receiver.sinks[model].state()
        for key in state_a:
            assert torch.equal(state_a[key].float(), state_b[key].float()), (model, key)


def test_a_bf16_maker_gets_bf16_deltas_and_holds_what_the_fp32_updates_give() -> None:
    trainer, store = make_trainer(), ObjectStore()
    trainer.weights.snapshot(store.put)
    bf16, late, wide = maker("bf16", torch.bfloat16), maker("late", torch.bfloat16), maker("wide", None)
    plain = maker("plain", torch.bfloat16)  # a bf16 maker given the fp32 updates, to compare with
    for m in (bf16, late, wide):
        answer = register(trainer, store, m)
        assert answer.manifest.kind == "full"
        assert answer.manifest.metadata.get("wire_dtype") == (None if m is wide else "bfloat16")
    plain.apply_weight_update(trainer.weights.latest_update, store.fetch, reset=True)
    assert_same(bf16, plain)
    got: dict[str, list[str]] = {"bf16": [], "late": [], "wide": []}

    def send_update(update, names):
        results = {}
        for name in names:
            got[name].append(update.manifest.kind)
            if name == "late" and update.version == 1:  # missed v1 (its push failed)
                results[name] = ConnectionError("maker late unreachable")
                continue
            results[name] = {"bf16": bf16, "late": late, "wide": wide}[name].apply_weight_update(
                update, store.fetch)
        return results

    for step in range(3):
        trainer.push_experience(wide.make_experience())
        trainer.train_step()
        metrics = trainer.weights.publish(store.put, send_update)
        plain.apply_weight_update(trainer.weights.latest_update, store.fetch)
        assert metrics["weight_sync/bytes/wire/delta/bfloat16"] < metrics["weight_sync/bytes/wire/bfloat16"] \
            == metrics["weight_sync/bytes"] / 2
        assert bf16.policy_version == plain.policy_version == step + 1
        assert_same(bf16, plain)
    assert got["bf16"] == ["delta"] * 3 and got["wide"] == ["full"] * 3
    # The maker that missed v1 got v2 whole (a delta on v1 would not apply to its v0), then deltas again.
    assert got["late"] == ["delta", "full", "delta"]
    assert_same(late, plain)
    assert trainer.weights.wire.sent_fulls_for_deltas == 1


def test_without_sparse_deltas_a_bf16_maker_gets_full_bf16_updates() -> None:
    trainer, store = make_trainer(sparse_deltas=False), ObjectStore()
    trainer.weights.snapshot(store.put)
    bf16, plain = maker("bf16", torch.bfloat16), maker("plain", torch.bfloat16)
    register(trainer, store, bf16)
    plain.apply_weight_update(trainer.weights.latest_update, store.fetch, reset=True)
    kinds = []
    trainer.push_experience(plain.make_experience())
    trainer.train_step()
    trainer.weights.publish(store.put, lambda update, names: {
        name: kinds.append((update.manifest.kind, update.manifest.metadata.get("wire_dtype")))
        or bf16.apply_weight_update(update, store.fetch) for name in names})
    plain.apply_weight_update(trainer.weights.latest_update, store.fetch)
    assert kinds == [("full", "bfloat16")]
    assert_same(bf16, plain)
