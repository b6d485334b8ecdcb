"""PPO learner: on-policy ratio 1, token-weighted accumulation, learning a simple preference, config errors."""

import pytest
import torch

from detached_rl import Experience
from detached_rl.algorithms.metrics import METRIC_ALIASES, METRICS
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner, ppo_advantages
from detached_rl.generation import HFGenerationBackend
from detached_rl.models import Actor, Critic, SamplingConfig, tiny_causal_lm
from detached_rl.models.scalar_heads import backbone_of
from detached_rl.strategies import NaiveStrategy
from detached_rl.strategies.optim import OptimizerConfig

SAMPLING = SamplingConfig(max_new_tokens=6)
TARGET_BELOW = 100  # reward: the fraction of response tokens with an id below this


class RecordingStrategy(NaiveStrategy):
    """Keeps a copy of the gradients seen at each optimizer step."""

    def __init__(self):
        super().__init__()
        self.grads = []

    def optimizer_step(self, optimizer, model, max_grad_norm=None):
        self.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        return super().optimizer_step(optimizer, model, max_grad_norm)


def make_learner(seed=0, strategy=None, **config):
    policy, tokenizer = tiny_causal_lm("llama", seed=seed)
    value_model, _ = tiny_causal_lm("llama", seed=seed + 100)
    config.setdefault("sampling", SAMPLING)
    config.setdefault("actor_optimizer", OptimizerConfig(lr=1e-3))
    torch.manual_seed(seed)  # the critic's value head is initialised from the global RNG
    return PPOLearner(Actor(policy, tokenizer), Critic(backbone_of(value_model)),
                      strategy or NaiveStrategy(), PPOConfig(**config))


def make_experiences(learner, count=8, seed=0, reference=None):
    torch.manual_seed(seed)
    actor, critic = learner.actor, learner.critic
    out = HFGenerationBackend.from_actor(actor).generate_text([f"q{i}" for i in range(count)], SAMPLING)
    experiences = []
    for p, r, lp in zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True):
        seq = torch.cat([p, r])[None]
        mask = torch.ones_like(seq)
        response_mask = torch.ones(1, len(r))
        with torch.no_grad():
            values = critic(seq, mask, response_mask)[0]
            ref = reference.log_probs(seq, mask, response_mask, SAMPLING)[0] if reference else None
        reward = torch.tensor(float((r < TARGET_BELOW).float().mean()))
        experiences.append(Experience(p, r, lp, reward, values=values, ref_log_probs=ref, maker="m"))
    return experiences


def test_first_step_on_fresh_experience_is_on_policy():
    learner = make_learner()
    metrics = learner.train_step(make_experiences(learner), policy_version=0)
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["policy/clipfrac_avg"] == 0.0 and abs(metrics["policy/approx_kl_avg"]) < 1e-5
    assert metrics["samples"] == 8 and metrics["staleness/mean"] == 0
    for key in ("loss/policy_avg", "loss/value_avg", "loss/entropy_avg", "loss/total_avg", "loss/kl_avg",
                "policy/entropy_avg", "value/error_avg", "grad_norm/actor", "perf/tokens_per_s", "time/training"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key]))
    assert metrics["loss/kl_avg"] == 0.0  # no reference log-probs sent: nothing to compare with
    # The old names stay, with the same values.
    for old, new in METRIC_ALIASES.items():
        if new in metrics:
            assert metrics[old] == metrics[new], old
    assert metrics["loss/policy"] == metrics["loss/policy_avg"] and metrics["time/train_step"] == metrics["time/training"]
    assert all(key in METRICS for key in METRIC_ALIASES.values())
    assert learner.optimizer_steps == 1


def test_micro_batches_accumulate_to_the_full_batch_gradient():
    full = make_learner(strategy=RecordingStrategy(), micro_batch_size=8, whiten_advantages=False)
    micro = make_learner(strategy=RecordingStrategy(), micro_batch_size=3, whiten_advantages=False)
    experiences = make_experiences(full)
    torch.manual_seed(1)
    full.train_step(experiences)
    torch.manual_seed(1)
    micro.train_step(experiences)
    for a, b in zip(full.strategy.grads, micro.strategy.grads, strict=True):  # actor, then critic
        assert a.keys() == b.keys()
        for name in a:
            assert torch.allclose(a[name], b[name], atol=1e-6, rtol=1e-4), name


def test_mini_batches_and_epochs_count_optimizer_steps():
    learner = make_learner(mini_batch_size=4, train_epochs=2)
    metrics = learner.train_step(make_experiences(learner))
    assert learner.optimizer_steps == 4  # 2 epochs x 8 / 4
    assert metrics["val/ratio"] != pytest.approx(1.0, abs=1e-7)  # later mini-batches are off-policy


def test_ppo_raises_the_probability_of_rewarded_tokens():
    learner = make_learner(actor_optimizer=OptimizerConfig(lr=1e-2), critic_optimizer=OptimizerConfig(lr=1e-2),
                           lam=1.0)
    probe = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])

    def target_log_prob():
        with torch.no_grad():
            logits = learner.actor.model(probe).logits[0]
        return float(logits.log_softmax(-1)[:, :TARGET_BELOW].logsumexp(-1).mean())

    before = target_log_prob()
    rewards = []
    for step in range(15):
        experiences = make_experiences(learner, count=16, seed=step)
        rewards.append(sum(e.score for e in experiences) / len(experiences))
        learner.train_step(experiences, policy_version=step)
    assert target_log_prob() > before + 0.5
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3


def test_kl_penalty_in_reward_and_as_loss():
    learner = make_learner(kl_coef=0.1)
    reference = Actor(*tiny_causal_lm("llama", seed=5))
    experiences = make_experiences(learner, reference=reference)
    from detached_rl import collate

    batch = collate(experiences, 0)
    _, _, kl = ppo_advantages(batch, learner.config)
    assert kl is not None and float(kl.abs().sum()) > 0
    metrics = learner.train_step(experiences)
    assert metrics["objective/kl_avg"] == pytest.approx(float(kl.sum() / batch.num_response_tokens), rel=1e-5)
    assert metrics["kl/mean"] == metrics["objective/kl_avg"]
    # KL in the reward: the trained policy's KL is still reported (it is not a loss term).
    assert metrics["loss/kl_avg"] != 0.0 and metrics["loss/total_avg"] == pytest.approx(
        metrics["loss/policy_avg"] + 0.5 * metrics["loss/value_avg"], abs=1e-5)
    as_loss = make_learner(kl_coef=0.1, kl_mode="loss", kl_kind="k3")  # k3 >= 0; k1 can be negative
    in_loss = as_loss.train_step(experiences)
    assert in_loss["loss/kl_avg"] > 0 and in_loss["loss/kl"] == in_loss["loss/kl_avg"]
    assert in_loss["loss/total_avg"] == pytest.approx(
        in_loss["loss/policy_avg"] + 0.1 * in_loss["loss/kl_avg"] + 0.5 * in_loss["loss/value_avg"], abs=1e-5)
    with pytest.raises(ValueError, match="ref_log_probs"):
        learner.train_step(make_experiences(learner))
    # Without a KL penalty, the KL to the reference is still reported when the makers send its log-probs.
    unpenalised = make_learner(kl_coef=0.0, kl_kind="k3").train_step(experiences)  # k3 >= 0
    assert unpenalised["loss/kl_avg"] > 0 and unpenalised["loss/total_avg"] == pytest.approx(
        unpenalised["loss/policy_avg"] + 0.5 * unpenalised["loss/value_avg"], abs=1e-5)
    no_values = make_experiences(learner, reference=reference)
    for e in no_values:
        e.values = None
    with pytest.raises(ValueError, match="values"):
        learner.train_step(no_values)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(dict(kl_mode="x"), "kl_mode"), (dict(kl_kind="k9"), "kl_kind"), (dict(loss_agg="sum"), "loss_agg"),
     (dict(micro_batch_size=0), "micro_batch_size"), (dict(train_epochs=0), "train_epochs"),
     (dict(mini_batch_size=0), "mini_batch_size"), (dict(kl_coef=-1), "kl_coef"), (dict(gamma=2), "gamma"),
     (dict(advantage_estimator="vtrace"), "advantage_estimator"), (dict(policy_loss="nope"), "policy_loss")],
)
def test_ppo_config_refuses_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"PPOConfig.{field}"):
        PPOConfig(**kwargs)


def test_the_advantage_estimator_is_chosen_by_name():
    learner = make_learner(whiten_advantages=False)
    from detached_rl import collate
    from detached_rl.algorithms import compute_gae

    experiences = make_experiences(learner)
    batch = collate(experiences, 0)
    advantages, returns, _ = ppo_advantages(batch, learner.config)  # the default: GAE
    expected, expected_returns = compute_gae(batch.token_rewards, batch.values, batch.response_mask, 1.0, 0.95)
    assert torch.equal(advantages, expected) and torch.equal(returns, expected_returns)
    # REINFORCE++ instead: the whitened reward to go; the critic then learns the reward to go.
    reinforce = make_learner(advantage_estimator="reinforce_pp", whiten_advantages=False)
    advantages, returns, _ = ppo_advantages(batch, reinforce.config)
    mask = batch.response_mask.bool()
    assert torch.allclose(returns[mask], batch.scores.repeat_interleave(batch.response_mask.sum(1).long()))
    assert advantages[mask].mean().abs() < 1e-5
    metrics = reinforce.train_step(experiences)
    assert torch.isfinite(torch.tensor(metrics["loss/value_avg"]))


def test_sampling_is_passed_to_the_learner_or_taken_from_the_config():
    from detached_rl.models import Critic

    policy, tokenizer = tiny_causal_lm("llama", seed=0)
    critic = Critic(backbone_of(tiny_causal_lm("llama", seed=1)[0]))
    explicit = SamplingConfig(max_new_tokens=3, temperature=0.5)
    learner = PPOLearner(Actor(policy, tokenizer), critic, NaiveStrategy(), PPOConfig(sampling=SAMPLING),
                         sampling=explicit)
    assert learner.sampling is explicit
    assert make_learner().sampling is SAMPLING  # from the config
    assert PPOLearner(Actor(policy, tokenizer), critic, NaiveStrategy()).sampling == SamplingConfig()
