"""open-instruct's configs (the fields this layer reads) and their translation into this project's."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from detached_rl.algorithms.grpo import GRPOConfig
from detached_rl.core.sampling import SamplingConfig
from detached_rl.maker.experience_maker import MakerConfig
from detached_rl.models import Actor, load_causal_lm
from detached_rl.models.loaders import ensure_pad_token
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig

#: open-instruct's `kl_estimator` index -> this project's KL estimator (index 3, ratio * log-ratio, has none).
KL_ESTIMATORS: dict[int, str] = {0: "k1", 1: "k2", 2: "k3"}
#: open-instruct's `advantage_normalization_type` -> this project's advantage estimator.
ADVANTAGE_NORMALIZATIONS: dict[str, str] = {"standard": "grpo", "centered": "dr_grpo"}
#: open-instruct's `deepspeed_stage` -> this project's strategy for more than one rank.
DEEPSPEED_STAGES: dict[int, str] = {0: "ddp", 1: "ddp", 2: "colossalai_zero2", 3: "colossalai_gemini"}


@dataclass
class ExperimentConfig:
    """The fields of open-instruct's `GRPOExperimentConfig` this layer reads (open-instruct's defaults, except
    `model_dtype`: float32, so that CPU makers and trainers agree without casting)."""

    seed: int = 42
    learning_rate: float = 2e-5
    lr_scheduler_type: str = "linear"  # linear | cosine | constant | constant_with_warmup
    warmup_ratio: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float | None = None
    num_epochs: int = 1
    num_mini_batches: int = 1
    per_device_train_batch_size: int = 8  # samples per micro-batch (open-instruct: packed sequences)
    num_training_steps: int | None = None  # sizes the linear / cosine schedule
    world_size: int | None = None  # learner ranks (open-instruct sets it at run time)
    beta: float = 0.05
    clip_lower: float = 0.2
    clip_higher: float = 0.272
    kl_estimator: int = 2
    loss_denominator: str = "token"
    loss_fn: str = "dapo"
    alpha: float = 0.6
    ref_policy_update_freq: int | None = None
    load_ref_policy: bool = True
    use_vllm_logprobs: bool = False
    use_rho_correction: bool = True
    rho_clamp_upper_bound: float = 2.0
    deepspeed_stage: int = 0
    backend_timeout: int = 120  # minutes
    model_dtype: str = "float32"
    output_dir: str = "output/"
    save_freq: int = 200
    eval_on_step_0: bool = False
    checkpoint_state_freq: int = 200
    checkpoint_state_dir: str | None = None


@dataclass
class ModelConfig:
    """open-instruct's `ModelConfig`: the policy (a Hub id, a local Hugging Face directory, tiny[-<type>],
    smollm2) and the Hub revision of a Hub id."""

    model_name_or_path: str = "tiny"
    model_revision: str | None = None


@dataclass
class StreamingDataLoaderConfig:
    """The fields of open-instruct's `StreamingDataLoaderConfig` this layer reads (with its defaults)."""

    num_unique_prompts_rollout: int = 16
    num_samples_per_prompt_rollout: int = 4
    response_length: int = 256
    temperature: float = 1.0
    async_steps: int = 8
    filter_zero_std_samples: bool = True
    active_sampling: bool = False
    advantage_normalization_type: str = "centered"


@dataclass
class VLLMConfig:
    """open-instruct's `VLLMConfig`: here the number of makers the prompts are split over."""

    vllm_num_engines: int = 1
    vllm_tensor_parallel_size: int = 1


def _field(config: Any, name: str, defaults: type) -> Any:
    """`config.name`, or the default of field `name` of the dataclass `defaults` when `config` lacks it."""
    if config is not None and hasattr(config, name):
        return getattr(config, name)
    default = next(f.default for f in fields(defaults) if f.name == name)
    return default


def _args(args: Any, name: str) -> Any:
    return _field(args, name, ExperimentConfig)


def _stream(config: Any, name: str) -> Any:
    return _field(config, name, StreamingDataLoaderConfig)


def sampling_from(streaming_config: Any) -> SamplingConfig:
    """How makers sample and the learner scores: `temperature`, `response_length` new tokens."""
    return SamplingConfig(max_new_tokens=int(_stream(streaming_config, "response_length")),
                          temperature=float(_stream(streaming_config, "temperature")))


def maker_config_from(streaming_config: Any, vllm_config: Any = None, **overrides: Any) -> MakerConfig:
    """A maker's config for one of `vllm_num_engines` "engines": its share of the prompts per batch, one GRPO
    group of `num_samples_per_prompt_rollout` per prompt, the learner's sampling; `overrides` set other
    fields."""
    engines = int(_field(vllm_config, "vllm_num_engines", VLLMConfig))
    prompts = int(_stream(streaming_config, "num_unique_prompts_rollout"))
    settings = {"experience_batch_size": max(1, prompts // max(engines, 1)),
                "group_size": int(_stream(streaming_config, "num_samples_per_prompt_rollout")),
                "sampling": sampling_from(streaming_config), **overrides}
    return MakerConfig(**settings)


def rank_batch_size(streaming_config: Any, world_size: int) -> int:
    """Samples each rank trains on per step: open-instruct's rollout batch split evenly over the ranks."""
    total = int(_stream(streaming_config, "num_unique_prompts_rollout")) * int(
        _stream(streaming_config, "num_samples_per_prompt_rollout"))
    if world_size < 1 or total % world_size:
        raise ValueError(f"num_unique_prompts_rollout x num_samples_per_prompt_rollout = {total} must split "
                         f"evenly over world_size {world_size} learner ranks")
    return total // world_size


def trainer_config_from(args: Any, streaming_config: Any, world_size: int) -> TrainerConfig:
    """The trainer's settings: per-rank batch, staleness bound `async_steps`, waits of `backend_timeout`."""
    batch = rank_batch_size(streaming_config, world_size)
    async_steps = _stream(streaming_config, "async_steps")
    return TrainerConfig(train_batch_size=batch,
                         max_staleness=None if async_steps is None else int(async_steps),
                         batch_timeout_s=60.0 * float(_args(args, "backend_timeout")),
                         buffer_max_samples=max(1024, 4 * batch), stop_makers_at_end=False)


def _optimizer_from(args: Any) -> OptimizerConfig:
    schedule = str(_args(args, "lr_scheduler_type")).removesuffix("_with_warmup")
    if schedule not in ("linear", "cosine", "constant"):
        raise ValueError(f"ExperimentConfig.lr_scheduler_type must be linear, cosine, constant or "
                         f"constant_with_warmup, got {_args(args, 'lr_scheduler_type')!r}")
    steps = _args(args, "num_training_steps")
    total = (None if steps is None
             else int(steps) * int(_args(args, "num_epochs")) * int(_args(args, "num_mini_batches")))
    if schedule != "constant" and not total:
        raise ValueError(f"ExperimentConfig.num_training_steps is required by lr_scheduler_type {schedule!r}")
    warmup = int((total or 0) * float(_args(args, "warmup_ratio")))
    return OptimizerConfig(lr=float(_args(args, "learning_rate")),
                           weight_decay=float(_args(args, "weight_decay")),
                           schedule=schedule, warmup_steps=warmup, total_steps=total,
                           max_grad_norm=_args(args, "max_grad_norm"))


def grpo_config_from(args: Any, streaming_config: Any, world_size: int) -> GRPOConfig:
    """This project's GRPO settings for open-instruct's: DAPO-style clipped loss, token-mean aggregation."""
    if _args(args, "loss_fn") != "dapo":
        raise ValueError(f"ExperimentConfig.loss_fn {_args(args, 'loss_fn')!r} is not available here "
                         "(only 'dapo')")
    if _args(args, "loss_denominator") != "token":
        raise ValueError("ExperimentConfig.loss_denominator must be 'token' here (a constant denominator is "
                         f"not available), got {_args(args, 'loss_denominator')!r}")
    estimator = int(_args(args, "kl_estimator"))
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"ExperimentConfig.kl_estimator must be one of {sorted(KL_ESTIMATORS)}, got "
                         f"{estimator}")
    normalization = _stream(streaming_config, "advantage_normalization_type")
    if normalization not in ADVANTAGE_NORMALIZATIONS:
        raise ValueError(f"StreamingDataLoaderConfig.advantage_normalization_type must be one of "
                         f"{sorted(ADVANTAGE_NORMALIZATIONS)}, got {normalization!r}")
    batch = rank_batch_size(streaming_config, world_size)
    mini_batches = int(_args(args, "num_mini_batches"))
    if mini_batches < 1 or batch % mini_batches:
        raise ValueError(f"ExperimentConfig.num_mini_batches {mini_batches} must divide the per-rank batch "
                         f"{batch}")
    alpha = float(_args(args, "alpha"))
    beta = float(_args(args, "beta"))
    return GRPOConfig(
        algorithm="grpo", advantage_estimator=ADVANTAGE_NORMALIZATIONS[normalization], loss_agg="token-mean",
        group_size=int(_stream(streaming_config, "num_samples_per_prompt_rollout")),
        clip_low=float(_args(args, "clip_lower")), clip_high=float(_args(args, "clip_higher")),
        kl_coef=beta if _args(args, "load_ref_policy") else 0.0, kl_kind=KL_ESTIMATORS[estimator],
        micro_batch_size=int(_args(args, "per_device_train_batch_size")),
        mini_batch_size=None if mini_batches == 1 else batch // mini_batches,
        train_epochs=int(_args(args, "num_epochs")), actor_optimizer=_optimizer_from(args),
        dynamic_sampling=bool(_stream(streaming_config, "filter_zero_std_samples")
                              or _stream(streaming_config, "active_sampling")),
        proximal_recompute=not _args(args, "use_vllm_logprobs"),
        tis_cap=float(_args(args, "rho_clamp_upper_bound")) if _args(args, "use_rho_correction") else None,
        ref_update_every=0,  # the driver calls update_ref_policy, as open-instruct's does
        ref_update_alpha=alpha if 0 < alpha <= 1 else 1.0, sampling=sampling_from(streaming_config),
    )


def strategy_from(args: Any, world_size: int) -> str:
    """naive for one rank; else by `deepspeed_stage` (0/1: ddp, 2: colossalai_zero2, 3: colossalai_gemini)."""
    if world_size == 1:
        return "naive"
    stage = int(_args(args, "deepspeed_stage"))
    if stage not in DEEPSPEED_STAGES:
        raise ValueError(f"ExperimentConfig.deepspeed_stage must be one of {sorted(DEEPSPEED_STAGES)}, got "
                         f"{stage}")
    return DEEPSPEED_STAGES[stage]


def load_policy(model_name_or_path: str, dtype: str, seed: int, tokenizer: Any = None,
                revision: str | None = None) -> Actor:
    """The policy `Actor` from a model spec (a Hub id at `revision`) in `dtype`, with `tokenizer` when given
    (else the model's own)."""
    model, own = load_causal_lm(model_name_or_path, dtype=getattr(torch, dtype), seed=seed, revision=revision)
    return Actor(model, ensure_pad_token(tokenizer) if tokenizer is not None else own)
