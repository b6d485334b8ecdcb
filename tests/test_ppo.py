"""PPO learner: on-policy ratio 1, token-weighted accumulation, learning a simple preference, config errors."""

import pytest
import torch

from detached_rl import Experience
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
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["policy/clipfrac"] == 0.0 and abs(metrics["policy/approx_kl"]) < 1e-5
    assert metrics["samples"] == 8 and metrics["staleness/mean"] == 0
    for key in ("loss/policy", "loss/value", "loss/entropy", "value/error", "grad_norm/actor", "perf/tokens_per_s"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key]))
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
    assert metrics["policy/ratio_mean"] != pytest.approx(1.0, abs=1e-7)  # later mini-batches are off-policy


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
    assert metrics["kl/mean"] == pytest.approx(float(kl.sum() / batch.num_response_tokens), rel=1e-5)
    as_loss = make_learner(kl_coef=0.1, kl_mode="loss", kl_kind="k3")  # k3 >= 0; k1 can be negative
    assert as_loss.train_step(experiences)["loss/kl"] > 0
    with pytest.raises(ValueError, match="ref_log_probs"):
        learner.train_step(make_experiences(learner))
    no_values = make_experiences(learner, reference=reference)
    for e in no_values:
        e.values = None
    with pytest.raises(ValueError, match="values"):
        learner.train_step(no_values)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(dict(kl_mode="x"), "kl_mode"), (dict(kl_kind="k9"), "kl_kind"), (dict(loss_agg="sum"), "loss_agg"),
     (dict(micro_batch_size=0), "micro_batch_size"), (dict(train_epochs=0), "train_epochs"),
     (dict(mini_batch_size=0), "mini_batch_size"), (dict(kl_coef=-1), "kl_coef"), (dict(gamma=2), "gamma")],
)
def test_ppo_config_refuses_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"PPOConfig.{field}"):
        PPOConfig(**kwargs)
