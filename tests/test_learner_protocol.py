"""The registries of advantage estimators and policy losses, and the `Learner` protocol the trainer drives."""

from __future__ import annotations

import pytest
import torch

from detached_rl import Experience, collate
from detached_rl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    AdvantageSettings,
    PolicyLossSettings,
    broadcast_to_tokens,
    compute_gae,
    get_advantage_estimator,
    get_policy_loss,
    group_advantages,
    policy_loss,
    register_advantage_estimator,
    rewards_to_go,
)
from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.algorithms.learner import Learner
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from tests.test_ppo import make_learner as make_ppo_learner

from .helpers import lane_device, naive_strategy, tiny_policy

SAMPLING = SamplingConfig(max_new_tokens=6)


def test_every_estimator_and_loss_of_the_learners_is_registered():
    assert set(ADVANTAGE_ESTIMATORS) >= {"gae", "grpo", "dr_grpo", "rloo", "reinforce_pp",
                                         "reinforce_pp_baseline"}
    assert "ppo_clip" in POLICY_LOSSES
    with pytest.raises(ValueError, match="unknown advantage estimator 'vtrace'; registered:"):
        get_advantage_estimator("vtrace")
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        get_policy_loss("nope")
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_advantage_estimator("grpo")(lambda inputs, settings: (inputs.mask, inputs.mask))


def test_registered_estimators_compute_the_formulas():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    scores = torch.tensor([1.0, 0.0, 2.0])
    token_rewards = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, -0.5], [2.0, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 9.0], [0.3, 0.4, 0.5], [0.6, 9.0, 9.0]])
    inputs = AdvantageInputs(mask=mask, scores=scores, token_rewards=token_rewards, values=values,
                             group_ids=["a", "a", None])
    settings = AdvantageSettings(gamma=0.9, lam=0.8)
    gae, returns = get_advantage_estimator("gae")(inputs, settings)
    expected = compute_gae(token_rewards, values, mask, 0.9, 0.8)
    assert torch.equal(gae, expected[0]) and torch.equal(returns, expected[1])
    rloo, rloo_returns = get_advantage_estimator("rloo")(inputs, settings)
    # Group a: 1 - 0 and 0 - 1; the response without a group is its own: r.
    assert torch.equal(rloo, broadcast_to_tokens(torch.tensor([1.0, -1.0, 2.0]), mask))
    # Rewards to go with gamma 0.9: [0 + 0.9 * 1, 1], [0.5 + 0.9 * (0 + 0.9 * -0.5), 0 - 0.45, -0.5], [2].
    by_hand = torch.tensor([[0.9, 1.0, 0.0], [0.5 - 0.405, -0.45, -0.5], [2.0, 0.0, 0.0]])
    assert torch.allclose(rloo_returns, by_hand) and torch.allclose(rewards_to_go(token_rewards, mask, 0.9),
                                                                    by_hand)
    grpo, _ = get_advantage_estimator("grpo")(inputs, settings)
    assert torch.equal(grpo, broadcast_to_tokens(
        group_advantages(scores, group_ids=["a", "a", "single:2"], method="grpo"), mask))
    with pytest.raises(ValueError, match="'gae' needs values"):
        get_advantage_estimator("gae")(AdvantageInputs(mask=mask, scores=scores, token_rewards=token_rewards),
                                       settings)
    with pytest.raises(ValueError, match="'grpo' needs group_ids"):
        get_advantage_estimator("grpo")(AdvantageInputs(mask=mask, scores=scores,
                                                        token_rewards=token_rewards),
                                        settings)


def test_the_registered_clipped_loss_is_policy_loss():
    torch.manual_seed(0)
    log_probs, old, advantages = torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4)
    mask = torch.ones(3, 4)
    settings = PolicyLossSettings(clip_low=0.1, clip_high=0.3, dual_clip=3.0, agg="seq-mean-token-sum-norm",
                                  max_length=8)
    got, got_stats = get_policy_loss("ppo_clip")(log_probs, old, advantages, mask, settings)
    want, want_stats = policy_loss(log_probs, old, advantages, mask, 0.1, 0.3, 3.0, "seq-mean-token-sum-norm",
                                   max_length=8)
    assert torch.equal(got, want) and got_stats.keys() == want_stats.keys()


@pytest.fixture
def constant_estimator():
    """A new estimator: one registered function (removed again after the test)."""

    @register_advantage_estimator("test_constant")
    def constant(inputs: AdvantageInputs, settings: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
        """Advantage 0.5 at every valid token."""
        advantages = torch.where(inputs.mask.bool(), 0.5, 0.0)
        return advantages, advantages

    yield "test_constant"
    del ADVANTAGE_ESTIMATORS["test_constant"]


def test_a_new_estimator_is_one_function_and_a_config_string(constant_estimator):
    grpo = GRPOLearner(tiny_policy(seed=0), naive_strategy(),
                       GRPOConfig(advantage_estimator=constant_estimator), sampling=SAMPLING)
    batch = collate([Experience(torch.tensor([5, 6]), torch.arange(10, 10 + n), torch.full((n,), -1.0),
                                torch.tensor(1.0), group_id="g") for n in (2, 3)], 0).to(lane_device())
    advantages = grpo.advantages(batch, batch.scores, None)
    assert advantages.tolist() == [[0.5, 0.5, 0.0], [0.5, 0.5, 0.5]]


def test_both_learners_satisfy_the_learner_protocol():
    ppo = make_ppo_learner()
    grpo = GRPOLearner(tiny_policy(seed=0), naive_strategy(), GRPOConfig(algorithm="dapo"),
                       sampling=SAMPLING)
    assert isinstance(ppo, Learner) and isinstance(grpo, Learner)
    assert not isinstance(object(), Learner)
    assert (ppo.assembles_batches, ppo.max_sampling_rounds) == (False, 1)
    assert (grpo.assembles_batches, grpo.max_sampling_rounds) == (True, 8)
    assert GRPOLearner(grpo.policy, naive_strategy(), GRPOConfig(),
                       sampling=SAMPLING).max_sampling_rounds == 1
    grpo.train_epochs = 3
    assert grpo.config.train_epochs == 3
    assert ppo.make_batch(lambda count: list(range(count)), 4) == ([0, 1, 2, 3], {})


class ProtocolOnly:
    """Forwards exactly the `Learner` members to a real learner: the trainer must need nothing else."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.strategy, self.actor = inner.strategy, inner.actor
        self.assembles_batches, self.max_sampling_rounds = inner.assembles_batches, inner.max_sampling_rounds

    @property
    def train_epochs(self) -> int:
        return self._inner.train_epochs

    @train_epochs.setter
    def train_epochs(self, epochs: int) -> None:
        self._inner.train_epochs = epochs

    def synced_models(self):
        return self._inner.synced_models()

    def synced_sources(self):
        return self._inner.synced_sources()

    def make_batch(self, sample, size):
        return self._inner.make_batch(sample, size)

    def train_step(self, experiences, policy_version=None):
        return self._inner.train_step(experiences, policy_version=policy_version)

    def state_dict(self):
        return self._inner.state_dict()

    def load_state_dict(self, state):
        self._inner.load_state_dict(state)


def test_the_trainer_uses_only_the_protocol(tmp_path):
    grpo = GRPOLearner(tiny_policy(seed=0), naive_strategy(), GRPOConfig(algorithm="dapo"),
                       sampling=SAMPLING)
    learner = ProtocolOnly(grpo)
    assert isinstance(learner, Learner) and not hasattr(learner, "config")
    trainer = TrainerCore("trainer", learner, TrainerConfig(train_batch_size=4, batch_timeout_s=5))
    samples = [Experience(torch.tensor([5, 6]), torch.arange(10, 13), torch.full((3,), -1.0),
                          torch.tensor(float(i % 2)), group_id=str(i // 2), policy_version=0)
               for i in range(4)]
    trainer.push_experience(samples)
    metrics = trainer.train_step()
    assert trainer.policy_version == 1 and "loss/kl_avg" in metrics
    trainer.save_checkpoint(tmp_path)
    trainer.load_checkpoint(tmp_path)
    # Dynamic sampling that finds no useful group names the learner's draw count.
    uniform = [Experience(torch.tensor([5, 6]), torch.arange(10, 13), torch.full((3,), -1.0),
                          torch.tensor(1.0),
                          group_id=f"u{i // 2}", policy_version=1, id=f"u{i}") for i in range(32)]
    trainer.push_experience(uniform)
    with pytest.raises(RuntimeError, match="no group with different rewards in 8 draws"):
        trainer.train_step()
