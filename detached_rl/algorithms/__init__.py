"""The RL math as pure functions over tensors and masks, and the learners (PPO, the GRPO family) built on it.

`detached_rl.algorithms.<function>` names the pure functions; the learners live in
`detached_rl.algorithms.ppo` and `detached_rl.algorithms.grpo` (imported on demand: they load models).
"""

from detached_rl.algorithms.functional import (
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

__all__ = [
    "aggregate_loss", "broadcast_to_tokens", "compute_gae", "group_advantages", "kl_estimate", "masked_mean",
    "masked_sum", "masked_whiten", "policy_loss", "truncated_importance_weight", "value_loss",
]
