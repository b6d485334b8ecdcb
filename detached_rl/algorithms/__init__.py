"""The RL math as pure functions over tensors and masks, and the learners (PPO, the GRPO family) built on it.

The math, one formula per function, in small modules whose docstrings state their conventions:
`masks` (masked statistics), `advantages` (GAE, group-relative and REINFORCE++ estimators, registered
by name in `ADVANTAGE_ESTIMATORS`), `kl` (KL estimators), `aggregation` (loss aggregation modes),
`losses` (policy losses, registered in `POLICY_LOSSES`; value loss; truncated importance weights),
`mismatch` (engine tags, when the learners correct behaviour log-probs, the train/inference mismatch metrics).
`metrics` names what learners report; `learner` is the `Learner` protocol the trainer drives.
`detached_rl.algorithms.<function>` names the pure functions; the learners live in
`detached_rl.algorithms.ppo` and `detached_rl.algorithms.grpo` (imported on demand: they load models).
"""

from detached_rl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_METHODS,
    AdvantageInputs,
    AdvantageSettings,
    compute_gae,
    get_advantage_estimator,
    group_advantages,
    register_advantage_estimator,
    rewards_to_go,
    scores_at_last_token,
)
from detached_rl.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from detached_rl.algorithms.kl import KL_KINDS, kl_estimate
from detached_rl.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLossSettings,
    get_policy_loss,
    policy_loss,
    register_policy_loss,
    truncated_importance_weight,
    value_loss,
)
from detached_rl.algorithms.masks import broadcast_to_tokens, masked_mean, masked_sum, masked_whiten
from detached_rl.algorithms.mismatch import mismatch_metrics, needs_behaviour_correction

__all__ = [
    "ADVANTAGE_ESTIMATORS", "ADVANTAGE_METHODS", "KL_KINDS", "LOSS_AGG_MODES", "POLICY_LOSSES",
    "AdvantageInputs", "AdvantageSettings", "PolicyLossSettings",
    "aggregate_loss", "broadcast_to_tokens", "compute_gae", "get_advantage_estimator", "get_policy_loss",
    "group_advantages", "kl_estimate", "masked_mean", "masked_sum", "masked_whiten", "mismatch_metrics",
    "needs_behaviour_correction", "policy_loss",
    "register_advantage_estimator", "register_policy_loss", "rewards_to_go", "scores_at_last_token",
    "truncated_importance_weight", "value_loss",
]
