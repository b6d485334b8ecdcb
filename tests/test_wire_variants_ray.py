"""A trainer and a bf16 HF maker on a real local Ray cluster, `weight_sync: full`: the maker gets bf16 sparse
deltas and serves, bit for bit, what the trainer's plain fp32 update gives a bf16 maker."""

import functools
import time

import pytest
import torch

from detached_rl.actors.maker import ExperienceMakerHolder
from detached_rl.actors.trainer import DetachedPPOTrainer
from detached_rl.algorithms.ppo import PPOConfig
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.models import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.weights.ray_wire import fetch_chunk

from .helpers import arithmetic_prompts, gpu_options, naive_strategy, tiny_actor_critic, tiny_maker_models

pytestmark = pytest.mark.ray

NAMESPACE = "detached_rl_tests"
SAMPLING = SamplingConfig(max_new_tokens=6)
TIMEOUT = 180


def bf16_maker_models(seed: int = 7):
    """Maker models serving the policy and critic in bf16 (the reference stays as loaded: not synced)."""
    models = tiny_maker_models(seed=seed)
    models.actor.to(torch.bfloat16)
    models.critic.to(torch.bfloat16)
    return models


def maker_config() -> MakerConfig:
    return MakerConfig(experience_batch_size=4, sampling=SAMPLING, weight_cast_dtype="bfloat16")


def test_a_bf16_maker_takes_sparse_deltas_and_serves_the_full_updates_weights(ray_cluster):
    ray = ray_cluster
    trainer = DetachedPPOTrainer.options(name="delta_trainer", namespace=NAMESPACE,
                                         **gpu_options("trainer")).remote(
        "delta_trainer", tiny_actor_critic, TrainerConfig(train_batch_size=8),
        PPOConfig(sampling=SAMPLING, kl_coef=0.01, actor_optimizer=OptimizerConfig(lr=1e-6),
                  critic_optimizer=OptimizerConfig(lr=1e-6)),
        namespace=NAMESPACE,
    )
    maker = ExperienceMakerHolder.options(name="bf16_maker", namespace=NAMESPACE,
                                          **gpu_options("maker")).remote(
        "bf16_maker", ["delta_trainer"], functools.partial(bf16_maker_models, 7),
        CyclingPrompts(arithmetic_prompts()), maker_config(), namespace=NAMESPACE,
    )
    try:
        run = maker.run.remote()
        ray.get(trainer.fit.remote(3), timeout=TIMEOUT)
        status = ray.get(run, timeout=TIMEOUT)
        assert status["policy_version"] == 3 and status["last_error"] is None
        metrics = ray.get(trainer.metrics.remote())
        full = [m["weight_sync/bytes"] for m in metrics]
        deltas = [m["weight_sync/bytes/wire/delta/bfloat16"] for m in metrics]
        assert all(d < f / 2 for d, f in zip(deltas, full, strict=True)), (deltas, full)
        wire = ray.get(trainer.status.remote())["weight_push"]["wire"]
        assert wire["dtypes"] == {"bf16_maker": "bfloat16"}
        assert wire["deltas_sent"] == 3 and wire["fulls_for_deltas"] == 0
        served = ray.get(maker.served_weights.remote(), timeout=TIMEOUT)
        # The trainer's plain fp32 update (what a maker that names no dtype gets), taken by a bf16 maker here.
        plain = ExperienceMaker("plain", bf16_maker_models(7), CyclingPrompts(arithmetic_prompts()),
                                maker_config(), strategy=naive_strategy())
        update = ray.get(trainer.register_maker.remote("probe"), timeout=TIMEOUT)
        assert update.manifest.kind == "full" and "wire_dtype" not in update.manifest.metadata
        plain.apply_weight_update(update, lambda ref: fetch_chunk(ref, 60), reset=True)
        assert served["version"] == plain.policy_version == 3
        assert served["fingerprint"] == plain.receiver.refresh_fingerprint()
    finally:
        for handle in (trainer, maker):
            ray.kill(handle)
        time.sleep(0.5)
