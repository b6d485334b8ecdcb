"""PPO's settings: `PPOConfig` (torch-free, so the run config checks it without loading the learner)."""

from __future__ import annotations

from dataclasses import dataclass, field

from detached_rl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_KINDS,
    KL_MODES,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
)
from detached_rl.core.sampling import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig


@dataclass
class PPOConfig:
    """PPO hyper-parameters; defaults follow common RLHF practice (verl / OpenRLHF)."""

    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    critic_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=5e-5))
    advantage_estimator: str = "gae"  # a name in ADVANTAGE_ESTIMATORS
    policy_loss: str = "ppo_clip"  # a name in POLICY_LOSSES
    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    value_coef: float = 0.5
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_kind: str = "k1"
    kl_mode: str = "reward"  # "reward": penalty in the token rewards; "loss": a loss term
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    loss_agg: str = "token-mean"
    micro_batch_size: int = 8
    mini_batch_size: int | None = None  # samples per optimizer step; None: the whole batch
    train_epochs: int = 1
    seed: int = 0  # the order of samples in mini-batches (the learner's own generator, checkpointed)
    tis_cap: float | None = 2.0  # truncated importance weight cap for corrected batches; None: weights 1
    # Stale, multi-pass or other-engine batches (`needs_behaviour_correction`): recompute the "old" log-probs
    # with the trainer's weights (the proximal policy), weight tokens by truncated importance weights and
    # report the mismatch. False: ratios and clipping are taken against the behaviour policy itself.
    proximal_recompute: bool = True
    # How the makers sample, for the learner built without an explicit `sampling` (PPOLearner(..., sampling=)
    # wins). RunConfig keeps its one `sampling` at the top and leaves this None; None
    # here and there: defaults.
    sampling: SamplingConfig | None = None

    def __post_init__(self) -> None:
        if self.kl_mode not in KL_MODES:
            raise ValueError(f"PPOConfig.kl_mode must be one of {KL_MODES}, got {self.kl_mode!r}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"PPOConfig.kl_kind must be one of {KL_KINDS}, got {self.kl_kind!r}")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"PPOConfig.loss_agg must be one of {LOSS_AGG_MODES}, got {self.loss_agg!r}")
        for name, registry in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("policy_loss", POLICY_LOSSES)):
            if getattr(self, name) not in registry:
                raise ValueError(f"PPOConfig.{name} must be one of {sorted(registry)}, got "
                                 f"{getattr(self, name)!r}")
        for name in ("micro_batch_size", "train_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"PPOConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ValueError(f"PPOConfig.mini_batch_size must be >= 1 or None, got {self.mini_batch_size}")
        for name in ("kl_coef", "entropy_coef", "value_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"PPOConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"PPOConfig.tis_cap must be > 0 or None, got {self.tis_cap}")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError("PPOConfig.gamma and PPOConfig.lam must be in [0, 1], got "
                             f"{self.gamma}, {self.lam}")
