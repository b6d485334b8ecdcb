"""Tests for the pure math of detached_rl.algorithms against values worked out by hand (the
arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from detached_rl.algorithms import (
    ADVANTAGE_METHODS,
    KL_KINDS,
    LOSS_AGG_MODES,
    aggregate_loss,
    broadcast_to_tokens,
    compute_gae,
    group_advantages,
    kl_estimate,
    masked_mean,
    masked_sum,
    masked_whiten,
    policy_loss,
    truncated_importance_weight,
    value_loss,
)

NAN = float("nan")
INF = float("inf")


def t(values, dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def close(actual: torch.Tensor | float, expected, atol: float = 1e-6) -> None:
    actual = torch.as_tensor(actual, dtype=torch.float64)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def test_mode_tuples():
    assert LOSS_AGG_MODES == (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    )
    assert set(ADVANTAGE_METHODS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline"}
    assert {"k1", "abs", "k2", "k3"} <= set(KL_KINDS)


# --------------------------------------------------------------------------- masked_mean / masked_sum


def test_masked_mean_all_and_per_row_with_empty_row():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 0, 1], [0, 0, 0]])
    # all: (1 + 3) / 2 = 2
    close(masked_mean(x, mask), 2.0)
    # per row: row 0 (1 + 3) / 2 = 2; row 1 has no valid token -> 0
    close(masked_mean(x, mask, dim=-1), [2.0, 0.0])
    # per column: col 0 -> 1; col 1 empty -> 0; col 2 -> 3
    close(masked_mean(x, mask, dim=0), [1.0, 0.0, 3.0])
    close(masked_sum(x, mask, dim=-1), [4.0, 0.0])


def test_masked_mean_empty_mask_is_zero():
    x = t([[1.0, NAN]])
    out = masked_mean(x, torch.zeros(1, 2, dtype=torch.bool))
    assert out.item() == 0.0


def test_masked_mean_nan_at_padding_does_not_leak_and_bool_equals_float_mask():
    x = t([[1.0, NAN], [3.0, INF]])
    bool_mask = torch.tensor([[True, False], [True, False]])
    # (1 + 3) / 2 = 2
    close(masked_mean(x, bool_mask), 2.0)
    close(masked_mean(x, bool_mask.double()), 2.0)
    close(masked_mean(x, bool_mask, dim=1), [1.0, 3.0])


def test_masked_mean_shape_mismatch():
    with pytest.raises(ValueError, match=r"masked_mean: mask shape \(2, 2\) != x shape \(2, 3\)"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="masked_sum: mask"):
        masked_sum(torch.zeros(2, 3), torch.ones(3))


# --------------------------------------------------------------------------- masked_whiten


def test_masked_whiten_by_hand():
    x = t([[1.0, 3.0], [5.0, NAN]])
    mask = t([[1, 1], [1, 0]])
    # valid 1, 3, 5: mean 3; unbiased var ((-2)^2 + 0 + 2^2) / (3 - 1) = 4; std 2
    # -> (1-3)/2 = -1, 0, (5-3)/2 = 1; padding -> 0
    close(masked_whiten(x, mask), [[-1.0, 0.0], [1.0, 0.0]])
    # shift_mean=False adds the mean 3 back: 2, 3, 4; padding still 0
    close(masked_whiten(x, mask, shift_mean=False), [[2.0, 3.0], [4.0, 0.0]])


def test_masked_whiten_mean_zero_unbiased_var_one_on_valid_tokens():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64) * 3 + 5
    mask = torch.ones(4, 7, dtype=torch.bool)
    mask[0, 5:] = False
    mask[2, 1:] = False
    x[~mask] = NAN
    w = masked_whiten(x, mask)
    valid = w[mask]
    close(valid.mean(), 0.0, atol=1e-9)
    close(valid.var(unbiased=True), 1.0, atol=1e-6)
    assert torch.all(w[~mask] == 0)


def test_masked_whiten_errors():
    with pytest.raises(ValueError, match="masked_whiten: mask has 1 valid"):
        masked_whiten(t([[1.0, 2.0]]), t([[1, 0]]))
    with pytest.raises(ValueError, match="masked_whiten: mask shape"):
        masked_whiten(t([[1.0, 2.0]]), t([1, 1]))


# --------------------------------------------------------------------------- compute_gae


def test_compute_gae_two_tokens_by_hand():
    # gamma 0.9, lam 0.8; r = [0, 1], v = [0.5, 0.2]
    # t=1: delta = 1 + 0.9*0 - 0.2 = 0.8; gae = 0.8
    # t=0: delta = 0 + 0.9*0.2 - 0.5 = -0.32; gae = -0.32 + 0.9*0.8*0.8 = -0.32 + 0.576 = 0.256
    # returns = adv + v = [0.756, 1.0]
    adv, ret = compute_gae(t([[0.0, 1.0]]), t([[0.5, 0.2]]), t([[1, 1]]), gamma=0.9, lam=0.8)
    close(adv, [[0.256, 0.8]])
    close(ret, [[0.756, 1.0]])


def test_compute_gae_padding_and_hole():
    # Row 0: a hole in the middle (mask 1, 0, 1) and junk (incl. NaN) at the hole: the hole is skipped, so
    #   the result equals the 2-token case above: adv [0.256, 0, 0.8], returns [0.756, 0, 1.0].
    # Row 1: right padding (mask 1, 1, 0) with NaN/inf at the pad; gamma 0.9, lam 0.8; r = [1, 2], v = [1, 1]
    #   t=1: delta = 2 + 0 - 1 = 1; gae = 1
    #   t=0: delta = 1 + 0.9*1 - 1 = 0.9; gae = 0.9 + 0.72*1 = 1.62
    #   returns = [2.62, 2.0, 0]
    rewards = t([[0.0, 5.0, 1.0], [1.0, 2.0, NAN]])
    values = t([[0.5, NAN, 0.2], [1.0, 1.0, INF]])
    mask = torch.tensor([[True, False, True], [True, True, False]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.256, 0.0, 0.8], [1.62, 1.0, 0.0]])
    close(ret, [[0.756, 0.0, 1.0], [2.62, 2.0, 0.0]])


def test_compute_gae_no_grad_and_not_whitened():
    values = t([[0.5, 0.2]]).requires_grad_()
    # gamma = lam = 1: adv_t = sum of future rewards - v_t: [3 - 0.5, 2 - 0.2] = [2.5, 1.8] (not whitened)
    adv, ret = compute_gae(t([[1.0, 2.0]]), values, t([[1, 1]]), gamma=1.0, lam=1.0)
    close(adv, [[2.5, 1.8]])
    close(ret, [[3.0, 2.0]])
    assert not adv.requires_grad and not ret.requires_grad


def test_compute_gae_errors():
    r = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"compute_gae: values shape \(2, 4\) != rewards shape \(2, 3\)"):
        compute_gae(r, torch.zeros(2, 4), torch.ones(2, 3), 0.9, 0.9)
    with pytest.raises(ValueError, match="compute_gae: mask shape"):
        compute_gae(r, r, torch.ones(3, 2), 0.9, 0.9)
    with pytest.raises(ValueError, match="compute_gae: gamma"):
        compute_gae(r, r, torch.ones(2, 3), -0.1, 0.9)
    with pytest.raises(ValueError, match="compute_gae: lam"):
        compute_gae(r, r, torch.ones(2, 3), 0.9, 1.5)
    with pytest.raises(ValueError, match="compute_gae: rewards must be 2-D"):
        compute_gae(torch.zeros(3), torch.zeros(3), torch.ones(3), 0.9, 0.9)


# --------------------------------------------------------------------------- group_advantages


def test_group_advantages_contiguous_groups_by_hand():
    scores = t([1.0, 0.0, 0.0, 2.0, 4.0, 6.0])
    # group A = [1, 0, 0]: mean 1/3; deviations 2/3, -1/3, -1/3; unbiased var (4/9 + 1/9 + 1/9) / 2 = 1/3
    #   std = sqrt(1/3) = 0.5773503; grpo: (2/3)/0.5773503 = 1.1547005, (-1/3)/0.5773503 = -0.5773503
    # group B = [2, 4, 6]: mean 4, unbiased var (4 + 0 + 4) / 2 = 4, std 2 -> grpo -1, 0, 1
    close(
        group_advantages(scores, group_size=3, method="grpo", eps=0.0),
        [1.1547005, -0.5773503, -0.5773503, -1.0, 0.0, 1.0],
    )
    # with eps 1e-6: group B becomes (+-2) / (2 + 1e-6) = +-0.9999995
    close(group_advantages(scores, group_size=3)[3:], [-0.9999995, 0.0, 0.9999995])
    # dr_grpo / reinforce_pp_baseline: r - mean -> 2/3, -1/3, -1/3, -2, 0, 2
    expected_centered = [2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]
    close(group_advantages(scores, group_size=3, method="dr_grpo"), expected_centered)
    close(group_advantages(scores, group_size=3, method="reinforce_pp_baseline"), expected_centered)
    # rloo: r - mean(others): A: 1 - (0+0)/2 = 1, 0 - (1+0)/2 = -0.5 (twice); B: 2 - 5 =
    # -3, 4 - 4 = 0, 6 - 3 = 3
    close(group_advantages(scores, group_size=3, method="rloo"), [1.0, -0.5, -0.5, -3.0, 0.0, 3.0])


def test_group_advantages_grpo_equal_scores_gives_zero():
    # std 0: (1 - 1) / (0 + 1e-6) = 0
    close(group_advantages(t([1.0, 1.0]), group_size=2), [0.0, 0.0])


@pytest.mark.parametrize(
    ("method", "expected"),
    [
        # singleton: mean 0, std 1 -> r / (1 + eps) with eps 1e-6
        ("grpo", [3.0 / (1 + 1e-6), -2.0 / (1 + 1e-6)]),
        ("dr_grpo", [3.0, -2.0]),  # mean 0 -> r
        ("rloo", [3.0, -2.0]),  # no other member -> r unchanged
        ("reinforce_pp_baseline", [3.0, -2.0]),  # mean 0 -> r
    ],
)
def test_group_advantages_singletons(method, expected):
    close(group_advantages(t([3.0, -2.0]), group_size=1, method=method), expected, atol=1e-12)
    close(group_advantages(t([3.0, -2.0]), group_ids=["x", "y"], method=method), expected, atol=1e-12)


def test_group_advantages_non_contiguous_ids_and_int_tensor_ids():
    scores = t([1.0, 2.0, 3.0, 7.0, 6.0])
    ids = ["a", "b", "a", "c", "b"]
    # a = {1, 3}: mean 2, unbiased std sqrt((1 + 1) / 1) = 1.4142136 -> grpo -0.7071068, +0.7071068
    # b = {2, 6}: mean 4, std sqrt((4 + 4) / 1) = 2.8284271 -> -0.7071068, +0.7071068
    # c = {7}: singleton -> 7 / (1 + 0) = 7
    grpo = [-0.7071068, -0.7071068, 0.7071068, 7.0, 0.7071068]
    close(group_advantages(scores, group_ids=ids, eps=0.0), grpo)
    close(group_advantages(scores, group_ids=torch.tensor([5, 2, 5, 9, 2]), eps=0.0), grpo)
    # dr_grpo: a -> -1, +1; b -> -2, +2; c -> 7 - 0 = 7
    close(group_advantages(scores, group_ids=ids, method="dr_grpo"), [-1.0, -2.0, 1.0, 7.0, 2.0])
    # rloo: a -> 1 - 3 = -2, 3 - 1 = 2; b -> 2 - 6 = -4, 6 - 2 = 4; c -> 7
    close(group_advantages(scores, group_ids=ids, method="rloo"), [-2.0, -4.0, 2.0, 7.0, 4.0])


def test_group_advantages_has_no_grad():
    scores = t([1.0, 2.0]).requires_grad_()
    assert not group_advantages(scores, group_size=2).requires_grad


def test_group_advantages_errors():
    s = t([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="group_advantages: give exactly one of group_ids and group_size"):
        group_advantages(s)
    with pytest.raises(ValueError, match="group_advantages: give exactly one of group_ids and group_size"):
        group_advantages(s, group_ids=[0, 0, 1], group_size=3)
    with pytest.raises(
        ValueError, match="group_advantages: number of scores 3 is not divisible by group_size 2"
    ):
        group_advantages(s, group_size=2)
    with pytest.raises(ValueError, match="group_advantages: group_size"):
        group_advantages(s, group_size=0)
    with pytest.raises(ValueError, match="group_advantages: group_ids has length 2"):
        group_advantages(s, group_ids=[0, 1])
    with pytest.raises(ValueError, match="group_advantages: group_ids tensor must have an integer dtype"):
        group_advantages(s, group_ids=torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="group_advantages: unknown method 'foo'; expected one of"):
        group_advantages(s, group_size=3, method="foo")
    with pytest.raises(ValueError, match="group_advantages: eps"):
        group_advantages(s, group_size=3, eps=-1e-6)
    with pytest.raises(ValueError, match="group_advantages: scores must be 1-D"):
        group_advantages(torch.zeros(3, 1), group_size=3)


# --------------------------------------------------------------------------- broadcast_to_tokens


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(t([1.5, -2.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    close(out, [[1.5, 1.5, 0.0], [-2.0, 0.0, 0.0]])
    assert out.dtype == torch.float64


def test_broadcast_to_tokens_errors():
    with pytest.raises(ValueError, match="broadcast_to_tokens: mask shape"):
        broadcast_to_tokens(t([1.0, 2.0]), torch.ones(3, 4))
    with pytest.raises(ValueError, match="broadcast_to_tokens: advantages must be 1-D"):
        broadcast_to_tokens(torch.ones(2, 1), torch.ones(2, 4))


# --------------------------------------------------------------------------- kl_estimate


def test_kl_estimate_all_kinds_by_hand():
    lp, ref = t([-1.0, -2.0]), t([-1.5, 0.0])
    # d = lp - ref = [0.5, -2]
    close(kl_estimate(lp, ref, "k1"), [0.5, -2.0])
    close(kl_estimate(lp, ref, "abs"), [0.5, 2.0])
    # k2 = d^2 / 2 = [0.125, 2]
    close(kl_estimate(lp, ref, "k2"), [0.125, 2.0])
    # k3: u = ref - lp = [-0.5, 2]; exp(-0.5) + 0.5 - 1 = 0.6065307 - 0.5 = 0.1065307;
    # exp(2) - 2 - 1 = 4.3890561
    close(kl_estimate(lp, ref, "k3"), [0.1065307, 4.3890561])
    close(kl_estimate(lp, ref), [0.1065307, 4.3890561])
    close(kl_estimate(lp, ref, "low_var_kl"), [0.1065307, 4.3890561])


def test_kl_estimate_k3_clamping_at_extreme_values():
    lp = t([0.0, -100.0, 0.0, -INF, 0.0])
    ref = t([-3.0, 0.0, -100.0, 0.0, -INF])
    # u = ref - lp:
    #   -3   -> exp(-3) + 3 - 1 = 2.0497871 (no clamp)
    #   100  -> clamped to 20: exp(20) - 21 = 4.85e8 -> clamped to 10
    #   -100 -> clamped to -20: exp(-20) + 19 = 19.000000002 -> clamped to 10
    #   +inf -> clamped to 20 -> 10 (unclamped exp(inf) - inf would be NaN)
    #   -inf -> clamped to -20 -> 10
    out = kl_estimate(lp, ref, "k3")
    close(out, [2.0497871, 10.0, 10.0, 10.0, 10.0])
    assert torch.isfinite(out).all()


def test_kl_estimate_errors():
    with pytest.raises(
        ValueError, match=r"kl_estimate: ref_log_probs shape \(3,\) != log_probs shape \(2,\)"
    ):
        kl_estimate(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="kl_estimate: unknown kind 'k4'; expected one of"):
        kl_estimate(torch.zeros(2), torch.zeros(2), kind="k4")


# --------------------------------------------------------------------------- aggregate_loss


# Rows: 3 valid tokens [1, 2, 3]; 1 valid token [4]; an empty sequence. NaN at every padded position.
AGG_LOSS = [[1.0, 2.0, 3.0], [4.0, NAN, NAN], [NAN, NAN, NAN]]
AGG_MASK = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize(
    ("mode", "max_length", "expected"),
    [
        ("token-mean", None, 2.5),  # (1 + 2 + 3 + 4) / 4
        ("seq-mean-token-sum", None, 5.0),  # sums 6, 4 over the 2 non-empty sequences -> 10 / 2
        ("seq-mean-token-mean", None, 3.0),  # means 2, 4 over the 2 non-empty sequences -> 6 / 2
        ("seq-mean-token-sum-norm", None, 10 / 9),  # (6/3 + 4/3 + 0) / 3 sequences = (10/3) / 3
        ("seq-mean-token-sum-norm", 5, 2 / 3),  # (6/5 + 4/5 + 0) / 3 = 2 / 3
    ],
)
def test_aggregate_loss_modes_by_hand(mode, max_length, expected):
    loss = t(AGG_LOSS)
    close(aggregate_loss(loss, t(AGG_MASK), mode, max_length=max_length), expected)
    close(aggregate_loss(loss, t(AGG_MASK).bool(), mode, max_length=max_length), expected)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_all_empty_is_zero(mode):
    out = aggregate_loss(t([[NAN, 1.0]]), t([[0, 0]]), mode)
    assert out.item() == 0.0


def test_aggregate_loss_errors():
    with pytest.raises(ValueError, match="aggregate_loss: unknown mode 'foo'; expected one of"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), "foo")
    with pytest.raises(ValueError, match=r"aggregate_loss: mask shape \(2, 2\) != loss shape \(2, 3\)"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="aggregate_loss: max_length"):
        aggregate_loss(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm", max_length=0)
    with pytest.raises(ValueError, match="aggregate_loss: loss must be 2-D"):
        aggregate_loss(torch.zeros(3), torch.ones(3))


# --------------------------------------------------------------------------- policy_loss


def _policy_inputs(ratios, advantages, mask=None):
    """old_log_probs = 0 and log_probs = ln(ratio), so ratio = exp(lp - old) exactly as given."""
    lp = torch.log(t([ratios])).requires_grad_()
    old = torch.zeros_like(lp).requires_grad_()
    adv = t([advantages])
    mask = torch.ones_like(lp) if mask is None else t([mask])
    return lp, old, adv, mask


def test_policy_loss_clipping_both_sides_by_hand():
    # clip 0.2 -> ratio clipped to [0.8, 1.2]; per-token loss = max(-A*r, -A*clip(r))
    #   A=+1, r=1.5: max(-1.5, -1.2) = -1.2   (clipped, upper side)
    #   A=-1, r=0.5: max( 0.5,  0.8) =  0.8   (clipped, lower side)
    #   A=+2, r=1.0: max(-2.0, -2.0) = -2.0   (not clipped)
    #   A=-1, r=1.5: max( 1.5,  1.2) =  1.5   (not clipped: pessimistic side)
    #   padding (NaN)
    # token-mean: (-1.2 + 0.8 - 2.0 + 1.5) / 4 = -0.9 / 4 = -0.225
    # clipfrac 2/4 = 0.5; ratio_mean (1.5 + 0.5 + 1 + 1.5) / 4 = 1.125
    # approx_kl = mean(old - lp) = -(ln1.5 + ln0.5 + 0 + ln1.5) / 4 = -(0.8109302 -
    # 0.6931472) / 4 = -0.0294457
    lp, old, adv, mask = _policy_inputs(
        [1.5, 0.5, 1.0, 1.5, 1.0], [1.0, -1.0, 2.0, -1.0, 0.0], [1, 1, 1, 1, 0]
    )
    lp_in = torch.where(mask.bool(), lp, torch.full_like(lp, NAN))
    loss, stats = policy_loss(lp_in, old, adv, mask, clip_low=0.2)
    close(loss, -0.225)
    close(stats["clipfrac"], 0.5)
    close(stats["ratio_mean"], 1.125)
    close(stats["approx_kl"], -0.0294457)
    assert "dual_clipfrac" not in stats
    for v in stats.values():
        assert v.dim() == 0 and not v.requires_grad


def test_policy_loss_gradient_only_through_log_probs():
    # Same tokens as above, with NaN in log_probs at the padded position.
    # d loss / d lp_i = (-A_i * r_i) / 4 for unclipped tokens (d r / d lp = r), 0 for clipped ones:
    #   token 0, 1 clipped -> 0; token 2: -2 * 1 / 4 = -0.5; token 3: 1 * 1.5 / 4 = 0.375; padding -> 0
    lp, old, adv, mask = _policy_inputs(
        [1.5, 0.5, 1.0, 1.5, 1.0], [1.0, -1.0, 2.0, -1.0, 0.0], [1, 1, 1, 1, 0]
    )
    adv.requires_grad_()
    lp_leaf = lp.detach().clone()
    lp_leaf[0, 4] = NAN
    lp_leaf.requires_grad_()
    loss, _ = policy_loss(lp_leaf, old, adv, mask)
    loss.backward()
    assert lp_leaf.grad is not None
    close(lp_leaf.grad, [[0.0, 0.0, -0.5, 0.375, 0.0]])
    assert old.grad is None
    assert adv.grad is None


def test_policy_loss_clip_higher():
    # clip_low 0.2, clip_high 0.28 -> ratio clipped to [0.8, 1.28]
    #   A=+1, r=1.5:  max(-1.5, -1.28) = -1.28  (clipped at 1.28, not 1.2)
    #   A=+1, r=1.25: max(-1.25, -1.25) = -1.25 (inside [0.8, 1.28]: not clipped; symmetric 0.2 would give
    #   -1.2) A=-1, r=0.5:  max(0.5, 0.8) = 0.8       (lower side unchanged)
    # token-mean: (-1.28 - 1.25 + 0.8) / 3 = -1.73 / 3 = -0.5766667; clipfrac 2/3
    lp, old, adv, mask = _policy_inputs([1.5, 1.25, 0.5], [1.0, 1.0, -1.0])
    loss, stats = policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    close(loss, -0.5766667)
    close(stats["clipfrac"], 2 / 3)
    # symmetric 0.2: (-1.2 - 1.2 + 0.8) / 3 = -0.5333333; clipfrac 3/3
    loss_sym, stats_sym = policy_loss(lp, old, adv, mask, clip_low=0.2)
    close(loss_sym, -0.5333333)
    close(stats_sym["clipfrac"], 1.0)


def test_policy_loss_dual_clip_negative_advantage():
    # dual_clip c = 3, clip 0.2:
    #   A=-1, r=5: max(5, 1.2) = 5 -> A<0: min(5, -A*c = 3) = 3   (dual-clipped)
    #   A=+1, r=5: max(-5, -1.2) = -1.2 (A>0: dual clip does not apply; clipped)
    #   A=-1, r=2: max(2, 1.2) = 2 -> min(2, 3) = 2              (not dual-clipped)
    # token-mean: (3 - 1.2 + 2) / 3 = 3.8 / 3 = 1.2666667; dual_clipfrac 1/3; clipfrac 1/3 (only token 1)
    lp, old, adv, mask = _policy_inputs([5.0, 5.0, 2.0], [-1.0, 1.0, -1.0])
    loss, stats = policy_loss(lp, old, adv, mask, dual_clip=3.0)
    close(loss, 1.2666667)
    close(stats["dual_clipfrac"], 1 / 3)
    close(stats["clipfrac"], 1 / 3)
    # without dual clip: (5 - 1.2 + 2) / 3 = 1.9333333
    close(policy_loss(lp, old, adv, mask)[0], 1.9333333)
    # the dual-clipped token has zero gradient: loss is the constant 3 there
    loss.backward()
    close(lp.grad, [[0.0, 0.0, 2.0 / 3]])  # token 2: -A*r/3 = 2/3; token 1 clipped -> 0


def test_policy_loss_aggregation_mode_is_passed_through():
    # A=+1, r=1 everywhere -> per-token loss -1; rows: 2 valid tokens, 1 valid token
    # seq-mean-token-sum: sums -2, -1 -> mean -1.5
    lp = torch.zeros(2, 2, dtype=torch.float64)
    loss, _ = policy_loss(lp, lp, torch.ones_like(lp), t([[1, 1], [1, 0]]), agg="seq-mean-token-sum")
    close(loss, -1.5)


def test_policy_loss_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(
        ValueError, match=r"policy_loss: advantages shape \(2, 4\) != log_probs shape \(2, 3\)"
    ):
        policy_loss(z, z, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="policy_loss: old_log_probs shape"):
        policy_loss(z, torch.zeros(3, 2), z, torch.ones(2, 3))
    with pytest.raises(ValueError, match="policy_loss: mask shape"):
        policy_loss(z, z, z, torch.ones(2, 2))
    with pytest.raises(ValueError, match="policy_loss: clip_low"):
        policy_loss(z, z, z, torch.ones(2, 3), clip_low=-0.1)
    with pytest.raises(ValueError, match="policy_loss: clip_high"):
        policy_loss(z, z, z, torch.ones(2, 3), clip_high=-0.1)
    with pytest.raises(ValueError, match="policy_loss: dual_clip must be > 1"):
        policy_loss(z, z, z, torch.ones(2, 3), dual_clip=1.0)
    with pytest.raises(ValueError, match="policy_loss: unknown agg 'sum'"):
        policy_loss(z, z, z, torch.ones(2, 3), agg="sum")


# --------------------------------------------------------------------------- value_loss


def test_value_loss_with_and_without_clip_by_hand():
    values = t([[1.0, 0.0, 2.0, NAN]]).requires_grad_()
    old = t([[0.5, 0.5, 2.0, NAN]])
    returns = t([[2.0, 1.0, 0.0, NAN]])
    mask = t([[1, 1, 1, 0]])
    # clip 0.2:
    #   tok0: (1-2)^2 = 1; clip(1, 0.3, 0.7) = 0.7 -> (0.7-2)^2 = 1.69 -> 1.69 (clipped term larger)
    #   tok1: (0-1)^2 = 1; clip(0, 0.3, 0.7) = 0.3 -> (0.3-1)^2 = 0.49 -> 1
    #   tok2: (2-0)^2 = 4; clip(2, 1.8, 2.2) = 2 -> 4 -> 4 (equal: not counted as clipped)
    # 0.5 * (1.69 + 1 + 4) / 3 = 0.5 * 2.23 = 1.115; vf_clipfrac 1/3; values_mean (1 + 0 + 2) / 3 = 1
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    close(loss, 1.115)
    close(stats["vf_clipfrac"], 1 / 3)
    close(stats["values_mean"], 1.0)
    # gradient: token 0 takes the clipped branch (constant in v) -> 0; token 1: 0.5 * 2 * (0 - 1) / 3 = -1/3;
    # token 2: both terms equal and both are (v - R)^2 (v lies inside [1.8, 2.2]), so whichever share of the
    # gradient torch.maximum gives each, the sum is 0.5 * 2 * (2 - 0) / 3 = 2/3; padding 0
    loss.backward()
    close(values.grad, [[0.0, -1 / 3, 2 / 3, 0.0]])
    # no clip: 0.5 * (1 + 1 + 4) / 3 = 1.0; vf_clipfrac 0
    loss_nc, stats_nc = value_loss(values, old, returns, mask)
    close(loss_nc, 1.0)
    close(stats_nc["vf_clipfrac"], 0.0)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_value_loss_gradient_only_through_values():
    values = t([[1.0, 2.0]]).requires_grad_()
    old = t([[1.0, 2.0]]).requires_grad_()
    returns = t([[0.0, 0.0]]).requires_grad_()
    # 0.5 * (1 + 4) / 2 = 1.25; d/dv = (v - R) / 2 = [0.5, 1.0]
    loss, _ = value_loss(values, old, returns, torch.ones(1, 2), agg="token-mean")
    close(loss, 1.25)
    loss.backward()
    close(values.grad, [[0.5, 1.0]])
    assert old.grad is None and returns.grad is None


def test_value_loss_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"value_loss: returns shape \(2, 4\) != values shape \(2, 3\)"):
        value_loss(z, z, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="value_loss: old_values shape"):
        value_loss(z, torch.zeros(3), z, torch.ones(2, 3))
    with pytest.raises(ValueError, match="value_loss: clip must be >= 0"):
        value_loss(z, z, z, torch.ones(2, 3), clip=-0.5)
    with pytest.raises(ValueError, match="value_loss: unknown agg 'x'"):
        value_loss(z, z, z, torch.ones(2, 3), agg="x")


# --------------------------------------------------------------------------- truncated_importance_weight


def test_truncated_importance_weight_caps_and_masks():
    behaviour = t([[0.0, 0.0, 0.0, 0.0, 0.0]])
    log_probs = t([[math.log(0.5), 0.0, math.log(3.0), math.log(2.0), NAN]]).requires_grad_()
    # w = min(pi/mu, 2): [0.5, 1, min(3, 2) = 2, 2 (at the cap), masked -> 0]
    w = truncated_importance_weight(behaviour, log_probs, cap=2.0, mask=t([[1, 1, 1, 1, 0]]))
    close(w, [[0.5, 1.0, 2.0, 2.0, 0.0]])
    assert not w.requires_grad
    # no mask, cap 1.5: [0.5, 1, 1.5, 1.5]; a huge log-ratio (1000) is clamped to 20
    # before exp -> capped, finite
    w2 = truncated_importance_weight(
        t([0.0, 0.0, 0.0, 0.0, -1000.0]), t([math.log(0.5), 0.0, 1.0, 2.0, 0.0]), cap=1.5
    )
    close(w2, [0.5, 1.0, 1.5, 1.5, 1.5])


def test_truncated_importance_weight_errors():
    with pytest.raises(ValueError, match="truncated_importance_weight: cap must be > 0"):
        truncated_importance_weight(torch.zeros(2), torch.zeros(2), cap=0.0)
    with pytest.raises(
        ValueError,
        match=r"truncated_importance_weight: log_probs shape \(3,\) != behaviour_log_probs shape \(2,\)",
    ):
        truncated_importance_weight(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="truncated_importance_weight: mask shape"):
        truncated_importance_weight(torch.zeros(2), torch.zeros(2), mask=torch.ones(3))


def test_policy_loss_weights_scale_each_token_before_aggregation():
    lp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0]])
    adv = torch.tensor([[1.0, 2.0]])
    mask = torch.ones(1, 2)
    # ratio 1: per-token loss -A = [-1, -2]; weighted by [0.5, 2] -> [-0.5, -4]; token-mean -2.25.
    loss, _ = policy_loss(lp, old, adv, mask, weights=torch.tensor([[0.5, 2.0]]))
    assert loss.item() == pytest.approx(-2.25)
    # seq-mean-token-sum-norm with max_length 4: (-1 - 2) / 4 = -0.75.
    loss, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm", max_length=4)
    assert loss.item() == pytest.approx(-0.75)
    with pytest.raises(ValueError, match="weights"):
        policy_loss(lp, old, adv, mask, weights=torch.ones(1, 3))
