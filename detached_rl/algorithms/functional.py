"""RL algorithm maths for RLHF / RLVR: masked statistics, advantages, KL estimators and PPO-style losses.

Pure torch functions, one formula each, no Ray and no device literals: every new tensor is created
on the device (and, for floating results, the dtype) of its inputs. The conventions follow verl's
``core_algos``.

Shared conventions:

* Token-level tensors are shaped ``[batch, response_len]`` (``[B, T]``) unless a function says otherwise.
* ``mask`` marks valid response tokens: nonzero / ``True`` is valid, ``0`` / ``False`` is padding.
  Bool and float (0/1) masks are both accepted.
* Values at masked positions never leak into a result, even when they are NaN or inf: they are
  removed with ``torch.where`` (never by multiplying with the mask), and masked positions of a
  token-level output are 0.
* Bad input raises ``ValueError`` whose message starts with the function name and names the argument.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = [
    "ADVANTAGE_METHODS",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "broadcast_to_tokens",
    "compute_gae",
    "group_advantages",
    "kl_estimate",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "policy_loss",
    "truncated_importance_weight",
    "value_loss",
]

#: Ways to reduce a [B, T] per-token loss to a scalar (see ``aggregate_loss``).
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

#: Group-relative (critic-free) advantage estimators (see ``group_advantages``).
ADVANTAGE_METHODS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")

#: Per-token KL estimators (see ``kl_estimate``); "low_var_kl" is verl's name for k3.
KL_KINDS: tuple[str, ...] = ("k1", "abs", "k2", "k3", "low_var_kl")

# Log-ratios are clamped to this range before exp() so that a ratio never overflows.
_LOG_RATIO_CLAMP = 20.0
# The k3 estimate is clamped to [-_K3_CLAMP, _K3_CLAMP] (verl's low_var_kl).
_K3_CLAMP = 10.0
# Added to the variance in masked_whiten.
_WHITEN_EPS = 1e-8


# --------------------------------------------------------------------------- input checks


def _check_shape(fn: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.shape != ref.shape:
        raise ValueError(f"{fn}: {name} shape {tuple(t.shape)} != {ref_name} shape {tuple(ref.shape)}")


def _check_2d(fn: str, name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{fn}: {name} must be 2-D [batch, response_len], got shape {tuple(t.shape)}")


def _bool_mask(fn: str, mask: torch.Tensor, ref_name: str, ref: torch.Tensor) -> torch.Tensor:
    """Check that mask has ref's shape and return it as a bool tensor (nonzero = valid)."""
    _check_shape(fn, "mask", mask, ref_name, ref)
    return mask if mask.dtype == torch.bool else mask != 0


def _check_choice(fn: str, name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{fn}: unknown {name} {value!r}; expected one of {choices}")


# --------------------------------------------------------------------------- masked statistics


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over valid positions (all of them, or per slice along ``dim``).

    Conventions: mask has x's shape; masked entries are dropped with torch.where, so NaN/inf there
    does not leak; an empty slice sums to 0.
    """
    m = _bool_mask("masked_sum", mask, "x", x)
    kept = torch.where(m, x, torch.zeros_like(x))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over valid positions (all of them, or per slice along ``dim``).

    Conventions: mask has x's shape; masked entries are dropped with torch.where; a slice (or the
    whole tensor, when dim is None) with no valid position gives 0, not NaN.
    """
    m = _bool_mask("masked_mean", mask, "x", x)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8), with mean and variance taken over the valid tokens.

    Conventions: one mean and one *unbiased* variance (divisor n - 1) over all valid tokens of the
    whole batch, not per sequence; with shift_mean=False the mean is added back (only the scale
    changes); masked positions are returned as 0. Fewer than 2 valid tokens raises ValueError.
    """
    m = _bool_mask("masked_whiten", mask, "x", x)
    n = int(m.sum())
    if n < 2:
        raise ValueError(
            f"masked_whiten: mask has {n} valid token(s); need at least 2 for an unbiased variance"
        )
    mean = masked_sum(x, m) / n
    var = masked_sum((x - mean) ** 2, m) / (n - 1)
    whitened = (x - mean) * torch.rsqrt(var + _WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros_like(whitened))


# --------------------------------------------------------------------------- advantages


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE advantages and returns (= advantages + values), computed without grad.

    Conventions: [B, T] inputs, recursion from the last token backwards along dim 1, *not* whitened.
    A masked position is skipped: it contributes nothing and the next value and running GAE carry
    over it, so masks with holes work (verl's compute_gae_advantage_return):
    delta = r_t + gamma * next_value - v_t; gae_t = delta + gamma * lam * gae; at valid t,
    next_value = v_t and gae = gae_t. The value after the last valid token is 0 (episode ends).
    Advantages and returns are 0 at masked positions. 0 <= gamma <= 1 and 0 <= lam <= 1.
    """
    fn = "compute_gae"
    _check_2d(fn, "rewards", rewards)
    _check_shape(fn, "values", values, "rewards", rewards)
    m = _bool_mask(fn, mask, "rewards", rewards)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"{fn}: gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"{fn}: lam must be in [0, 1], got {lam}")

    with torch.no_grad():
        dtype = torch.promote_types(rewards.dtype, values.dtype)
        r = torch.where(m, rewards.to(dtype), torch.zeros((), dtype=dtype, device=rewards.device))
        v = torch.where(m, values.to(dtype), torch.zeros((), dtype=dtype, device=values.device))
        next_value = r.new_zeros(r.shape[0])
        gae = r.new_zeros(r.shape[0])
        advantages = torch.zeros_like(r)
        for t in reversed(range(r.shape[1])):
            valid = m[:, t]
            delta = r[:, t] + gamma * next_value - v[:, t]
            gae_t = delta + gamma * lam * gae
            next_value = torch.where(valid, v[:, t], next_value)
            gae = torch.where(valid, gae_t, gae)
            advantages[:, t] = gae_t
        advantages = torch.where(m, advantages, torch.zeros_like(advantages))
        returns = torch.where(m, advantages + v, torch.zeros_like(advantages))
    return advantages, returns


def _group_index(
    fn: str,
    n: int,
    group_ids: Sequence[Hashable] | torch.Tensor | None,
    group_size: int | None,
    device: torch.device,
) -> torch.Tensor:
    """Map each of n responses to a dense group index 0..G-1 (a long tensor on ``device``)."""
    if (group_ids is None) == (group_size is None):
        raise ValueError(f"{fn}: give exactly one of group_ids and group_size")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"{fn}: group_size must be a positive int, got {group_size!r}")
        if n % group_size != 0:
            raise ValueError(f"{fn}: number of scores {n} is not divisible by group_size {group_size}")
        return torch.arange(n, device=device) // group_size
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != n:
            raise ValueError(f"{fn}: group_ids shape {tuple(group_ids.shape)} != scores shape ({n},)")
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(f"{fn}: group_ids tensor must have an integer dtype, got {group_ids.dtype}")
        return torch.unique(group_ids, return_inverse=True)[1].to(device)
    ids = list(group_ids)  # type: ignore[arg-type]
    if len(ids) != n:
        raise ValueError(f"{fn}: group_ids has length {len(ids)} != number of scores {n}")
    first_seen: dict[Hashable, int] = {}
    try:
        index = [first_seen.setdefault(g, len(first_seen)) for g in ids]
    except TypeError as e:
        raise ValueError(f"{fn}: group_ids must be hashable: {e}") from None
    return torch.tensor(index, dtype=torch.long, device=device)


def group_advantages(
    scores: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor | None = None,
    group_size: int | None = None,
    method: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Per-response advantages [N] from scalar scores [N], relative to each response's group.

    Conventions: groups come from group_ids (any hashables or an integer tensor; members need not be
    contiguous) or group_size (contiguous blocks); exactly one is given. No grad. Methods:
    grpo = (r - mean) / (std + eps), unbiased std, a singleton has mean 0 and std 1;
    dr_grpo = r - mean (singleton: mean 0); rloo = r - mean of the *other* members (singleton: r);
    reinforce_pp_baseline = r - mean (singleton: mean 0), to be whitened over tokens by the caller.
    Not whitened over the batch. Integer scores are converted to the default float dtype.
    """
    fn = "group_advantages"
    if scores.dim() != 1:
        raise ValueError(f"{fn}: scores must be 1-D [N], got shape {tuple(scores.shape)}")
    _check_choice(fn, "method", method, ADVANTAGE_METHODS)
    if not eps >= 0.0:
        raise ValueError(f"{fn}: eps must be >= 0, got {eps}")
    n = scores.shape[0]
    index = _group_index(fn, n, group_ids, group_size, scores.device)

    with torch.no_grad():
        r = scores.detach()
        if not r.is_floating_point():
            r = r.to(torch.get_default_dtype())
        num_groups = int(index.max()) + 1 if n > 0 else 0
        count = r.new_zeros(num_groups).index_add_(0, index, torch.ones_like(r))[index]
        total = r.new_zeros(num_groups).index_add_(0, index, r)[index]
        singleton = count < 2
        mean = total / count

        if method == "rloo":
            others_mean = (total - r) / (count - 1).clamp(min=1)
            return torch.where(singleton, r, r - others_mean)

        mean = torch.where(singleton, torch.zeros_like(mean), mean)
        if method in ("dr_grpo", "reinforce_pp_baseline"):
            return r - mean
        # grpo
        sq_dev = (r - mean) ** 2
        var = r.new_zeros(num_groups).index_add_(0, index, sq_dev)[index] / (count - 1).clamp(min=1)
        std = torch.where(singleton, torch.ones_like(var), var.sqrt())
        return (r - mean) / (std + eps)


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread per-sequence values [N] over tokens: [N, T] with the sequence's value at valid tokens.

    Conventions: mask is [N, T]; masked positions are 0; dtype and device follow ``advantages``.
    """
    fn = "broadcast_to_tokens"
    if advantages.dim() != 1:
        raise ValueError(f"{fn}: advantages must be 1-D [N], got shape {tuple(advantages.shape)}")
    _check_2d(fn, "mask", mask)
    if mask.shape[0] != advantages.shape[0]:
        raise ValueError(
            f"{fn}: mask shape {tuple(mask.shape)} does not match advantages shape {tuple(advantages.shape)}"
        )
    m = mask if mask.dtype == torch.bool else mask != 0
    expanded = advantages.unsqueeze(-1).expand(mask.shape)
    return torch.where(m, expanded, torch.zeros_like(expanded))


# --------------------------------------------------------------------------- KL


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the log-probs of the sampled tokens.

    Conventions: elementwise, no mask and no reduction (mask/aggregate afterwards). With
    d = log_probs - ref_log_probs: k1 = d; abs = |d|; k2 = d^2 / 2; k3 (alias low_var_kl):
    u = clamp(-d, -20, 20), kl = clamp(exp(u) - u - 1, -10, 10).
    """
    fn = "kl_estimate"
    _check_shape(fn, "ref_log_probs", ref_log_probs, "log_probs", log_probs)
    _check_choice(fn, "kind", kind, KL_KINDS)
    d = log_probs - ref_log_probs
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    u = (ref_log_probs - log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(u) - u - 1).clamp(-_K3_CLAMP, _K3_CLAMP)


# --------------------------------------------------------------------------- losses


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    max_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar, in one of LOSS_AGG_MODES.

    Conventions: token-mean = sum over valid tokens / their count (0 if none);
    seq-mean-token-sum = per-sequence token sum, mean over non-empty sequences;
    seq-mean-token-mean = per-sequence token mean, mean over non-empty sequences;
    seq-mean-token-sum-norm = per-sequence token sum / max_length (default T = mask.shape[-1], the
    padded length; Dr.GRPO's constant), mean over *all* B sequences. No sequence → 0.
    max_length is only used by seq-mean-token-sum-norm (ignored by the other modes) and must be > 0.
    """
    fn = "aggregate_loss"
    _check_2d(fn, "loss", loss)
    m = _bool_mask(fn, mask, "loss", loss)
    _check_choice(fn, "mode", mode, LOSS_AGG_MODES)
    if max_length is not None and not max_length > 0:
        raise ValueError(f"{fn}: max_length must be > 0, got {max_length}")

    if mode == "token-mean":
        return masked_mean(loss, m)
    non_empty = m.any(dim=-1)
    if mode == "seq-mean-token-sum":
        return masked_mean(masked_sum(loss, m, dim=-1), non_empty)
    if mode == "seq-mean-token-mean":
        return masked_mean(masked_mean(loss, m, dim=-1), non_empty)
    # seq-mean-token-sum-norm
    norm = float(max_length) if max_length is not None else float(m.shape[-1])
    seq_sums = masked_sum(loss, m, dim=-1) / norm
    return seq_sums.sum() / max(m.shape[0], 1)


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
    _check_shape(fn, "old_log_probs", old_log_probs, "log_probs", log_probs)
    _check_shape(fn, "advantages", advantages, "log_probs", log_probs)
    m = _bool_mask(fn, mask, "log_probs", log_probs)
    _check_choice(fn, "agg", agg, LOSS_AGG_MODES)
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

    log_ratio = (lp - old).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
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
        _check_shape(fn, "weights", weights, "log_probs", log_probs)
        per_token = per_token * torch.where(m, weights.detach(), torch.zeros_like(lp))
    loss = aggregate_loss(per_token, m, agg, max_length=max_length)
    with torch.no_grad():
        stats["clipfrac"] = masked_mean((loss_clipped > loss_unclipped).to(lp.dtype), m)
        stats["ratio_mean"] = masked_mean(ratio, m)
        stats["approx_kl"] = masked_mean(-log_ratio, m)
    return loss, {k: v.detach() for k, v in stats.items()}


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
    _check_shape(fn, "old_values", old_values, "values", values)
    _check_shape(fn, "returns", returns, "values", values)
    m = _bool_mask(fn, mask, "values", values)
    _check_choice(fn, "agg", agg, LOSS_AGG_MODES)
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


# --------------------------------------------------------------------------- off-policy correction


def truncated_importance_weight(
    behaviour_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    cap: float = 2.0,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Truncated importance weight min(pi / mu, cap) per token, for stale (off-policy) experience.

    Conventions: elementwise, w = min(exp(clamp(lp - behaviour, -20, 20)), cap), detached (a constant
    weight, as in truncated IS / "TIS"); 0 at masked positions when mask is given. cap must be > 0.
    """
    fn = "truncated_importance_weight"
    _check_shape(fn, "log_probs", log_probs, "behaviour_log_probs", behaviour_log_probs)
    if not cap > 0:
        raise ValueError(f"{fn}: cap must be > 0, got {cap}")
    m = None if mask is None else _bool_mask(fn, mask, "log_probs", log_probs)
    with torch.no_grad():
        log_ratio = (log_probs - behaviour_log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        w = torch.exp(log_ratio).clamp(max=cap)
        if m is not None:
            w = torch.where(m, w, torch.zeros_like(w))
    return w.detach()
