"""The algorithms' names, torch-free: what a config may pick, checked without loading the math.

Advantage estimators and policy losses are registered by name (`ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`): the
built-in ones are listed here as "module:function" and imported on first lookup; one of your own is one
decorated function (`register_advantage_estimator`, `register_policy_loss`). The fixed choices are tuples:
group-relative methods (`ADVANTAGE_METHODS`), KL estimators (`KL_KINDS`), where PPO puts its KL (`KL_MODES`)
and how a per-token loss is reduced (`LOSS_AGG_MODES`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from detached_rl.core.lazy import LazyRegistry

#: Group-relative (critic-free) advantage methods of ``group_advantages``.
ADVANTAGE_METHODS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
#: Per-token KL estimators (see ``kl_estimate``); "low_var_kl" is verl's name for k3.
KL_KINDS: tuple[str, ...] = ("k1", "abs", "k2", "k3", "low_var_kl")
#: Where PPO puts its KL penalty: into the token rewards or as a loss term.
KL_MODES: tuple[str, ...] = ("reward", "loss")
#: Ways to reduce a [B, T] per-token loss to a scalar (see ``aggregate_loss``).
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

_ADVANTAGES = "detached_rl.algorithms.advantages"
#: Advantage estimators by config name (the signature: ``detached_rl.algorithms.advantages``).
ADVANTAGE_ESTIMATORS = LazyRegistry({
    "gae": f"{_ADVANTAGES}:gae_estimator",
    "grpo": f"{_ADVANTAGES}:grpo_estimator",
    "dr_grpo": f"{_ADVANTAGES}:dr_grpo_estimator",
    "rloo": f"{_ADVANTAGES}:rloo_estimator",
    "reinforce_pp_baseline": f"{_ADVANTAGES}:reinforce_pp_baseline_estimator",
    "reinforce_pp": f"{_ADVANTAGES}:reinforce_pp_estimator",
})
_USES_CRITIC: set[str] = {"gae"}
#: Policy losses by config name (the signature: ``detached_rl.algorithms.losses``).
POLICY_LOSSES = LazyRegistry({"ppo_clip": "detached_rl.algorithms.losses:ppo_clip_loss"})

Function = Callable[..., Any]


def register_advantage_estimator(name: str, *, uses_critic: bool = False) -> Callable[[Function], Function]:
    """Decorator registering an estimator under `name`; `uses_critic`: it reads `inputs.values`."""

    def register(estimator: Function) -> Function:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"register_advantage_estimator: {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = estimator
        if uses_critic:
            _USES_CRITIC.add(name)
        return estimator

    return register


def _known(registry: Any, name: str, what: str) -> str:
    """`name`, if `registry` has it; else a ValueError naming the registered ones."""
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; registered: {sorted(registry)}")
    return name


def get_advantage_estimator(name: str) -> Function:
    """The estimator registered as `name`; an unknown name is refused with the known ones."""
    return ADVANTAGE_ESTIMATORS[_known(ADVANTAGE_ESTIMATORS, name, "advantage estimator")]


def estimator_uses_critic(name: str) -> bool:
    """Whether the estimator registered as `name` needs a critic's values (an unknown name is refused)."""
    return _known(ADVANTAGE_ESTIMATORS, name, "advantage estimator") in _USES_CRITIC


def register_policy_loss(name: str) -> Callable[[Function], Function]:
    """Decorator registering a policy loss under `name`."""

    def register(loss: Function) -> Function:
        if name in POLICY_LOSSES:
            raise ValueError(f"register_policy_loss: {name!r} is already registered")
        POLICY_LOSSES[name] = loss
        return loss

    return register


def get_policy_loss(name: str) -> Function:
    """The policy loss registered as `name`; an unknown name is refused with the known ones."""
    return POLICY_LOSSES[_known(POLICY_LOSSES, name, "policy loss")]
