"""Train/inference mismatch: engine tags, when the trainers correct, the mismatch
metrics, non-finite log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from detached_rl import Experience, collate
from detached_rl.algorithms import metrics as names
from detached_rl.algorithms import truncated_importance_weight
from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.algorithms.masks import masked_mean
from detached_rl.algorithms.mismatch import (
    UNKNOWN_ENGINE,
    apply_behaviour_correction,
    backend_engine,
    engine_name,
    experience_engine,
    finite_token_mask,
    masked_kl,
    mismatch_metrics,
    needs_behaviour_correction,
    trainer_engine,
)
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.generation import HFGenerationBackend
from detached_rl.models import Actor, Critic, SamplingConfig, tiny_causal_lm
from detached_rl.models.scalar_heads import backbone_of
from detached_rl.strategies import NaiveStrategy
from detached_rl.strategies.optim import OptimizerConfig

from .helpers import lane_device, model_device, naive_strategy

INF = float("inf")
NAN = float("nan")
SAMPLING = SamplingConfig(max_new_tokens=6)
# a sampled token outside the trainer's top 2 recomputes to -inf
TOP_K = SamplingConfig(max_new_tokens=6, top_k=2)
VLLM = "vllm:bfloat16"
MISMATCH_KEYS = (names.MISMATCH_KL, names.MISMATCH_MAX_ABS_DIFF, names.MISMATCH_MEAN_ABS_DIFF,
                 names.MISMATCH_TIS_CLIPPED, names.MISMATCH_MASKED_TOKENS)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --------------------------------------------------------------------------- engines and the decision


def test_engine_names_and_tags():
    assert engine_name("hf", torch.float32) == "hf:float32" and engine_name("vllm", "bfloat16") == VLLM
    assert experience_engine({"engine": VLLM}) == VLLM
    assert experience_engine({}) == UNKNOWN_ENGINE == "hf:<unknown>"  # made before the tag existed
    model, _ = tiny_causal_lm("llama", seed=0)
    assert trainer_engine(model) == "hf:float32"
    assert trainer_engine(model, "bfloat16") == "hf:autocast-bfloat16"  # no maker reproduces autocast
    assert trainer_engine(model.to(torch.bfloat16)) == "hf:bfloat16"
    assert backend_engine(object(), "custom") == "custom:<unknown>"


def test_hf_backend_names_the_dtype_it_generates_in():
    actor = Actor(*tiny_causal_lm("llama", seed=0))
    assert HFGenerationBackend.from_actor(actor).engine == "hf:float32"
    cast = HFGenerationBackend.from_actor(Actor(*tiny_causal_lm("llama", seed=0)), dtype="bfloat16")
    assert cast.engine == "hf:bfloat16" and backend_engine(cast, "hf") == "hf:bfloat16"


@pytest.mark.parametrize(
    ("staleness", "multi_pass", "engines", "own", "expected"),
    [
        ([0, 0], False, [UNKNOWN_ENGINE, UNKNOWN_ENGINE], "hf:float32", False),  # untagged counts as exact
        ([0, 0], False, ["hf:float32", UNKNOWN_ENGINE], "hf:float32", False),
        (None, False, ["hf:float32"], "hf:float32", False),  # versions unknown: taken as fresh
        ([0, 1], False, ["hf:float32", "hf:float32"], "hf:float32", True),  # stale
        ([0, 0], True, ["hf:float32", "hf:float32"], "hf:float32", True),  # several passes
        ([0, 0], False, ["hf:float32", VLLM], "hf:float32", True),  # another engine
        ([0], False, ["hf:float32"], "hf:bfloat16", True),  # the same backend in another dtype
        ([0], False, ["hf:bfloat16"], "hf:autocast-bfloat16", True),
    ],
)
def test_needs_behaviour_correction(staleness, multi_pass, engines, own, expected):
    assert needs_behaviour_correction(staleness, multi_pass, iter(engines), own) is expected


# --------------------------------------------------------------------------- the metrics, by hand

# Row 0: 4 valid tokens, the last with a -inf behaviour log-prob. Row 1: 2 valid tokens, the first with a -inf
# recompute; its padding holds NaN, which must not leak.
BEHAVIOUR = [[-1.0, -2.0, -0.5, -INF], [-0.2, -3.0, 0.0, NAN]]
RECOMPUTED = [[-1.0, -1.0, -1.0, -0.3], [-INF, -3.5, NAN, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0]]


def test_mismatch_metrics_by_hand():
    # Valid: (0,0) (0,1) (0,2) (1,1); d = recomputed - behaviour = [0, 1, -0.5, -0.5].
    # k3 = e^d - d - 1 = [0, e - 2, e^-0.5 - 0.5, e^-0.5 - 0.5]; |d| = [0, 1, 0.5,
    # 0.5]; e^d > 2 only for d = 1.
    k3 = (math.e - 2 + 2 * (math.exp(-0.5) - 0.5)) / 4
    out = mismatch_metrics(t(BEHAVIOUR), t(RECOMPUTED), t(MASK), tis_cap=2.0)
    assert set(out) == set(MISMATCH_KEYS) and all(v.dim() == 0 and not v.requires_grad for v in out.values())
    values = {k: float(v) for k, v in out.items()}
    assert values == pytest.approx({names.MISMATCH_KL: k3, names.MISMATCH_MEAN_ABS_DIFF: 0.5,
                                    names.MISMATCH_MAX_ABS_DIFF: 1.0, names.MISMATCH_TIS_CLIPPED: 0.25,
                                    names.MISMATCH_MASKED_TOKENS: 2.0}, abs=1e-6)
    assert float(mismatch_metrics(t(BEHAVIOUR), t(RECOMPUTED), t(MASK),
                                  tis_cap=3.0)[names.MISMATCH_TIS_CLIPPED]) == 0
    assert float(mismatch_metrics(t(BEHAVIOUR), t(RECOMPUTED), t(MASK))[names.MISMATCH_TIS_CLIPPED]) == 0
    # The same log-probs: no mismatch at all; nothing valid: zeros, not NaN.
    same = mismatch_metrics(t([[-1.0, -2.0]]), t([[-1.0, -2.0]]), torch.ones(1, 2, dtype=torch.bool), 2.0)
    assert all(float(v) == 0.0 for v in same.values())
    empty = mismatch_metrics(t([[-INF]]), t([[-1.0]]), t([[1]]), 2.0)
    assert float(empty[names.MISMATCH_MASKED_TOKENS]) == 1 and all(
        float(v) == 0.0 for k, v in empty.items() if k != names.MISMATCH_MASKED_TOKENS)


def test_mismatch_metrics_errors():
    with pytest.raises(ValueError, match="mismatch_metrics: recomputed_log_probs shape"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mismatch_metrics: mask shape"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="mismatch_metrics: tis_cap must be > 0"):
        mismatch_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), tis_cap=0.0)


def test_mismatch_names_are_in_the_vocabulary():
    assert all(key in names.METRICS for key in (*MISMATCH_KEYS, names.POLICY_NONFINITE_FRACTION))


def test_non_finite_tokens_get_weight_zero_and_stay_out_of_kl():
    w = truncated_importance_weight(t(BEHAVIOUR), t(RECOMPUTED), cap=2.0, mask=t(MASK))
    half = math.exp(-0.5)
    torch.testing.assert_close(w, t([[1.0, 2.0, half, 0.0], [0.0, half, 0.0, 0.0]]))
    # Without a mask too: -inf on either side (and -inf on both, which would be NaN) gives 0.
    w2 = truncated_importance_weight(t([-INF, -1.0, -INF, NAN]), t([-1.0, -INF, -INF, -1.0]), cap=2.0)
    torch.testing.assert_close(w2, t([0.0, 0.0, 0.0, 0.0]))
    assert torch.equal(finite_token_mask(t(MASK), t(BEHAVIOUR), None, t(RECOMPUTED)),
                       torch.tensor([[True, True, True, False], [False, True, False, False]]))
    for kind in ("k1", "k3"):  # k1 of -inf would be inf, k3 of -inf on both sides NaN
        kl = masked_kl(t([[-1.0, -INF, -INF]]), t([[-2.0, -1.0, -INF]]), t([[1, 1, 1]]), kind)
        assert torch.isfinite(kl).all() and kl[0, 1:].eq(0).all() and kl[0, 0] != 0


def test_apply_behaviour_correction_sets_old_log_probs_and_weights():
    batch = collate([Experience(torch.tensor([5, 6]), torch.arange(10, 14), t(BEHAVIOUR[0]).clamp(min=-50),
                                torch.tensor(1.0))])
    batch.log_probs = t([BEHAVIOUR[0]])  # the -inf a validated experience could not carry
    assert apply_behaviour_correction(batch, None, 2.0) == {}
    assert batch.old_log_probs is batch.log_probs and torch.equal(batch.loss_weights,
                                                                  t([[1.0, 1.0, 1.0, 0.0]]))
    metrics = apply_behaviour_correction(batch, t([RECOMPUTED[0]]), 2.0)
    assert batch.old_log_probs.equal(t([RECOMPUTED[0]])) and float(metrics[names.MISMATCH_MASKED_TOKENS]) == 1
    torch.testing.assert_close(batch.loss_weights, t([[1.0, 2.0, math.exp(-0.5), 0.0]]))
    apply_behaviour_correction(batch, t([RECOMPUTED[0]]), None)  # TIS off: weight 1, non-finite still 0
    assert torch.equal(batch.loss_weights, t([[1.0, 1.0, 1.0, 0.0]]))


# --------------------------------------------------------------------------- trainer steps


class OtherRankNeedsIt(NaiveStrategy):
    """A strategy whose other (pretend) rank always disagrees: `all_true` is False."""

    def all_true(self, flag):
        return False


def grpo_learner(sampling=SAMPLING, strategy=None, **config) -> GRPOLearner:
    config.setdefault("actor_optimizer", OptimizerConfig(lr=1e-3))
    return GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), strategy or naive_strategy(),
                       GRPOConfig(sampling=sampling, **config))


def generated(actor: Actor, prompts: list[str], sampling: SamplingConfig, engine: str | None = None,
              shift: tuple[float, float] = (0.0, 0.0)) -> list[Experience]:
    """Experiences generated by `actor`, grouped by prompt, tagged with `engine`, their behaviour log-probs
    lowered by `shift[0]` at even and `shift[1]` at odd positions (what another
    engine might have computed)."""
    torch.manual_seed(0)
    out = HFGenerationBackend.from_actor(actor).generate_text(prompts, sampling)
    experiences = []
    for i, (p, r, lp) in enumerate(zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True)):
        lowered = lp - torch.where(torch.arange(len(lp)) % 2 == 0, shift[0], shift[1])
        info = {} if engine is None else {"engine": engine}
        reward = torch.tensor(float((r < 100).float().mean()) + i % 3)  # different within each group
        experiences.append(Experience(p, r, lowered, reward, group_id=prompts[i], info=info).validate())
    return experiences


def recorded_grads(learner, module) -> list[dict[str, torch.Tensor]]:
    """Gradients of `module` seen at each optimizer step of `learner` (recorded from now on)."""
    grads: list[dict[str, torch.Tensor]] = []
    original = learner.strategy.optimizer_step

    def record(optimizer, model, max_grad_norm=None):
        if learner.strategy.unwrap(model) is module:
            grads.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        return original(optimizer, model, max_grad_norm)

    learner.strategy.optimizer_step = record
    return grads


def expected_weights(learner, experiences, sampling, cap=2.0) -> tuple[float, dict[str, float]]:
    """(mean truncated importance weight, mismatch metrics) computed here from the learner's own recompute."""
    batch = collate(experiences, learner.strategy.unwrap(learner.actor).tokenizer.pad_token_id,
                    device=lane_device())
    with torch.no_grad():
        recomputed = learner.actor(batch.sequences, batch.attention_mask, batch.response_mask, sampling)
    weights = truncated_importance_weight(batch.log_probs, recomputed, cap, batch.response_mask)
    metrics = mismatch_metrics(batch.log_probs, recomputed, batch.response_mask, cap)
    return float(masked_mean(weights, batch.response_mask)), {k: float(v) for k, v in metrics.items()}


def test_grpo_corrects_fresh_samples_from_another_engine():
    prompts = ["q1", "q2"] * 2
    fresh = grpo_learner()
    untagged = fresh.train_step(generated(fresh.policy, prompts, SAMPLING), policy_version=0)
    assert not any(key in untagged
                   for key in MISMATCH_KEYS) and untagged["policy/importance_weight_avg"] == 1.0

    grpo = grpo_learner()
    experiences = generated(grpo.policy, prompts, SAMPLING, engine=VLLM, shift=(1.0, 0.1))
    weight, mismatch = expected_weights(grpo, experiences, SAMPLING)
    metrics = grpo.train_step(experiences, policy_version=0)
    for key in MISMATCH_KEYS:
        assert metrics[key] == pytest.approx(mismatch[key], abs=1e-5), key
    assert metrics[names.MISMATCH_MAX_ABS_DIFF] == pytest.approx(1.0, abs=1e-3)
    assert metrics[names.MISMATCH_TIS_CLIPPED] > 0.3 and metrics[names.MISMATCH_MASKED_TOKENS] == 0
    # TIS applied: weights e^1 capped at 2 and e^0.1; the ratio is to the recomputed proximal policy.
    assert metrics["policy/importance_weight_avg"] == pytest.approx(weight, rel=1e-5) and weight > 1.2
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert all(math.isfinite(metrics[k]) for k in ("loss/policy_avg", "loss/total_avg", "grad_norm/actor"))

    off = grpo_learner(proximal_recompute=False)  # ratios against the behaviour policy, no metrics
    plain = off.train_step(generated(off.policy, prompts, SAMPLING, engine=VLLM, shift=(1.0, 0.1)),
                           policy_version=0)
    assert not any(key in plain for key in MISMATCH_KEYS) and plain["policy/importance_weight_avg"] == 1.0
    # Ranks decide together: when another rank needs the recompute, this one
    # recomputes too (same metric keys).
    together = grpo_learner(strategy=OtherRankNeedsIt(device=lane_device()))
    both = together.train_step(generated(together.policy, prompts, SAMPLING), policy_version=0)
    assert all(key in both for key in MISMATCH_KEYS) and both[names.MISMATCH_MAX_ABS_DIFF] < 1e-4


def with_non_finite_tokens(actor: Actor, experiences: list[Experience], sampling: SamplingConfig) -> None:
    """Give experience 0 a last token the trainer's top-k filters out (its recompute is -inf; the engine kept
    it), and experience 1 a -inf behaviour log-prob at its first token."""
    first = experiences[0]
    sequence = torch.cat([first.prompt_ids, first.response_ids[:-1]])[None].to(model_device(actor.model))
    with torch.no_grad():
        logits = actor.model(sequence).logits[0, -1]
    first.response_ids[-1] = int(logits.argmin())  # far outside the top 2
    first.log_probs[-1] = math.log(0.3)
    experiences[1].log_probs[0] = -INF


@pytest.mark.parametrize("algorithm", ["grpo", "reinforce_pp"])
def test_grpo_step_masks_non_finite_log_probs(algorithm):
    # k1 KL, in the loss (grpo) or in the rewards (reinforce_pp): -inf there would be inf or NaN.
    grpo = grpo_learner(sampling=TOP_K, algorithm=algorithm, kl_coef=0.1, kl_kind="k1")
    experiences = generated(grpo.policy, ["q1", "q2"] * 2, TOP_K, engine=VLLM)
    with_non_finite_tokens(grpo.policy, experiences, TOP_K)
    grads = recorded_grads(grpo, grpo.policy)
    metrics = grpo.train_step(experiences, policy_version=0)
    assert metrics[names.MISMATCH_MASKED_TOKENS] == 2
    tokens = sum(e.response_length for e in experiences)
    assert metrics[names.POLICY_NONFINITE_FRACTION] == pytest.approx(2 / tokens, rel=1e-5)
    assert all(math.isfinite(v)
               for v in metrics.values()), {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert grads and all(torch.isfinite(g).all() for g in grads[0].values())
    assert any(g.abs().sum() > 0 for g in grads[0].values())  # the other tokens still train
    assert all(torch.isfinite(p).all() for p in grpo.policy.model.parameters())


def ppo_learner(sampling=SAMPLING, **config) -> PPOLearner:
    policy, tokenizer = tiny_causal_lm("llama", seed=0)
    torch.manual_seed(0)
    critic = Critic(backbone_of(tiny_causal_lm("llama", seed=100)[0]))
    return PPOLearner(Actor(policy, tokenizer), critic, naive_strategy(),
                      PPOConfig(sampling=sampling, actor_optimizer=OptimizerConfig(lr=1e-3), **config))


def valued(learner: PPOLearner, experiences: list[Experience],
           reference: Actor | None = None) -> list[Experience]:
    """The experiences with the learner's critic's values (and `reference`'s log-probs),
    as a PPO maker sends them."""
    batch = collate(experiences, 0, device=lane_device())
    args = (batch.sequences, batch.attention_mask, batch.response_mask)
    with torch.no_grad():
        values = learner.critic(*args).cpu()
        ref = reference(*args, learner.sampling).cpu() if reference is not None else None
    for row, e in enumerate(experiences):
        e.group_id = None
        e.values = values[row, : e.response_length].clone()
        e.ref_log_probs = ref[row, : e.response_length].clone() if ref is not None else None
    return experiences


def test_ppo_corrects_fresh_samples_from_another_engine():
    prompts = [f"q{i}" for i in range(6)]
    plain = ppo_learner()
    fresh = plain.train_step(valued(plain, generated(plain.actor, prompts, SAMPLING)), policy_version=0)
    assert not any(key in fresh for key in MISMATCH_KEYS) and fresh["policy/importance_weight_avg"] == 1.0
    assert fresh["val/ratio"] == pytest.approx(1.0, abs=1e-5)

    ppo = ppo_learner()
    experiences = valued(ppo, generated(ppo.actor, prompts, SAMPLING, engine=VLLM, shift=(1.0, 0.1)))
    weight, mismatch = expected_weights(ppo, experiences, SAMPLING)
    metrics = ppo.train_step(experiences, policy_version=0)
    for key in MISMATCH_KEYS:
        assert metrics[key] == pytest.approx(mismatch[key], abs=1e-5), key
    assert metrics[names.MISMATCH_TIS_CLIPPED] > 0.3 and metrics[names.MISMATCH_MASKED_TOKENS] == 0
    assert metrics["policy/importance_weight_avg"] == pytest.approx(weight, rel=1e-5) and weight > 1.2
    # to the proximal policy, not the behaviour one
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert all(math.isfinite(metrics[k]) for k in ("loss/policy_avg", "loss/total_avg", "loss/value_avg"))
    # Several passes over a batch from the trainer's own engine are corrected too (PPO did not before).
    multi = ppo_learner(mini_batch_size=3)
    passes = multi.train_step(valued(multi, generated(multi.actor, prompts, SAMPLING)), policy_version=0)
    assert passes[names.MISMATCH_MAX_ABS_DIFF] < 1e-4 and passes[names.MISMATCH_TIS_CLIPPED] == 0
    with pytest.raises(ValueError, match="PPOConfig.tis_cap"):
        PPOConfig(tis_cap=0)


def test_ppo_step_masks_non_finite_log_probs():
    ppo = ppo_learner(sampling=TOP_K, kl_coef=0.1, kl_kind="k1", kl_mode="loss")
    reference = Actor(*tiny_causal_lm("llama", seed=0)).to(lane_device())  # filters the same token out
    experiences = generated(ppo.actor, [f"q{i}" for i in range(4)], TOP_K, engine=VLLM)
    with_non_finite_tokens(ppo.strategy.unwrap(ppo.actor), experiences, TOP_K)
    experiences = valued(ppo, experiences, reference)
    assert not torch.isfinite(experiences[0].ref_log_probs[-1])
    grads = recorded_grads(ppo, ppo.strategy.unwrap(ppo.actor))
    metrics = ppo.train_step(experiences, policy_version=0)
    assert metrics[names.MISMATCH_MASKED_TOKENS] == 2 and metrics[names.POLICY_NONFINITE_FRACTION] > 0
    assert all(math.isfinite(v)
               for v in metrics.values()), {k: v for k, v in metrics.items() if not math.isfinite(v)}
    assert grads and all(torch.isfinite(g).all() for g in grads[0].values())
    assert all(torch.isfinite(p).all() for p in ppo.strategy.unwrap(ppo.actor).parameters())
