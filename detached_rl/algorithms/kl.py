"""Per-token estimators of KL(policy || reference) from the log-probs of the sampled tokens.

Conventions (see ``_common``): elementwise over any shape, no mask and no reduction: callers mask
(``masked_fill``) and aggregate (``aggregate_loss``/``masked_mean``) afterwards.
"""

from __future__ import annotations

import torch

from detached_rl.algorithms._common import LOG_RATIO_CLAMP, check_choice, check_shape
from detached_rl.algorithms.registry import KL_KINDS

# The k3 estimate is clamped to [-_K3_CLAMP, _K3_CLAMP] (verl's low_var_kl).
_K3_CLAMP = 10.0


def kl_estimate(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the log-probs of the sampled tokens.

    Conventions: elementwise, no mask and no reduction (mask/aggregate afterwards). With
    d = log_probs - ref_log_probs: k1 = d; abs = |d|; k2 = d^2 / 2; k3 (alias low_var_kl):
    u = clamp(-d, -20, 20), kl = clamp(exp(u) - u - 1, -10, 10).
    """
    fn = "kl_estimate"
    check_shape(fn, "ref_log_probs", ref_log_probs, "log_probs", log_probs)
    check_choice(fn, "kind", kind, KL_KINDS)
    d = log_probs - ref_log_probs
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    u = (ref_log_probs - log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(u) - u - 1).clamp(-_K3_CLAMP, _K3_CLAMP)
