"""GRPO family: variant defaults, hand-checked shaping and advantages, off-policy correction, learning."""

import pytest
import torch

from detached_rl import Experience, collate
from detached_rl.algorithms import metrics as names
from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner, overlong_penalty
from detached_rl.algorithms.grpo_batches import split_groups
from detached_rl.algorithms.grpo_config import PRESETS, VariantPreset
from detached_rl.algorithms.mismatch import masked_kl
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.generation import HFGenerationBackend
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.models import Actor, SamplingConfig, reference_sampling, tiny_causal_lm
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore

from .helpers import LowTokenReward, ObjectStore, arithmetic_prompts, lane_device, naive_strategy

SAMPLING = SamplingConfig(max_new_tokens=6)


def learner(**config):
    config.setdefault("sampling", SAMPLING)
    return GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy(), GRPOConfig(**config))


def exp(score, group, length=3, version=0, lp=-1.0):
    return Experience(torch.tensor([5, 6]), torch.arange(10, 10 + length), torch.full((length,), lp),
                      torch.tensor(float(score)), policy_version=version, group_id=group)


def test_variant_defaults():
    assert GRPOConfig().loss_agg == "seq-mean-token-mean" and GRPOConfig().clip_high is None
    dapo = GRPOConfig(algorithm="dapo")
    assert (dapo.clip_high, dapo.loss_agg, dapo.dynamic_sampling,
            dapo.overlong_shaping) == (0.28, "token-mean",
                                                                                              True, True)
    assert GRPOConfig(algorithm="dr_grpo").loss_agg == "seq-mean-token-sum-norm"
    assert GRPOConfig(algorithm="dapo", clip_high=0.3, dynamic_sampling=False).clip_high == 0.3
    assert GRPOConfig(algorithm="rloo").advantage_method == "rloo"
    assert GRPOConfig(algorithm="reinforce_pp").advantage_method is None
    assert GRPOConfig(algorithm="dapo").advantage_estimator == "grpo"
    assert GRPOConfig(algorithm="rloo", advantage_estimator="dr_grpo").advantage_estimator == "dr_grpo"
    assert GRPOConfig(algorithm="reinforce_pp").kl_in_reward and not GRPOConfig(algorithm="dapo").kl_in_reward
    for kwargs, field in [(dict(algorithm="ppo"), "algorithm"), (dict(loss_agg="sum"), "loss_agg"),
                          (dict(advantage_estimator="gae"), "advantage_estimator"),  # needs a critic
                          (dict(advantage_estimator="nope"), "advantage_estimator"),
                          (dict(policy_loss="nope"), "policy_loss"),
                          (dict(ref_update_alpha=0), "ref_update_alpha"), (dict(tis_cap=0), "tis_cap"),
                          (dict(overlong_buffer=6, sampling=SAMPLING), "overlong_buffer")]:
        with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
            GRPOConfig(**kwargs)


def test_presets_hold_the_variants_defaults():
    # (advantage estimator, loss aggregation, clip_high, dynamic sampling, overlong shaping, KL in the reward)
    expected = {
        "grpo": ("grpo", "seq-mean-token-mean", None, False, False, False),
        "dr_grpo": ("dr_grpo", "seq-mean-token-sum-norm", None, False, False, False),
        "dapo": ("grpo", "token-mean", 0.28, True, True, False),
        "rloo": ("rloo", "token-mean", None, False, False, False),
        "reinforce_pp": ("reinforce_pp", "token-mean", None, False, False, True),
        "reinforce_pp_baseline": ("reinforce_pp_baseline", "token-mean", None, False, False, False),
    }
    assert {name: (p.advantage_estimator, p.loss_agg, p.clip_high, p.dynamic_sampling, p.overlong_shaping,
                   p.kl_in_reward) for name, p in PRESETS.items()} == expected
    assert all(isinstance(p, VariantPreset) for p in PRESETS.values())
    for name in PRESETS:
        config = GRPOConfig(algorithm=name)
        assert (config.advantage_estimator, config.loss_agg, config.clip_high, config.dynamic_sampling,
                config.overlong_shaping) == expected[name][:5]


def test_sampling_comes_from_the_learner_argument_and_bounds_the_overlong_buffer():
    explicit = SamplingConfig(max_new_tokens=5, temperature=0.5)
    grpo = GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy(), GRPOConfig(),
                       sampling=explicit)
    assert grpo.sampling is explicit and learner().sampling is SAMPLING
    with pytest.raises(ValueError, match="GRPOConfig.overlong_buffer"):
        GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy(), GRPOConfig(overlong_buffer=5),
                    sampling=explicit)


def test_overlong_penalty_by_hand():
    # max 10, buffer 4: no penalty up to 6 tokens, then -(L - 6) / 4, at most -1.
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    assert overlong_penalty(lengths, 10, 4, 1.0).tolist() == pytest.approx([0, 0, -0.25, -0.5, -1.0, -1.0])


def test_group_advantages_of_each_variant_by_hand():
    # On the learner's device, as `train_step` hands it over.
    batch = collate([exp(1, "a"), exp(0, "a"), exp(0, "a"), exp(1, "b"), exp(1, "b")], 0).to(lane_device())
    scores = batch.scores
    # Group a: mean 1/3, unbiased std sqrt(1/3); group b: all equal.
    grpo = learner().advantages(batch, scores, None)[:, 0]
    std = (1 / 3) ** 0.5
    assert grpo.tolist() == pytest.approx([(2 / 3) / (std + 1e-6), -(1 / 3) / (std + 1e-6),
                                           -(1 / 3) / (std + 1e-6), 0, 0], abs=1e-5)
    dr = learner(algorithm="dr_grpo").advantages(batch, scores, None)[:, 0]
    assert dr.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0, 0], abs=1e-6)
    rloo = learner(algorithm="rloo").advantages(batch, scores, None)[:, 0]
    assert rloo.tolist() == pytest.approx([1.0, -0.5, -0.5, 0, 0], abs=1e-6)  # r - mean of the others
    # Every valid token carries its sequence's advantage.
    assert torch.all(learner(algorithm="rloo").advantages(batch, scores, None)[0] == 1.0)


def test_reinforce_pp_returns_with_kl_in_the_reward_by_hand():
    batch = collate([exp(1, None, length=3), exp(0, None, length=2)], 0).to(lane_device())
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.2, 0.4, 0.0]], device=lane_device())
    # beta 0.5: rewards [-0.05, -0.1, 1 - 0.15] and [-0.1, -0.2]; returns [0.7, 0.75, 0.85] and [-0.3, -0.2].
    adv = learner(algorithm="reinforce_pp", kl_coef=0.5).advantages(batch, batch.scores, kl)
    returns = torch.tensor([0.7, 0.75, 0.85, -0.3, -0.2])
    expected = (returns - returns.mean()) / (returns.var() + 1e-8).sqrt()
    assert adv[batch.response_mask.bool()].tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert adv[1, 2] == 0


def test_dynamic_sampling_drops_uniform_groups_and_draws_again():
    draws = [[exp(1, "a"), exp(1, "a"), exp(0, "b"), exp(1, "b")], [exp(0, "c"), exp(1, "c")],
             [exp(0, "d"), exp(0, "d")]]
    calls = []

    def sample(count):
        calls.append(count)
        return draws[len(calls) - 1]

    batch, stats = learner(algorithm="dapo").make_batch(sample, 4)
    assert calls == [4, 2] and [e.group_id for e in batch] == ["b", "b", "c", "c"]
    assert stats["dynamic_sampling/dropped_fraction"] == pytest.approx(1 / 3)
    assert [len(g) for g in split_groups(batch)] == [2, 2]


def test_fresh_batches_are_on_policy_and_stale_ones_are_importance_weighted():
    grpo = learner(actor_optimizer=OptimizerConfig(lr=1e-3))
    actor = grpo.policy
    torch.manual_seed(0)
    out = HFGenerationBackend.from_actor(actor).generate_text(["q1", "q2"] * 2, SAMPLING)
    experiences = [Experience(p, r, lp, torch.tensor(float(i // 2)), policy_version=3, group_id=str(i % 2))
                   for i, (p, r, lp) in enumerate(zip(out.prompt_ids, out.response_ids, out.log_probs,
                                                      strict=True))]
    fresh = grpo.train_step(experiences, policy_version=3)
    assert fresh["val/ratio"] == pytest.approx(1.0, abs=1e-5) and fresh["policy/importance_weight_avg"] == 1.0
    assert fresh["policy/importance_weight"] == 1.0  # the old name, kept as an alias
    for key in ("loss/policy_avg", "loss/kl_avg", "loss/total_avg", "loss/entropy_avg", "policy/entropy_avg",
                "policy/clipfrac_avg", "policy/approx_kl_avg"):
        assert key in fresh and torch.isfinite(torch.tensor(fresh[key])), key
    assert 0 < fresh["perf/mfu"] < 1 and fresh["time/training"] > 0
    stale = grpo.train_step(experiences, policy_version=5)  # the weights moved since these were generated
    assert stale["staleness/max"] == 2
    assert stale["policy/importance_weight_avg"] != pytest.approx(1.0, abs=1e-7)
    assert stale["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # ratio to the recomputed proximal policy


def test_reference_model_kl_and_polyak_update():
    grpo = learner(kl_coef=0.1, actor_optimizer=OptimizerConfig(lr=1e-2))
    ref = grpo.reference.model
    assert not any(p.requires_grad for p in ref.parameters())
    name, before = next((n, p.detach().clone()) for n, p in ref.named_parameters() if "q_proj" in n)
    with torch.no_grad():
        for p in grpo.policy.model.parameters():
            p.add_(1.0)
    grpo.update_ref_policy(alpha=0.5)
    after = dict(ref.named_parameters())[name]
    policy = dict(grpo.policy.model.named_parameters())[name]
    assert torch.allclose(after, 0.5 * before + 0.5 * policy.detach(), atol=1e-6)
    grpo.update_ref_policy(alpha=1.0)
    assert torch.equal(dict(ref.named_parameters())[name], policy.detach())


def test_grpo_learns_a_verifiable_preference_in_a_few_dozen_steps():
    """2 prompts x 8 responses per step; reward = share of response tokens with id < 100."""
    torch.manual_seed(0)
    config = GRPOConfig(algorithm="grpo", sampling=SAMPLING, actor_optimizer=OptimizerConfig(lr=1e-2),
                        micro_batch_size=16)
    grpo = GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy(), config)
    trainer = TrainerCore("trainer", grpo, TrainerConfig(train_batch_size=16))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    maker = ExperienceMaker(
        "maker", MakerModels(actor=Actor(*tiny_causal_lm("llama", seed=3)), reward=LowTokenReward()),
        CyclingPrompts(arithmetic_prompts()),
        MakerConfig(experience_batch_size=2, group_size=8, sampling=SAMPLING),
        strategy=naive_strategy(),
    )
    maker.apply_weight_update(trainer.weights.register("maker"), store.fetch)
    rewards = []
    for _ in range(30):
        trainer.push_experience(maker.make_experience())
        rewards.append(trainer.train_step()["reward/mean"])
        trainer.weights.publish(store.put, lambda u, makers: {m: maker.apply_weight_update(u, store.fetch)
                                                            for m in makers})
    start, end = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"mean reward {start:.2f} -> {end:.2f}")
    assert end > start + 0.3, f"mean reward {start:.2f} -> {end:.2f}"


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm", "token-mean"])
def test_micro_batches_give_the_full_batch_gradient_in_every_aggregation_mode(agg):
    grads = []
    for micro_batch_size in (8, 3):
        grpo = learner(loss_agg=agg, micro_batch_size=micro_batch_size,
                       actor_optimizer=OptimizerConfig(lr=1e-3))
        recorded = {}
        original = grpo.strategy.optimizer_step

        def record(optimizer, model, max_grad_norm=None, original=original, recorded=recorded):
            recorded.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            return original(optimizer, model, max_grad_norm)

        grpo.strategy.optimizer_step = record
        # Responses of very different lengths: token and sequence weighting then disagree.
        batch = [exp(float(i % 2), str(i // 2), length=1 + 3 * (i % 4), version=0) for i in range(8)]
        torch.manual_seed(0)
        grpo.train_step(batch, policy_version=0)
        grads.append(recorded)
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-4), name


def test_a_batch_that_cuts_a_group_is_refused_with_the_reason():
    draws = [[exp(1, "a"), exp(0, "a"), exp(0, "b")]]
    with pytest.raises(ValueError, match="multiple of the makers' group_size"):
        learner().make_batch(lambda count: draws[0][:count], 3)


TOP_K = SamplingConfig(max_new_tokens=6, top_k=2, temperature=0.7)


def test_the_grpo_trainers_reference_scores_the_full_distribution():
    """A fresh policy and its reference copy agree on every token; under top-k the behaviour log-probs are
    renormalised over the top k, so KL(sampling policy || full reference) is -log(top-k mass) > 0, not 0."""
    learner = GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy(),
                          GRPOConfig(sampling=TOP_K, kl_coef=0.1, kl_kind="k1"))
    torch.manual_seed(0)
    prompts = ["q1", "q1", "q2", "q2"]
    out = HFGenerationBackend.from_actor(learner.policy).generate_text(prompts, TOP_K)
    experiences = [Experience(p, r, lp, torch.tensor(float(i % 2)), group_id=prompts[i]).validate()
                   for i, (p, r, lp) in enumerate(zip(out.prompt_ids, out.response_ids, out.log_probs,
                                                      strict=True))]
    batch = collate(experiences, learner.policy.tokenizer.pad_token_id, device=lane_device())
    with torch.no_grad():
        full = learner.reference(batch.sequences, batch.attention_mask, batch.response_mask,
                                 reference_sampling(TOP_K))
    kl = masked_kl(batch.log_probs, full, batch.response_mask, "k1")
    expected = float((kl * batch.response_mask).sum() / batch.response_mask.sum())
    metrics = learner.train_step(experiences, policy_version=0)
    assert expected > 0.01 and metrics[names.OBJECTIVE_KL] == pytest.approx(expected, rel=1e-4)


def test_the_mini_batch_order_is_the_learners_own_seeded_and_checkpointed():
    """Two runs of one config train bit-identical weights whatever else drew from torch's global generator (a
    thread of the trainer actor, a maker in-process): the order of samples, and so the summation order of
    the gradient, comes from the learner's generator (`seed`), which checkpoints carry."""
    def batch():
        return [exp(float(i % 2), str(i // 2), length=1 + 3 * (i % 4), version=0) for i in range(8)]

    def trained(global_seed, seed=0, steps=2, state=None):
        grpo = learner(micro_batch_size=3, train_epochs=2, seed=seed,
                       actor_optimizer=OptimizerConfig(lr=1e-2))
        if state is not None:
            grpo.load_state_dict(state)
        torch.manual_seed(global_seed)
        for _ in range(steps):
            grpo.train_step(batch(), policy_version=grpo.steps)
            torch.rand(global_seed + 1)  # other draws between steps
        return grpo

    def weights(grpo):
        return {n: p.detach().clone() for n, p in grpo.policy.model.named_parameters() if p.requires_grad}

    first, second = weights(trained(0)), weights(trained(1))
    assert all(torch.equal(first[name], second[name]) for name in first)
    other = weights(trained(0, seed=1))
    assert not all(torch.equal(first[name], other[name]) for name in first)  # the seed orders the samples
    resumed = weights(trained(5, steps=1, state=trained(3, steps=1).state_dict()))
    assert all(torch.equal(first[name], resumed[name]) for name in first)


def test_auto_autocast_is_resolved_for_the_learners_device():
    """`autocast_dtype: auto`: the learner trains in bfloat16 where its device computes it natively, else in
    float32, and its engine name and matmul dtype say which."""
    from detached_rl.core.native_dtypes import native_bfloat16

    grpo = learner(autocast_dtype="auto")
    native = native_bfloat16(grpo.strategy.device)
    assert grpo.autocast_dtype == ("bfloat16" if native else None)
    assert grpo.engine == ("hf:autocast-bfloat16" if native else "hf:float32")
    assert grpo.matmul_dtype() == ("bfloat16" if native else "float32")
