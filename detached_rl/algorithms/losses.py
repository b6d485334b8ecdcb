"""Losses: the policy losses (registered by name), the critic's clipped value loss, truncated importance
weights.

A policy loss is one function registered by name (``detached_rl.algorithms.registry``) and has one
signature:
``loss(log_probs, old_log_probs, advantages, mask, settings: PolicyLossSettings, weights=None)
-> (scalar loss, stats)``, stats being detached 0-d tensors that include ``clipfrac``,
``ratio_mean`` and ``approx_kl``. A learner picks one by its config string through
``get_policy_loss``.

Conventions (see ``_common``): token-level inputs are [B, T] with a [B, T] ``mask``; advantages are
already per token; gradient flows only through ``log_probs`` / ``values``; the per-token loss is
reduced by ``aggregate_loss`` in the ``agg`` mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from detached_rl.algorithms._common import LOG_RATIO_CLAMP, bool_mask, check_choice, check_shape
from detached_rl.algorithms.aggregation import aggregate_loss
from detached_rl.algorithms.masks import masked_mean

# The names and the registry live in `registry` (torch-free, for the configs); importable from here too.
from detached_rl.algorithms.registry import LOSS_AGG_MODES
from detached_rl.algorithms.registry import POLICY_LOSSES as POLICY_LOSSES
from detached_rl.algorithms.registry import get_policy_loss as get_policy_loss
from detached_rl.algorithms.registry import register_policy_loss as register_policy_loss


@dataclass(frozen=True)
class PolicyLossSettings:
    """The policy losses' hyper-parameters (each reads those it uses)."""

    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float | None = None  # None: clip_low ("clip-higher" when larger)
    dual_clip: float | None = None  # c > 1: tokens with negative advantage lose at most -A * c
    agg: str = "token-mean"  # one of LOSS_AGG_MODES
    max_length: int | None = None  # the "seq-mean-token-sum-norm" constant (None: the padded length)


PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    weights: torch.Tensor | None = None,
    max_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate loss (with optional clip-higher and dual clip) and its statistics.

    `weights` [B, T] (detached) multiply the per-token loss before aggregation, e.g.
    `truncated_importance_weight` for stale samples; `max_length` is passed to the
    "seq-mean-token-sum-norm" aggregation.

    Conventions: [B, T] token-level inputs, advantages already per token. ratio = exp(clamp(lp - old,
    -20, 20)); per-token loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)),
    clip_high defaulting to clip_low; with dual_clip = c > 1, tokens with A < 0 get
    min(loss, -A * c). Aggregated by ``aggregate_loss(..., agg)``. Gradient flows only through
    log_probs (old_log_probs and advantages are detached). Stats are detached 0-d tensors (masked
    means over valid tokens): clipfrac (-A * clip(ratio) > -A * ratio), ratio_mean, approx_kl
    (mean of old - lp, with the same clamp as the ratio) and, with dual clip, dual_clipfrac.
    """
    fn = "policy_loss"
    check_shape(fn, "old_log_probs", old_log_probs, "log_probs", log_probs)
    check_shape(fn, "advantages", advantages, "log_probs", log_probs)
    m = bool_mask(fn, mask, "log_probs", log_probs)
    check_choice(fn, "agg", agg, LOSS_AGG_MODES)
    if not clip_low >= 0:
        raise ValueError(f"{fn}: clip_low must be >= 0, got {clip_low}")
    if clip_high is None:
        clip_high = clip_low
    elif not clip_high >= 0:
        raise ValueError(f"{fn}: clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"{fn}: dual_clip must be > 1, got {dual_clip}")

    # Zero the padding first, so NaN/inf there reaches neither the loss nor the gradient.
    lp = torch.where(m, log_probs, torch.zeros_like(log_probs))
    old = torch.where(m, old_log_probs.detach(), torch.zeros_like(lp))
    adv = torch.where(m, advantages.detach(), torch.zeros_like(lp))

    log_ratio = (lp - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)

    stats: dict[str, torch.Tensor] = {}
    if dual_clip is not None:
        loss_dual = -adv * dual_clip
        dual_clipped = (adv < 0) & (per_token > loss_dual)
        per_token = torch.where(adv < 0, torch.minimum(per_token, loss_dual), per_token)
        stats["dual_clipfrac"] = masked_mean(dual_clipped.to(lp.dtype), m).detach()

    if weights is not None:
        check_shape(fn, "weights", weights, "log_probs", log_probs)
        per_token = per_token * torch.where(m, weights.detach(), torch.zeros_like(lp))
    loss = aggregate_loss(per_token, m, agg, max_length=max_length)
    with torch.no_grad():
        stats["clipfrac"] = masked_mean((loss_clipped > loss_unclipped).to(lp.dtype), m)
        stats["ratio_mean"] = masked_mean(ratio, m)
        stats["approx_kl"] = masked_mean(-log_ratio, m)
    return loss, {k: v.detach() for k, v in stats.items()}


def ppo_clip_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: PolicyLossSettings,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped PPO surrogate with clip_low/clip_high and an optional dual clip (``policy_loss``)."""
    return policy_loss(log_probs, old_log_probs, advantages, mask, settings.clip_low, settings.clip_high,
                       settings.dual_clip, settings.agg, weights=weights, max_length=settings.max_length)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = None,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss 0.5 * aggregate(max((v - R)^2, (clip(v, old - clip, old + clip) - R)^2)) and stats.

    Conventions: [B, T] token-level inputs; with clip=None the loss is 0.5 * aggregate((v - R)^2).
    Gradient flows only through values (old_values and returns are detached). Stats are detached
    0-d tensors over valid tokens: vf_clipfrac (share where the clipped term was strictly larger;
    0 when clip is None) and values_mean.
    """
    fn = "value_loss"
    check_shape(fn, "old_values", old_values, "values", values)
    check_shape(fn, "returns", returns, "values", values)
    m = bool_mask(fn, mask, "values", values)
    check_choice(fn, "agg", agg, LOSS_AGG_MODES)
    if clip is not None and not clip >= 0:
        raise ValueError(f"{fn}: clip must be >= 0, got {clip}")

    v = torch.where(m, values, torch.zeros_like(values))
    old = torch.where(m, old_values.detach(), torch.zeros_like(v))
    ret = torch.where(m, returns.detach(), torch.zeros_like(v))

    loss_unclipped = (v - ret) ** 2
    if clip is None:
        per_token = loss_unclipped
        clipped_larger = torch.zeros_like(loss_unclipped, dtype=torch.bool)
    else:
        v_clipped = torch.maximum(torch.minimum(v, old + clip), old - clip)
        loss_clipped = (v_clipped - ret) ** 2
        per_token = torch.maximum(loss_unclipped, loss_clipped)
        clipped_larger = loss_clipped > loss_unclipped

    loss = 0.5 * aggregate_loss(per_token, m, agg)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean(clipped_larger.to(v.dtype), m),
            "values_mean": masked_mean(v, m),
        }
    return loss, {k: t.detach() for k, t in stats.items()}


def truncated_importance_weight(
    behaviour_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    cap: float = 2.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Truncated importance weight min(pi / mu, cap) per token, for off-policy or other-engine experience.

    Conventions: elementwise, w = min(exp(clamp(lp - behaviour, -20, 20)), cap), detached (a constant
    weight, as in truncated IS / "TIS"); 0 at masked positions when mask is given, and 0 wherever
    either log-prob is not finite (-inf: a token one side's top-k/top-p filtered out). cap must be > 0.
    """
    fn = "truncated_importance_weight"
    check_shape(fn, "log_probs", log_probs, "behaviour_log_probs", behaviour_log_probs)
    if not cap > 0:
        raise ValueError(f"{fn}: cap must be > 0, got {cap}")
    m = None if mask is None else bool_mask(fn, mask, "log_probs", log_probs)
    with torch.no_grad():
        log_ratio = (log_probs - behaviour_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        w = torch.exp(log_ratio).clamp(max=cap)
        keep = torch.isfinite(log_probs) & torch.isfinite(behaviour_log_probs)
        if m is not None:
            keep = keep & m
        w = torch.where(keep, w, torch.zeros_like(w))
    return w.detach()
