"""The RL math as pure functions over tensors and masks, and the learners (PPO, the GRPO family) built on it.

The math, one formula per function, in small modules whose docstrings state their conventions:
`registry` (the names a config may pick, torch-free, and the registries `ADVANTAGE_ESTIMATORS` and
`POLICY_LOSSES`), `masks` (masked statistics), `advantages` (GAE, group-relative and REINFORCE++
estimators), `kl` (KL estimators), `aggregation` (loss aggregation modes), `losses` (the policy losses;
value loss; truncated importance weights),
`mismatch` (engine tags, when the learners correct behaviour log-probs, the train/inference mismatch metrics).
`metrics` names what learners report; `learner` is the `Learner` protocol the trainer drives.
`detached_rl.algorithms.<function>` names the pure functions (each imported on first use); the learners live
in `detached_rl.algorithms.ppo` and `detached_rl.algorithms.grpo`, their settings in `ppo_config` and
`grpo_config` (torch-free).
"""

from detached_rl.core.lazy import lazy_exports

# Public name -> its module, imported on first use (importing the package loads no torch).
_LAZY = {
    "ADVANTAGE_ESTIMATORS": "detached_rl.algorithms.registry",
    "ADVANTAGE_METHODS": "detached_rl.algorithms.registry",
    "AdvantageInputs": "detached_rl.algorithms.advantages",
    "AdvantageSettings": "detached_rl.algorithms.advantages",
    "compute_gae": "detached_rl.algorithms.advantages",
    "get_advantage_estimator": "detached_rl.algorithms.registry",
    "group_advantages": "detached_rl.algorithms.advantages",
    "register_advantage_estimator": "detached_rl.algorithms.registry",
    "rewards_to_go": "detached_rl.algorithms.advantages",
    "scores_at_last_token": "detached_rl.algorithms.advantages",
    "LOSS_AGG_MODES": "detached_rl.algorithms.registry",
    "aggregate_loss": "detached_rl.algorithms.aggregation",
    "KL_KINDS": "detached_rl.algorithms.registry",
    "kl_estimate": "detached_rl.algorithms.kl",
    "POLICY_LOSSES": "detached_rl.algorithms.registry",
    "PolicyLossSettings": "detached_rl.algorithms.losses",
    "get_policy_loss": "detached_rl.algorithms.registry",
    "policy_loss": "detached_rl.algorithms.losses",
    "register_policy_loss": "detached_rl.algorithms.registry",
    "truncated_importance_weight": "detached_rl.algorithms.losses",
    "value_loss": "detached_rl.algorithms.losses",
    "broadcast_to_tokens": "detached_rl.algorithms.masks",
    "masked_mean": "detached_rl.algorithms.masks",
    "masked_sum": "detached_rl.algorithms.masks",
    "masked_whiten": "detached_rl.algorithms.masks",
    "mismatch_metrics": "detached_rl.algorithms.mismatch",
    "needs_behaviour_correction": "detached_rl.algorithms.mismatch",
}
__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = sorted(_LAZY)
