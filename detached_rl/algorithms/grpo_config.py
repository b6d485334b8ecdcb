"""The GRPO family's settings: the variants as named presets (`PRESETS`) and `GRPOConfig`.

A variant is a named preset of defaults: the advantage estimator (a name in `ADVANTAGE_ESTIMATORS`), loss
aggregation, clip range, dynamic sampling, overlong shaping, and whether the KL goes into the reward; each
default can be overridden in `GRPOConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detached_rl.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_METHODS,
    KL_KINDS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    estimator_uses_critic,
)
from detached_rl.core.sampling import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig


@dataclass(frozen=True)
class VariantPreset:
    """What one variant of the family sets: the defaults of the `GRPOConfig` fields left
    None, and its KL placement."""

    advantage_estimator: str  # a name in ADVANTAGE_ESTIMATORS
    loss_agg: str  # one of LOSS_AGG_MODES
    clip_high: float | None = None  # None: clip_low (symmetric clipping)
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, draw again
    overlong_shaping: bool = False  # DAPO's soft penalty for responses near max_new_tokens
    kl_in_reward: bool = False  # the KL penalty goes into the token rewards (REINFORCE++) instead of the loss


#: The variants by `GRPOConfig.algorithm` name.
PRESETS: dict[str, VariantPreset] = {
    # (r - mean) / std per group; each sequence's token mean, averaged over sequences.
    "grpo": VariantPreset(advantage_estimator="grpo", loss_agg="seq-mean-token-mean"),
    # r - mean per group; token sums over a constant length (no length or std bias).
    "dr_grpo": VariantPreset(advantage_estimator="dr_grpo", loss_agg="seq-mean-token-sum-norm"),
    # GRPO advantages, token mean, clip-higher 0.28, dynamic sampling and overlong shaping.
    "dapo": VariantPreset(advantage_estimator="grpo", loss_agg="token-mean", clip_high=0.28,
                          dynamic_sampling=True, overlong_shaping=True),
    # r - mean of the group's other responses.
    "rloo": VariantPreset(advantage_estimator="rloo", loss_agg="token-mean"),
    # Batch-whitened reward to go, with the KL penalty in the token rewards.
    "reinforce_pp": VariantPreset(advantage_estimator="reinforce_pp", loss_agg="token-mean",
                                  kl_in_reward=True),
    # r - group mean, whitened over the batch's tokens.
    "reinforce_pp_baseline": VariantPreset(advantage_estimator="reinforce_pp_baseline",
                                           loss_agg="token-mean"),
}
VARIANTS = tuple(PRESETS)


@dataclass
class GRPOConfig:
    """Hyper-parameters of the GRPO family; `None` fields take the variant's default."""

    algorithm: str = "grpo"  # a name in PRESETS
    actor_optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-6))
    advantage_estimator: str | None = None  # a critic-free name in ADVANTAGE_ESTIMATORS; None: the variant's
    policy_loss: str = "ppo_clip"  # a name in POLICY_LOSSES
    clip_low: float = 0.2
    clip_high: float | None = None  # dapo: 0.28 ("clip-higher")
    dual_clip: float | None = None
    # grpo: seq-mean-token-mean; dr_grpo: seq-mean-token-sum-norm; others: token-mean
    loss_agg: str | None = None
    kl_coef: float = 0.0  # beta; > 0 keeps a reference model on the trainer
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    advantage_eps: float = 1e-6
    dynamic_sampling: bool | None = None  # drop groups whose rewards are all equal (dapo: on)
    max_sampling_rounds: int = 8  # dynamic sampling: buffer draws per batch before training on what there is
    # Responses per prompt (the makers' `group_size`): the trainer's buffer then refuses any push that is not
    # whole groups of it, so no batch holds part of a group. RunConfig sets it from `maker.group_size`;
    # None: no such rule (a push of part of a group is taken, and the step that draws it fails).
    group_size: int | None = None
    overlong_shaping: bool | None = None  # dapo: on
    overlong_buffer: int | None = None  # the last N tokens before max_new_tokens are penalised; default 20 %
    overlong_penalty: float = 1.0
    tis_cap: float | None = 2.0  # truncated importance weight cap for corrected batches; None: weights 1
    # Stale, multi-pass or other-engine batches (`needs_behaviour_correction`): recompute the "old" log-probs
    # with the trainer's weights (the proximal policy), weight tokens by truncated importance weights and
    # report the mismatch. False: ratios and clipping are taken against the behaviour policy itself (one
    # forward pass less per step).
    proximal_recompute: bool = True
    ref_update_every: int = 0  # Polyak-update the reference every N steps (0: never)
    ref_update_alpha: float = 1.0  # ref <- alpha * policy + (1 - alpha) * ref
    micro_batch_size: int = 8
    mini_batch_size: int | None = None
    train_epochs: int = 1
    seed: int = 0  # the order of samples in mini-batches (the learner's own generator, checkpointed)
    # Forward passes on the trainer under torch.autocast to this dtype (e.g. "bfloat16": ~1.8x faster
    # training of SmolLM2 on CPUs with AMX); weights, gradients and the optimizer stay in their dtype.
    # "auto": bfloat16 where the trainer's device computes it natively (CUDA with bf16, CPUs with AVX512-BF16
    # or AMX), else none: on other CPUs torch emulates bf16, 20x slower than float32 (core/native_dtypes.py).
    autocast_dtype: str | None = None
    # How the makers sample, for the learner built without an explicit `sampling` (GRPOLearner(..., sampling=)
    # wins). RunConfig keeps its one `sampling` at the top and leaves this None; None
    # here and there: defaults.
    sampling: SamplingConfig | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in PRESETS:
            raise ValueError(f"GRPOConfig.algorithm must be one of {VARIANTS}, got {self.algorithm!r}")
        preset = PRESETS[self.algorithm]
        self.advantage_estimator = self.advantage_estimator or preset.advantage_estimator
        self.loss_agg = self.loss_agg or preset.loss_agg
        self.clip_high = self.clip_high if self.clip_high is not None else preset.clip_high
        if self.dynamic_sampling is None:
            self.dynamic_sampling = preset.dynamic_sampling
        if self.overlong_shaping is None:
            self.overlong_shaping = preset.overlong_shaping
        estimator = self.advantage_estimator
        if estimator not in ADVANTAGE_ESTIMATORS or estimator_uses_critic(estimator):
            critic_free = sorted(n for n in ADVANTAGE_ESTIMATORS if not estimator_uses_critic(n))
            raise ValueError(f"GRPOConfig.advantage_estimator must be one of {critic_free} (no critic here), "
                             f"got {self.advantage_estimator!r}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"GRPOConfig.policy_loss must be one of {sorted(POLICY_LOSSES)}, got "
                             f"{self.policy_loss!r}")
        if self.loss_agg not in LOSS_AGG_MODES:
            raise ValueError(f"GRPOConfig.loss_agg must be one of {LOSS_AGG_MODES}, got {self.loss_agg!r}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"GRPOConfig.kl_kind must be one of {KL_KINDS}, got {self.kl_kind!r}")
        if self.group_size is not None and (isinstance(self.group_size, bool)
                                            or not isinstance(self.group_size, int)
                                            or self.group_size < 1):
            raise ValueError(f"GRPOConfig.group_size must be an int >= 1 or None, got {self.group_size!r}")
        for name in ("micro_batch_size", "train_epochs", "max_sampling_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"GRPOConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("kl_coef", "entropy_coef", "advantage_eps", "overlong_penalty", "ref_update_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"GRPOConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.ref_update_alpha <= 1:
            raise ValueError(f"GRPOConfig.ref_update_alpha must be in (0, 1], got {self.ref_update_alpha}")
        if self.autocast_dtype is not None and self.autocast_dtype not in ("bfloat16", "float16", "auto"):
            raise ValueError("GRPOConfig.autocast_dtype must be 'bfloat16', 'float16', 'auto' or null, got "
                             f"{self.autocast_dtype!r}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"GRPOConfig.tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.sampling is not None:
            self.check_overlong_buffer(self.sampling.max_new_tokens)

    def check_overlong_buffer(self, max_new_tokens: int) -> None:
        """Refuse an `overlong_buffer` that does not fit in (0, max_new_tokens)."""
        if self.overlong_buffer is not None and not 0 < self.overlong_buffer < max_new_tokens:
            raise ValueError(
                f"GRPOConfig.overlong_buffer must be in (0, max_new_tokens={max_new_tokens}), got "
                f"{self.overlong_buffer}"
            )

    @property
    def kl_in_reward(self) -> bool:
        """Whether the KL penalty goes into the token rewards (the variant's choice) rather than the loss."""
        return PRESETS[self.algorithm].kl_in_reward

    @property
    def advantage_method(self) -> str | None:
        """The group-relative method of `group_advantages` in use (None: an estimator without groups)."""
        return self.advantage_estimator if self.advantage_estimator in ADVANTAGE_METHODS else None
