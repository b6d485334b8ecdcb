"""Checkpoints: atomic writes, and resuming a trainer ends with the weights of an uninterrupted run."""

import functools
import json
import logging
import pickle
import random

import numpy as np
import pytest
import torch

from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.checkpoint import CheckpointError, load_state, rng_state, save_atomic, set_rng_state
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.models import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore

from .helpers import (
    UNCHECKED,
    LowTokenReward,
    ObjectStore,
    arithmetic_prompts,
    naive_strategy,
    tiny_actor_critic,
    tiny_maker_models,
    tiny_policy,
)
from .test_checkpoint_recovery import kill_during

SAMPLING = SamplingConfig(max_new_tokens=5)


def test_save_atomic_replaces_whole_and_refuses_non_checkpoints(tmp_path):
    save_atomic({"step": 1}, tmp_path / "ckpt")
    save_atomic({"step": 2}, tmp_path / "ckpt")
    assert load_state(tmp_path / "ckpt") == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(FileNotFoundError, match="not a detached-rl checkpoint"):
        load_state(tmp_path)


def test_state_round_trips_through_safetensors_and_json_without_pickle(tmp_path):
    shared = torch.arange(6.0)
    state = {
        "weights": {"a": shared, "view": shared[:3], "bf16": torch.ones(2, 2, dtype=torch.bfloat16),
                    "empty": torch.zeros(0, 4)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"betas": (0.9, 0.99)}]},
        "rng": rng_state(), "numbers": [1, 2.5, float("inf"), None, True], "blob": b"\x00\xff",
        "histogram": {(1, "a"): 2},
    }
    save_atomic(state, tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["state.json", "tensors.safetensors"]
    loaded = load_state(tmp_path / "ckpt")
    assert torch.equal(loaded["weights"]["view"],
                       torch.arange(3.0)) and loaded["weights"]["bf16"].dtype == torch.bfloat16
    assert loaded["weights"]["empty"].shape == (0, 4)
    assert loaded["optimizer"]["state"][0]["step"].item() == 3.0
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert loaded["numbers"] == state["numbers"] and loaded["blob"] == b"\x00\xff"
    assert loaded["histogram"] == {(1, "a"): 2}
    assert loaded["rng"]["python"] == random.getstate()
    assert np.array_equal(loaded["rng"]["numpy"][1], np.random.get_state()[1])
    assert torch.equal(loaded["rng"]["torch"], torch.get_rng_state())


def test_unstorable_state_is_refused_with_its_path_and_a_pickle_is_never_loaded(tmp_path):
    with pytest.raises(CheckpointError, match=r"at \.learner\.hook: cannot store a function"):
        save_atomic({"learner": {"hook": lambda: None}}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()

    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled')",))

    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "state.pt").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(FileNotFoundError, match="not a detached-rl checkpoint"):
        load_state(tmp_path / "evil")
    save_atomic({"x": torch.ones(1)}, tmp_path / "ckpt")
    document = json.loads((tmp_path / "ckpt" / "state.json").read_text())
    document["state"]["x"]["__tensor__"] = "t9"
    (tmp_path / "ckpt" / "state.json").write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match="references tensor 't9'"):
        load_state(tmp_path / "ckpt")


def make_trainer(algorithm, mini_batch_size=None):
    if algorithm == "ppo":
        actor, critic = tiny_actor_critic(seed=0)
        config = PPOConfig(sampling=SAMPLING, kl_coef=0.01, actor_optimizer=OptimizerConfig(lr=1e-3))
        learner = PPOLearner(actor, critic, naive_strategy(), config)
    else:
        learner = GRPOLearner(tiny_policy(seed=0), naive_strategy(),
                              GRPOConfig(sampling=SAMPLING, kl_coef=0.05, ref_update_every=2,
                                         ref_update_alpha=0.5,
                                         mini_batch_size=mini_batch_size,
                                         actor_optimizer=OptimizerConfig(lr=1e-3, schedule="cosine",
                                                                         total_steps=10, warmup_steps=1)))
    return TrainerCore("trainer", learner, TrainerConfig(train_batch_size=8, provenance=UNCHECKED))


@functools.cache
def make_batches(algorithm, count):  # shared by the tests: pushing an experience leaves it unchanged
    models = tiny_maker_models(seed=4) if algorithm == "ppo" else MakerModels(
        actor=tiny_policy(seed=4), reward=LowTokenReward())
    maker = ExperienceMaker("maker", models, CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=4 if algorithm == "ppo" else 2,
                                        group_size=1 if algorithm == "ppo" else 4, sampling=SAMPLING),
                            strategy=naive_strategy())
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
    latest = resumed.weights.latest_update.manifest
    assert latest.kind == "full" and latest.version == 2
    resumed.buffer.clear()  # the straight run never saw that extra push
    run(resumed, 2, 4)
    for (name, a), (_, b) in zip(straight.learner.state_dict()["actor"].items(),
                                 resumed.learner.state_dict()["actor"].items(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name


def test_set_rng_state_restores_python_numpy_and_torch_through_a_checkpoint(tmp_path):
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    save_atomic({"rng": rng_state()}, tmp_path / "ckpt")
    expected = draws()
    random.seed(2), np.random.seed(2), torch.manual_seed(2)  # what a fresh process would hold
    set_rng_state(load_state(tmp_path / "ckpt")["rng"])
    got = draws()
    assert got[0] == expected[0] and got[1] == expected[1] and got[2] == expected[2]


def test_resume_restores_the_random_order_of_mini_batches(tmp_path, monkeypatch):
    """Two mini-batches per step in a random order drawn by the learner's own generator: only that
    generator restored gives the uninterrupted run's weights, whatever torch's global state is."""
    first, second = make_batches("grpo", 2)  # one 8-sample step each

    def step_after_resume():
        torch.manual_seed(1234)  # a fresh process's random state, not the checkpoint's
        trainer = make_trainer("grpo", mini_batch_size=4)
        trainer.load_checkpoint(tmp_path / "ckpt")
        trainer.push_experience(second)
        trainer.train_step()
        return trainer.learner.state_dict()["actor"]

    torch.manual_seed(1)
    straight = make_trainer("grpo", mini_batch_size=4)
    straight.push_experience(first)
    straight.train_step()  # the order generator has drawn once
    straight.save_checkpoint(tmp_path / "ckpt")
    straight.push_experience(second)
    straight.train_step()
    expected = straight.learner.state_dict()["actor"]

    resumed = step_after_resume()
    assert all(torch.equal(expected[name], resumed[name]) for name in expected)
    restore = GRPOLearner.load_state_dict
    monkeypatch.setattr(GRPOLearner, "load_state_dict", lambda learner, state: restore(
        learner, {key: value for key, value in state.items() if key != "order_generator"}))
    unrestored = step_after_resume()
    assert not all(torch.allclose(expected[name], unrestored[name], atol=1e-6) for name in expected)


def test_a_trainer_killed_between_the_renames_of_its_save_resumes_from_the_previous_checkpoint(
        tmp_path, caplog):
    trainer = make_trainer("grpo")
    trainer.save_checkpoint(tmp_path / "ckpt")
    trainer.push_experience(make_batches("grpo", 5)[0])
    trainer.train_step()
    kill_during(lambda: trainer.save_checkpoint(tmp_path / "ckpt"), "rename_1")
    assert not (tmp_path / "ckpt" / "rank_0").exists() and (tmp_path / "ckpt" / ".rank_0.old").is_dir()

    resumed = make_trainer("grpo")
    with caplog.at_level(logging.WARNING):
        resumed.load_checkpoint(tmp_path / "ckpt", ObjectStore().put)
    assert resumed.policy_version == 0 and "loading the previous checkpoint" in caplog.text
    resumed.push_experience(make_batches("grpo", 5)[0])
    resumed.train_step()
    resumed.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["rank_0"]
