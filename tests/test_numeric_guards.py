"""Numeric guards: rewards and other loss inputs finite in float32 and bounded, bounded strings counted in
bytes, dense tensors only, skipped non-finite training steps, no weight update with NaN/inf built (no Ray)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.algorithms.step_guard import NONFINITE_GRAD_NORM, NONFINITE_LOSS, step_unless_nonfinite
from detached_rl.config import ConfigError, load_config
from detached_rl.core.experience import (
    DEFAULT_MAX_ABS_REWARD,
    ESTIMATE_SCALE,
    LOG_PROB_BOUND,
    MAX_ABS_REWARD_LIMIT,
    MAX_NAME_BYTES,
    ExperienceValidationError,
)
from detached_rl.core.replay_buffer import RejectedPushError, ReplayBuffer
from detached_rl.core.sampling import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore, info_means
from detached_rl.weights.update import NonFiniteWeightsError, build_weight_update, count_nonfinite

from .helpers import UNCHECKED, ObjectStore, make_experience, naive_strategy, tiny_actor_critic, tiny_policy

SAMPLING = SamplingConfig(max_new_tokens=4)
TOKEN_FLOATS = ("values", "ref_log_probs", "advantages", "returns")


def refusal(exp, buffer: ReplayBuffer | None = None) -> RejectedPushError:
    """The buffer's refusal of a one-sample push (the buffer's state is checked unchanged)."""
    buffer = buffer or ReplayBuffer()
    before = (buffer.nbytes, len(buffer), buffer.stats()["received"])
    with pytest.raises(RejectedPushError) as refused:
        buffer.append([exp], current_version=0)
    assert (buffer.nbytes, len(buffer), buffer.stats()["received"]) == before
    assert refused.value.field in str(refused.value)
    return refused.value


# ---------------------------------------------------------------- rewards and other float fields


@pytest.mark.parametrize(("reward", "dtype", "says"), [
    (1e300, torch.float64, "inf in torch.float32"),  # finite in float64, inf in the training dtype
    ([3e38, 3e38], torch.float32, "over the limit"),  # finite, but their sum overflows float32
    (1e308, torch.float64, "inf in torch.float32"),
    (-2e4, torch.float32, "over the limit 10000"),
    ([1.0, float("nan")], torch.float32, "non-finite"),
])
def test_rewards_that_would_overflow_training_are_refused_naming_the_field(reward, dtype, says):
    exp = make_experience(response=(8, 9))
    exp.reward = torch.tensor(reward, dtype=dtype)
    refused = refusal(exp)
    assert refused.field == "reward" and says in str(refused)


def test_the_reward_bound_is_configurable_and_inclusive():
    buffer = ReplayBuffer(max_abs_reward=100)
    assert buffer.append([make_experience(reward=100.0), make_experience(reward=-100.0)], 0).accepted == 2
    refused = refusal(make_experience(reward=100.5), buffer)
    assert refused.field == "reward" and "trainer.max_abs_reward" in str(refused)
    assert len(buffer) == 2 and buffer.stats()["accounting_ok"]
    assert ReplayBuffer().max_abs_reward == DEFAULT_MAX_ABS_REWARD


@pytest.mark.parametrize("bad", [float("inf"), math.nan, 0, -1.0, MAX_ABS_REWARD_LIMIT * 10, True, "1e4"])
def test_max_abs_reward_setting_is_checked_by_name(bad):
    with pytest.raises(ValueError, match="TrainerConfig.max_abs_reward"):
        TrainerConfig(max_abs_reward=bad)
    with pytest.raises(ValueError, match="max_abs_reward"):
        ReplayBuffer(max_abs_reward=bad)


@pytest.mark.parametrize("value", ["inf", "0", "1e9"])
def test_max_abs_reward_from_the_command_line_names_the_dotted_key(value):
    with pytest.raises(ConfigError, match=r"^trainer\.max_abs_reward: "):
        load_config(None, [f"trainer.max_abs_reward={value}"])
    assert load_config(None, ["trainer.max_abs_reward=250"]).trainer.max_abs_reward == 250.0


@pytest.mark.parametrize("name", TOKEN_FLOATS + ("log_probs",))
def test_every_float_field_is_finite_in_float32_and_bounded(name):
    limit = LOG_PROB_BOUND if name.endswith("log_probs") else DEFAULT_MAX_ABS_REWARD * ESTIMATE_SCALE
    for value, says in ((-limit * 1.01, "over the limit"), (-1e300, "inf in torch.float32")):
        exp = make_experience(response=(8, 9))
        setattr(exp, name, torch.tensor([-0.5, value], dtype=torch.float64))
        refused = refusal(exp)
        assert refused.field == name and says in str(refused)
    exp = make_experience(response=(8, 9))
    setattr(exp, name, torch.tensor([-0.5, -limit], dtype=torch.float64))  # the bound itself is accepted
    exp.validate()


def test_extreme_but_harmless_values_are_accepted():
    tiny = torch.finfo(torch.float32).smallest_normal / 4  # subnormal in float32
    exp = make_experience(response=(8, 9), log_probs=torch.tensor([-tiny, -LOG_PROB_BOUND]))
    exp.reward = torch.tensor([5e-324, -DEFAULT_MAX_ABS_REWARD], dtype=torch.float64)  # subnormal in float64
    exp.ref_log_probs = torch.tensor([-tiny, -LOG_PROB_BOUND])
    exp.values = torch.tensor([1e9, -1e9], dtype=torch.bfloat16)
    buffer = ReplayBuffer()
    assert buffer.append([exp], 0).accepted == 1
    assert buffer.stats()["reward"]["mean"] == pytest.approx(-DEFAULT_MAX_ABS_REWARD)


def test_a_non_finite_positive_or_unbounded_reference_log_prob_is_refused():
    for value in (LOG_PROB_BOUND * 2, float("inf"), math.nan, float("-inf")):
        exp = make_experience(response=(8, 9))
        exp.ref_log_probs = torch.tensor([-1.0, value])
        assert refusal(exp).field == "ref_log_probs"


# ---------------------------------------------------------------- strings and tensors


@pytest.mark.parametrize("name", ["id", "maker", "group_id"])
def test_string_fields_are_bounded_in_utf8_bytes(name):
    exp = make_experience()
    setattr(exp, name, "x" * (20 * 2**20))  # 20 MB: refused before anything encodes it
    refused = refusal(exp)
    assert refused.field == name and f"{MAX_NAME_BYTES}-byte limit" in str(refused)
    assert len(str(refused)) < 1000  # the message does not carry the 20 MB
    exp = make_experience()
    setattr(exp, name, "€" * (MAX_NAME_BYTES // 3 + 1))  # few enough characters, too many bytes
    refused = refusal(exp)
    assert refused.field == name and "bytes as UTF-8" in str(refused)
    exp = make_experience()
    setattr(exp, name, "\ud800")  # a lone surrogate cannot be encoded
    assert refusal(exp).field == name
    exp = make_experience()
    setattr(exp, name, "é" * (MAX_NAME_BYTES // 2))  # exactly at the limit
    exp.validate()


def test_strings_and_info_count_in_the_buffer_bytes():
    plain = make_experience(id="a", maker="", info={})
    tensor_bytes = 5 * 8 + 2 * 4 + 4
    assert plain.nbytes() == tensor_bytes + len("a") + len("{}")
    rich = make_experience(id="é" * 100, maker="m" * 50, group_id="g" * 10, info={"text": "x" * 1000})
    assert rich.nbytes() == tensor_bytes + 200 + 50 + 10 + len(json.dumps({"text": "x" * 1000}))
    buffer = ReplayBuffer(max_bytes=plain.nbytes() + rich.nbytes())
    buffer.append([plain, rich], 0)
    assert buffer.nbytes == buffer.stats()["bytes"] == plain.nbytes() + rich.nbytes()
    # Large strings fill the budget like tensors do.
    assert buffer.append([make_experience(id="b", maker="m" * 200)], 0).full


def sparse(t: torch.Tensor) -> torch.Tensor:
    return t.to_sparse()


def meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


@pytest.mark.parametrize("convert", [sparse, meta])
@pytest.mark.parametrize("name", ["prompt_ids", "response_ids", "log_probs", "reward", *TOKEN_FLOATS])
def test_sparse_and_meta_tensors_are_refused_naming_the_field(name, convert):
    exp = make_experience(response=(8, 9), values=torch.zeros(2), ref_log_probs=-torch.ones(2),
                          advantages=torch.zeros(2), returns=torch.zeros(2), reward=[0.5, 0.5])
    setattr(exp, name, convert(getattr(exp, name)))
    refused = refusal(exp)
    assert refused.field == name
    assert ("layout torch.sparse_coo" if convert is sparse else "meta tensor") in str(refused)
    with pytest.raises(ExperienceValidationError, match=name):
        exp.validate()


# ---------------------------------------------------------------- statistics


def restored_buffer(rewards: list[torch.Tensor]) -> ReplayBuffer:
    """A buffer restored from a state holding `rewards` (a checkpoint validation never saw)."""
    donor = ReplayBuffer()
    donor.append([make_experience(id=f"s{i}") for i in range(len(rewards))], 0)
    state = donor.state_dict()
    for sample, reward in zip(state["samples"], rewards, strict=True):
        sample["experience"]["reward"] = reward
    buffer = ReplayBuffer()
    buffer.load_state_dict(state)
    return buffer


def test_buffer_statistics_answer_for_any_values():
    huge = restored_buffer([torch.tensor(1e308, dtype=torch.float64),
                            torch.tensor(1e308, dtype=torch.float64),
                            torch.tensor([3e38, 3e38]), torch.tensor(5e-324, dtype=torch.float64)])
    reward = huge.stats()["reward"]
    assert all(math.isfinite(reward[key]) for key in ("mean", "std", "min", "max"))
    assert reward["max"] == 1e308 and reward["mean"] == pytest.approx(0.5e308)
    json.dumps(huge.stats())
    broken = restored_buffer([torch.tensor(math.inf), torch.tensor(math.nan), torch.tensor(1.0)])
    assert broken.stats()["reward"]["max"] == math.inf and math.isnan(broken.stats()["reward"]["mean"])


def test_info_means_skip_numbers_that_are_not_finite_floats():
    experiences = [make_experience(info={"big": 10**400, "nan": math.nan, "ok": 1.0, "huge": 1e308})
                   for _ in range(3)]
    assert info_means(experiences) == {"info/ok": 1.0, "info/huge": pytest.approx(1e308)}


# ---------------------------------------------------------------- skipped steps


def test_a_finite_loss_with_an_overflowing_gradient_norm_is_skipped():
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    loss = model(torch.tensor([[3e38, 3e38]])).sum()  # 3e38 - 3e38 = 0; the gradient is (3e38, 3e38)
    loss.backward()
    norms, skip = step_unless_nonfinite(naive_strategy(), [(optimizer, model, 1.0)], [loss])
    assert skip == NONFINITE_GRAD_NORM and norms == [math.inf]
    assert model.weight.tolist() == [[1.0, -1.0]] and model.weight.grad is None and not optimizer.state
    nan_loss = model(torch.tensor([[math.nan, 1.0]])).sum()
    nan_loss.backward()
    assert step_unless_nonfinite(naive_strategy(), [(optimizer, model, 1.0)], [nan_loss])[1] == NONFINITE_LOSS
    assert not optimizer.state
    good = model(torch.tensor([[1.0, 2.0]])).sum()
    good.backward()
    norms, skip = step_unless_nonfinite(naive_strategy(), [(optimizer, model, 1.0)], [good])
    assert skip is None and norms == [pytest.approx(math.sqrt(5))] and optimizer.state
    assert model.weight.tolist() != [[1.0, -1.0]]


def grpo_trainer() -> TrainerCore:
    learner = GRPOLearner(tiny_policy(seed=0), naive_strategy(),
                          GRPOConfig(sampling=SAMPLING, actor_optimizer=OptimizerConfig(lr=1e-3)))
    return TrainerCore("trainer", learner, TrainerConfig(train_batch_size=4, provenance=UNCHECKED))


def ppo_trainer() -> TrainerCore:
    actor, critic = tiny_actor_critic(seed=0)
    learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(sampling=SAMPLING))
    return TrainerCore("trainer", learner, TrainerConfig(train_batch_size=4, provenance=UNCHECKED))


def batch(algorithm: str, tag: str) -> list:
    extra = {"values": torch.zeros(3)} if algorithm == "ppo" else {}
    return [make_experience(response=(20, 21, 22), reward=float(i % 2), log_probs=torch.full((3,), -2.0),
                            group_id=f"{tag}{i // 2}", id=f"{tag}-{i}", maker="m", **extra) for i in range(4)]


def poison(experiences: list, field: str, value: torch.Tensor) -> ReplayBuffer:
    """Experiences holding `value` in `field` as a restored buffer state would (validation never saw it)."""
    donor = ReplayBuffer()
    donor.append(experiences, 0)
    state = donor.state_dict()
    for sample in state["samples"]:
        sample["experience"][field] = value.clone()
    return state


def snapshot(trainer: TrainerCore) -> dict:
    """Every weight and the optimizer states, copied."""
    learner = trainer.learner
    optimizers = ([learner.optimizer] if hasattr(learner, "optimizer")
                  else [learner.actor_optimizer, learner.critic_optimizer])
    weights = {f"{name}/{key}": tensor.clone() for name, model in trainer.weights.synced_models().items()
               for key, tensor in model.state_dict().items()}
    return {"weights": weights, "optimizers": [copy.deepcopy(o.state_dict()) for o in optimizers]}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def all_finite(trainer: TrainerCore) -> bool:
    return not any(count_nonfinite(t) for model in trainer.weights.synced_models().values()
                   for t in model.state_dict().values())


@pytest.mark.parametrize(("algorithm", "field", "value"), [
    ("grpo", "reward", torch.tensor([3e38, 3e38, 3e38])),  # the poison: the sum is inf in float32
    ("ppo", "values", torch.tensor([3e38, -3e38, 3e38])),  # the critic's squared error overflows
])
def test_a_step_with_a_nonfinite_loss_is_skipped_counted_and_training_goes_on(algorithm, field, value):
    trainer = grpo_trainer() if algorithm == "grpo" else ppo_trainer()
    trainer.push_experience(batch(algorithm, "a"))
    trainer.train_step()  # a real step first: the optimizer holds state that a skip must not touch
    before = snapshot(trainer)
    trainer.buffer.load_state_dict(poison(batch(algorithm, "b"), field, value))
    metrics = trainer.train_step()
    assert metrics["train/skipped_steps"] == 1 and metrics[f"train/skipped_steps/{NONFINITE_LOSS}"] == 1
    assert same(snapshot(trainer), before), "a skipped step changed the weights or the optimizer state"
    assert all_finite(trainer)
    status = trainer.status()
    assert (status["skipped_steps"], status["skip_reasons"]) == (1, {NONFINITE_LOSS: 1})
    assert "step 2" in status["last_skip"] and status["policy_version"] == 2

    trainer.push_experience(batch(algorithm, "c"))
    metrics = trainer.train_step()
    assert metrics["train/skipped_steps"] == 0 and trainer.skipped_steps == 1
    assert not same(snapshot(trainer)["weights"], before["weights"]) and all_finite(trainer)
    trainer.weights.snapshot(ObjectStore().put)  # the weights after a skip are sent as usual


def test_fit_over_a_poisoned_batch_ends_done_and_reports_the_skip():
    trainer = grpo_trainer()
    trainer.buffer.load_state_dict(poison(batch("grpo", "a"), "reward",
                                          torch.tensor(1e300, dtype=torch.float64)))
    trainer.push_experience(batch("grpo", "b"))
    result = trainer.fit(2, ObjectStore().put, lambda update, makers: {})
    assert result["policy_version"] == 2 and trainer.state == "done" and trainer.last_error is None
    assert trainer.status()["skipped_steps"] == 1 and trainer.history[0]["train/skipped_steps"] == 1
    assert trainer.history[1]["train/skipped_steps"] == 0 and all_finite(trainer)


# ---------------------------------------------------------------- weight updates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_no_weight_update_with_a_nonfinite_tensor_is_built(dtype, bad):
    state = {"embed.weight": torch.ones(4, 3, dtype=dtype), "head.weight": torch.ones(2, 3, dtype=dtype)}
    state["head.weight"][1, 2] = bad
    store = ObjectStore()
    with pytest.raises(NonFiniteWeightsError, match=r"'actor/head.weight' holds 1 NaN/inf values") as refused:
        build_weight_update({"actor": state}, 7, store.put)
    assert refused.value.tensor == "actor/head.weight" and "v7" in str(refused.value)


def test_large_finite_weights_are_not_mistaken_for_nonfinite_ones():
    state = {"big64": torch.full((4,), 1e308, dtype=torch.float64),  # its sum overflows; no element does
             "big16": torch.full((1000,), 60000.0, dtype=torch.float16), "ids": torch.arange(3)}
    update, _ = build_weight_update({"actor": state}, 1, ObjectStore().put)
    assert len(update.manifest.tensors) == 3


def test_fit_fails_loudly_instead_of_sending_nan_weights():
    trainer = grpo_trainer()
    name, parameter = next(iter(trainer.learner.policy.model.named_parameters()))
    with torch.no_grad():
        parameter.view(-1)[0] = math.nan  # weights gone bad some other way (a restored checkpoint ...)
    trainer.push_experience(batch("grpo", "a"))
    with pytest.raises(NonFiniteWeightsError, match=name):
        trainer.fit(1, ObjectStore().put, lambda update, makers: {})
    assert trainer.state == "failed" and name in trainer.last_error
