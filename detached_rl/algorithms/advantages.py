"""Advantage estimators: GAE (with a critic) and the critic-free group-relative and REINFORCE++ estimators.

Every estimator is one function registered by name (``detached_rl.algorithms.registry``) and has one
signature: ``estimator(inputs: AdvantageInputs, settings: AdvantageSettings) -> (advantages, returns)``,
both token-level [B, T] with 0 at masked positions (``returns`` is the critic's target). A learner
picks one by its config string through ``get_advantage_estimator``; adding an estimator is writing
one decorated function.

Conventions (see ``_common``): token-level tensors are [B, T] and ``mask`` marks valid response
tokens; sequence-level tensors are [B]; nothing here needs or keeps a gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from detached_rl.algorithms._common import bool_mask, check_2d, check_choice, check_shape
from detached_rl.algorithms.masks import broadcast_to_tokens, masked_whiten

# The names and the registry live in `registry` (torch-free, for the configs); importable from here too.
from detached_rl.algorithms.registry import ADVANTAGE_ESTIMATORS as ADVANTAGE_ESTIMATORS
from detached_rl.algorithms.registry import ADVANTAGE_METHODS
from detached_rl.algorithms.registry import estimator_uses_critic as estimator_uses_critic
from detached_rl.algorithms.registry import get_advantage_estimator as get_advantage_estimator
from detached_rl.algorithms.registry import register_advantage_estimator as register_advantage_estimator


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read of a batch; each uses the fields it needs and names any that is missing."""

    mask: torch.Tensor  # [B, T] valid response tokens
    scores: torch.Tensor  # [B] each response's reward (the group-relative estimators compare these)
    # [B, T] per-token rewards: the score at the last valid token, minus a per-token KL penalty where
    # the learner puts the KL into the reward (PPO's kl_mode="reward", REINFORCE++).
    token_rewards: torch.Tensor
    values: torch.Tensor | None = None  # [B, T] the critic's values of the behaviour policy (GAE)
    # [B] each response's prompt group; None: a group of its own
    group_ids: Sequence[Hashable | None] | None = None


@dataclass(frozen=True)
class AdvantageSettings:
    """The estimators' hyper-parameters (each reads those it uses)."""

    gamma: float = 1.0  # discount (GAE and the returns)
    lam: float = 0.95  # GAE's lambda
    eps: float = 1e-6  # added to the group std (grpo)


AdvantageEstimator = Callable[[AdvantageInputs, AdvantageSettings], tuple[torch.Tensor, torch.Tensor]]

# --------------------------------------------------------------------------- formulas


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
    check_2d(fn, "rewards", rewards)
    check_shape(fn, "values", values, "rewards", rewards)
    m = bool_mask(fn, mask, "rewards", rewards)
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


def rewards_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted return of every token, sum over later valid tokens s >= t of gamma^(s - t) * r_s, without
    grad.

    Conventions: [B, T], along dim 1 from the end; masked positions contribute nothing and are 0 in
    the result (with gamma = 1 the running sum is the reversed cumulative sum of the masked rewards).
    """
    fn = "rewards_to_go"
    check_2d(fn, "token_rewards", token_rewards)
    m = bool_mask(fn, mask, "token_rewards", token_rewards)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"{fn}: gamma must be in [0, 1], got {gamma}")
    with torch.no_grad():
        rewards = torch.where(m, token_rewards, torch.zeros_like(token_rewards))
        if gamma == 1.0:
            returns = torch.flip(torch.cumsum(torch.flip(rewards, [1]), 1), [1])
        else:
            returns = torch.zeros_like(rewards)
            running = rewards.new_zeros(rewards.shape[0])
            for t in reversed(range(rewards.shape[1])):
                running = torch.where(m[:, t], rewards[:, t] + gamma * running, running)
                returns[:, t] = running
        return torch.where(m, returns, torch.zeros_like(returns))


def scores_at_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards [B, T] holding each sequence's score [B] at its last valid token (0 elsewhere).

    Conventions: the response is left-aligned (valid tokens 0 .. length-1, as ``collate`` builds it).
    """
    fn = "scores_at_last_token"
    check_2d(fn, "mask", mask)
    if scores.shape != (mask.shape[0],):
        raise ValueError(f"{fn}: scores shape {tuple(scores.shape)} != ({mask.shape[0]},)")
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    lengths = mask.sum(1).long()
    rewards[torch.arange(mask.shape[0], device=scores.device), lengths - 1] = scores
    return rewards


def _group_index(
    fn: str,
    n: int,
    group_ids: Sequence[Hashable] | torch.Tensor | None,
    group_size: int | None,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """Map each of n responses to a dense group index 0..G-1 (a long tensor on ``device``); returns it and G.

    G is known on the host in every case, so callers size per-group buffers without a device sync.
    """
    if (group_ids is None) == (group_size is None):
        raise ValueError(f"{fn}: give exactly one of group_ids and group_size")
    if group_size is not None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"{fn}: group_size must be a positive int, got {group_size!r}")
        if n % group_size != 0:
            raise ValueError(f"{fn}: number of scores {n} is not divisible by group_size {group_size}")
        return torch.arange(n, device=device) // group_size, n // group_size
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dim() != 1 or group_ids.shape[0] != n:
            raise ValueError(f"{fn}: group_ids shape {tuple(group_ids.shape)} != scores shape ({n},)")
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(f"{fn}: group_ids tensor must have an integer dtype, got {group_ids.dtype}")
        distinct, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse.to(device), int(distinct.shape[0])
    ids = list(group_ids)  # type: ignore[arg-type]
    if len(ids) != n:
        raise ValueError(f"{fn}: group_ids has length {len(ids)} != number of scores {n}")
    first_seen: dict[Hashable, int] = {}
    try:
        index = [first_seen.setdefault(g, len(first_seen)) for g in ids]
    except TypeError as e:
        raise ValueError(f"{fn}: group_ids must be hashable: {e}") from None
    return torch.tensor(index, dtype=torch.long, device=device), len(first_seen)


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
    check_choice(fn, "method", method, ADVANTAGE_METHODS)
    if not eps >= 0.0:
        raise ValueError(f"{fn}: eps must be >= 0, got {eps}")
    n = scores.shape[0]
    index, num_groups = _group_index(fn, n, group_ids, group_size, scores.device)

    with torch.no_grad():
        r = scores.detach()
        if not r.is_floating_point():
            r = r.to(torch.get_default_dtype())
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


# --------------------------------------------------------------------------- registered estimators


def _group_relative(inputs: AdvantageInputs, settings: AdvantageSettings, method: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_advantages(method)` at every valid token; returns are the rewards to go."""
    if inputs.group_ids is None:
        raise ValueError(f"advantage estimator {method!r} needs group_ids (the prompt group of "
                         "each response)")
    ids = [gid if gid is not None else f"single:{i}" for i, gid in enumerate(inputs.group_ids)]
    per_sequence = group_advantages(inputs.scores, group_ids=ids, method=method, eps=settings.eps)
    return (broadcast_to_tokens(per_sequence, inputs.mask),
            rewards_to_go(inputs.token_rewards, inputs.mask, settings.gamma))


def _whiten_if_possible(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`masked_whiten` over the batch's valid tokens; with fewer than 2 of them, x with padding zeroed."""
    if int(mask.sum()) >= 2:
        return masked_whiten(x, mask)
    return x * mask


def gae_estimator(inputs: AdvantageInputs, settings: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE(gamma, lambda) over the token rewards and the critic's values (PPO);
    returns = advantages + values."""
    if inputs.values is None:
        raise ValueError("advantage estimator 'gae' needs values (field values, computed by a critic)")
    return compute_gae(inputs.token_rewards, inputs.values, inputs.mask, settings.gamma, settings.lam)


def grpo_estimator(inputs: AdvantageInputs, settings: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: (score - group mean) / (group std + eps) at every token of the response."""
    return _group_relative(inputs, settings, "grpo")


def dr_grpo_estimator(inputs: AdvantageInputs,
                      settings: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr.GRPO: score - group mean (no division by the std) at every token."""
    return _group_relative(inputs, settings, "dr_grpo")


def rloo_estimator(inputs: AdvantageInputs, settings: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score - mean score of the group's other responses, at every token."""
    return _group_relative(inputs, settings, "rloo")


def reinforce_pp_baseline_estimator(inputs: AdvantageInputs, settings: AdvantageSettings
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: score - group mean at every token,
    whitened over the batch's tokens."""
    advantages, returns = _group_relative(inputs, settings, "reinforce_pp_baseline")
    if int(inputs.mask.sum()) >= 2:
        advantages = masked_whiten(advantages, inputs.mask)
    return advantages, returns


def reinforce_pp_estimator(inputs: AdvantageInputs,
                           settings: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: each token's reward to go (KL penalty included in the token
    rewards), whitened over the batch."""
    returns = rewards_to_go(inputs.token_rewards, inputs.mask, settings.gamma)
    return _whiten_if_possible(returns, inputs.mask), returns
