"""Checkpoints: atomic writes, and resuming a trainer ends with the weights of an uninterrupted run."""

import pytest
import torch

from detached_rl.checkpoint import load_state, save_atomic
from detached_rl.grpo import GRPOConfig, GRPOLearner
from detached_rl.maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.models import Actor, SamplingConfig, tiny_causal_lm
from detached_rl.optim import OptimizerConfig
from detached_rl.ppo import PPOConfig, PPOLearner
from detached_rl.prompts import CyclingPrompts
from detached_rl.strategies import NaiveStrategy
from detached_rl.trainer import TrainerConfig, TrainerCore

from .helpers import LowTokenReward, ObjectStore, arithmetic_prompts, tiny_actor_critic, tiny_maker_models

SAMPLING = SamplingConfig(max_new_tokens=5)


def test_save_atomic_replaces_whole_and_refuses_non_checkpoints(tmp_path):
    save_atomic({"step": 1}, tmp_path / "ckpt")
    save_atomic({"step": 2}, tmp_path / "ckpt")
    assert load_state(tmp_path / "ckpt") == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(FileNotFoundError, match="not a detached-rl checkpoint"):
        load_state(tmp_path)


def make_trainer(algorithm):
    if algorithm == "ppo":
        actor, critic = tiny_actor_critic(seed=0)
        learner = PPOLearner(actor, critic, NaiveStrategy(), PPOConfig(sampling=SAMPLING, kl_coef=0.01,
                                                                      actor_optimizer=OptimizerConfig(lr=1e-3)))
    else:
        learner = GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), NaiveStrategy(),
                              GRPOConfig(sampling=SAMPLING, kl_coef=0.05, ref_update_every=2, ref_update_alpha=0.5,
                                         actor_optimizer=OptimizerConfig(lr=1e-3, schedule="cosine",
                                                                         total_steps=10, warmup_steps=1)))
    return TrainerCore("trainer", learner, TrainerConfig(train_batch_size=8))


def make_batches(algorithm, count):
    models = tiny_maker_models(seed=4) if algorithm == "ppo" else MakerModels(
        actor=Actor(*tiny_causal_lm("llama", seed=4)), reward=LowTokenReward())
    maker = ExperienceMaker("maker", models, CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=4 if algorithm == "ppo" else 2,
                                        group_size=1 if algorithm == "ppo" else 4, sampling=SAMPLING))
    maker.receiver._version = 0  # serve its own weights: the batches only need to be fixed inputs
    torch.manual_seed(0)
    return [maker.make_experience() for _ in range(count)]


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_resume_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, algorithm):
    per_step = 2 if algorithm == "ppo" else 1  # pushes per 8-sample step
    pushes = make_batches(algorithm, 4 * per_step + per_step)
    store = ObjectStore()

    def run(trainer, first, last):
        for step in range(first, last):
            for push in pushes[step * per_step : (step + 1) * per_step]:
                trainer.push_experience(push)
            trainer.train_step()

    torch.manual_seed(1)
    straight = make_trainer(algorithm)
    run(straight, 0, 4)

    torch.manual_seed(1)
    first = make_trainer(algorithm)
    run(first, 0, 2)
    first.push_experience(pushes[-1])  # waiting in the buffer when the checkpoint is taken
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = make_trainer(algorithm)
    resumed.load_checkpoint(tmp_path / "ckpt", store.put)
    assert resumed.policy_version == 2 and len(resumed.buffer) == len(pushes[-1])
    assert resumed.latest_update.manifest.kind == "full" and resumed.latest_update.manifest.version == 2
    resumed.buffer.clear()  # the straight run never saw that extra push
    run(resumed, 2, 4)
    for (name, a), (_, b) in zip(straight.learner.state_dict()["actor"].items(),
                                 resumed.learner.state_dict()["actor"].items(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
