"""Property test: generated experiences full of extreme finite values (±1e38 and float32's max, ±1e300 in
float64, subnormals, log-probs at the bound, rewards at ±max_abs_reward, in every float dtype) go through
validation, the replay buffer and real GRPO and PPO training steps on the tiny model. Refused pushes name the
corrupted field and change nothing; accepted ones never leave a non-finite weight; buffer statistics and
status always answer (no Ray)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detached_rl import Experience
from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.experience import DEFAULT_MAX_ABS_REWARD, ESTIMATE_SCALE, LOG_PROB_BOUND
from detached_rl.core.replay_buffer import RejectedPushError
from detached_rl.core.sampling import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from detached_rl.weights.update import count_nonfinite

from .helpers import UNCHECKED, ObjectStore, naive_strategy, tiny_actor_critic, tiny_policy

GROUP = 4  # experiences per push (one GRPO group)
EXAMPLES = 250  # pushes per algorithm: 1,000 generated experiences each, 2,000 in all
BATCH = 32  # samples per training step
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SAMPLING = SamplingConfig(max_new_tokens=6)
VOCAB = 463  # the tiny llama's

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
F32_MAX = torch.finfo(torch.float32).max
F16_MAX = torch.finfo(torch.float16).max
BOUNDS = {"log_probs": LOG_PROB_BOUND, "ref_log_probs": LOG_PROB_BOUND, "reward": DEFAULT_MAX_ABS_REWARD,
          **dict.fromkeys(("values", "advantages", "returns"), DEFAULT_MAX_ABS_REWARD * ESTIMATE_SCALE)}
TINY = (5e-324, 1e-310, 1e-45, 1e-40, 1e-8, 0.0)  # subnormal in float64 / float32, tiny normal, zero
# Over the field's bound or not finite in float32 (1e300: inf there, though finite in
# float64) or not finite at all.
BAD = (math.nan, math.inf, -math.inf, 1e300, -1e300, 1e38, -1e38, F32_MAX, -F32_MAX)


def in_bounds(rng: random.Random, field: str, dtype: torch.dtype) -> float:
    """A value the field's bound admits after the cast to `dtype` (the bound
    itself only where it is exact)."""
    bound = BOUNDS[field]
    limit = min(0.99 * bound, 0.99 * F16_MAX) if dtype == torch.float16 else 0.99 * bound
    kind = rng.randrange(5)
    if kind == 0:
        value = rng.uniform(-2, 2)
    elif kind == 1:
        value = rng.choice(TINY)
    elif kind == 2:
        value = rng.choice((-limit, limit))
    elif kind == 3 and dtype in (torch.float32, torch.float64):
        value = rng.choice((-bound, bound))  # exact in float32 and float64 (1e4, 1e10)
    else:
        value = rng.uniform(-limit, limit)
    return -abs(value) if field.endswith("log_probs") else value  # log-probs are <= 0


def tensor(rng: random.Random, field: str, length: int) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    values = [in_bounds(rng, field, dtype) for _ in range(length)]
    return torch.tensor(values, dtype=torch.float64).to(dtype)


def experience(data: st.DataObject, group: str, index: int) -> Experience:
    length = data.draw(st.integers(1, 6), label="response length")
    # Hypothesis picks the shape and a seed; the values come from the seeded generator (far fewer draws).
    rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    per_token = rng.random() < 0.5
    return Experience(
        prompt_ids=torch.tensor([rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))]),
        response_ids=torch.tensor([rng.randrange(VOCAB) for _ in range(length)]),
        log_probs=tensor(rng, "log_probs", length),
        reward=tensor(rng, "reward", length) if per_token else tensor(rng, "reward", 1)[0].clone(),
        values=tensor(rng, "values", length), ref_log_probs=tensor(rng, "ref_log_probs", length),
        advantages=tensor(rng, "advantages", length), returns=tensor(rng, "returns", length),
        maker="maker_0", id=f"{group}-{index}", group_id=group,
    )


def corrupt(data: st.DataObject, exp: Experience) -> str:
    """Put one value no bound admits into one float field; returns the field."""
    field = data.draw(st.sampled_from(sorted(BOUNDS)), label="corrupted field")
    value = getattr(exp, field).to(torch.float64).reshape(-1).clone()
    bad = data.draw(st.sampled_from(BAD + (BOUNDS[field] * 1.5, -BOUNDS[field] * 1.5)), label="bad value")
    if field == "log_probs" and data.draw(st.booleans(), label="positive log-prob"):
        bad = 0.5
    value[data.draw(st.integers(0, value.numel() - 1))] = bad
    # float64 keeps every bad value as it is: a cast to float16 would turn 1e38 into
    # inf (refused all the same).
    setattr(exp, field, value.reshape(getattr(exp, field).shape))
    return field


def weights_finite(trainer: TrainerCore) -> bool:
    return not any(count_nonfinite(p) for model in trainer.weights.synced_models().values()
                   for p in model.state_dict().values())


class Run:
    """One trainer fed by the generated pushes, trained whenever a batch is full, with running tallies."""

    def __init__(self, trainer: TrainerCore) -> None:
        self.trainer = trainer
        self.store = ObjectStore()
        self.pushes = self.generated = self.refused = self.steps = 0

    def push(self, data: st.DataObject) -> None:
        group = f"g{self.pushes}"
        self.pushes += 1
        push = [experience(data, group, i) for i in range(GROUP)]
        self.generated += len(push)
        corrupted = corrupt(data, push[data.draw(st.integers(0, GROUP - 1))]) \
            if data.draw(st.integers(0, 3), label="corrupt?") == 0 else None
        stats_before = self.trainer.buffer.stats()
        if corrupted is not None:
            with pytest.raises(RejectedPushError) as refused:
                self.trainer.push_experience(push)
            assert refused.value.field == corrupted and corrupted in str(refused.value)
            after = self.trainer.buffer.stats()
            assert after.pop("rejected_invalid") == stats_before.pop("rejected_invalid") + 1
            assert after == stats_before
            self.refused += 1
        else:
            assert self.trainer.push_experience(push).accepted == GROUP
        stats = self.trainer.buffer.stats()
        json.dumps(stats)
        assert stats["accounting_ok"] and (stats["reward"]["mean"] is None
                                           or math.isfinite(stats["reward"]["std"]))
        if len(self.trainer.buffer) >= BATCH:
            metrics = self.trainer.train_step()
            self.steps += 1
            assert weights_finite(self.trainer), f"non-finite weights after step {self.steps}: {metrics}"
        status = self.trainer.status()
        assert status["state"] != "failed" and status["last_error"] is None


@pytest.fixture(scope="module")
def runs():
    torch.manual_seed(0)
    grpo = GRPOLearner(tiny_policy(seed=0), naive_strategy(), GRPOConfig(
        sampling=SAMPLING, micro_batch_size=BATCH, actor_optimizer=OptimizerConfig(lr=1e-2)))
    actor, critic = tiny_actor_critic(seed=0)
    ppo = PPOLearner(actor, critic, naive_strategy(), PPOConfig(
        sampling=SAMPLING, kl_coef=0.1, micro_batch_size=BATCH, actor_optimizer=OptimizerConfig(lr=1e-2),
        critic_optimizer=OptimizerConfig(lr=1e-2)))
    config = TrainerConfig(train_batch_size=BATCH, provenance=UNCHECKED)
    out = {name: Run(TrainerCore("trainer", learner, config))
           for name, learner in (("grpo", grpo), ("ppo", ppo))}
    return out


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_extreme_values_never_poison_the_weights(runs, algorithm):
    run = runs[algorithm]

    @SETTINGS
    @given(data=st.data())
    def push_and_train(data):
        run.push(data)

    push_and_train()
    print(f"{algorithm}: {run.generated} experiences in {run.pushes} pushes, {run.refused} refused, "
          f"{run.steps} steps, {run.trainer.skipped_steps} skipped")
    assert run.generated >= 1000 and run.steps >= 15 and run.refused >= 20
    run.trainer.weights.snapshot(run.store.put)  # the weights are sent: every tensor finite
    assert weights_finite(run.trainer) and json.dumps(run.trainer.status())
