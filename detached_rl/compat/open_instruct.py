"""Coming from open-instruct: its GRPO learner actor and driver step, thin over `DetachedGRPOTrainer`.

A migration path, not the primary API (see docs/coming-from-open-instruct.md). What open-instruct's
`grpo_fast.py` names, this module names alike:

* `PolicyTrainerRayProcess`: a learner rank with open-instruct's constructor and methods
  (`from_pretrained`, `setup_model_update_group`, `step`, `broadcast_to_vllm`, `update_ref_policy`,
  `save_model`, `save_checkpoint_state`). It *is* a GRPO trainer actor (`GRPOTrainerShell`): its
  replay buffer takes the makers' pushes, and `step()` is one `TrainerCore.train_step` on them.
  "vLLM engines" are this project's makers (`ExperienceMakerHolder`, any generation backend).
* `ModelGroup`: the ranks, named `<name>_<rank>` so that makers find them.
* `one_training_step`: the driver's step: `step` on every rank, the Polyak reference update, the
  periodic `save_model`, and the ranks' metrics aggregated under open-instruct's names
  (token-weighted where open-instruct weights by tokens), with tokens/s and the learner's MFU.
* `ExperimentConfig`, `ModelConfig`, `StreamingDataLoaderConfig`, `VLLMConfig`: the fields of
  open-instruct's configs this layer reads, with open-instruct's defaults; their own config objects
  work too (fields are read by name, missing ones take these defaults).
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from detached_rl.actors.placement import actor_device
from detached_rl.actors.trainer import TRAINER_GROUPS, GRPOTrainerShell
from detached_rl.actors.transport import dispatch_weight_update, get_all, put_chunk
from detached_rl.algorithms import metrics as names
from detached_rl.algorithms._common import LOG_RATIO_CLAMP
from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.core.checkpoint import has_checkpoint, load_state, save_atomic
from detached_rl.core.experience import Experience
from detached_rl.core.sampling import SamplingConfig
from detached_rl.maker.experience_maker import MakerConfig
from detached_rl.models import Actor, load_causal_lm
from detached_rl.models.export import save_merged
from detached_rl.models.loaders import ensure_pad_token
from detached_rl.strategies import NaiveStrategy, Strategy
from detached_rl.strategies.hardware import device_peak
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

#: Written last by `save_model`; a directory holding it is complete and is not saved again (open-instruct's).
CHECKPOINT_COMPLETE_MARKER = ".checkpoint_complete"
#: open-instruct's `kl_estimator` index -> this project's KL estimator (index 3, ratio * log-ratio, has none).
KL_ESTIMATORS: dict[int, str] = {0: "k1", 1: "k2", 2: "k3"}
#: open-instruct's `advantage_normalization_type` -> this project's advantage estimator.
ADVANTAGE_NORMALIZATIONS: dict[str, str] = {"standard": "grpo", "centered": "dr_grpo"}
#: open-instruct's `deepspeed_stage` -> this project's strategy for more than one rank.
DEEPSPEED_STAGES: dict[int, str] = {0: "ddp", 1: "ddp", 2: "colossalai_zero2", 3: "colossalai_gemini"}
#: The metrics `one_training_step` averages weighted by each rank's tokens (open-instruct's set); others: plain mean.
TOKEN_WEIGHTED_METRICS = frozenset({
    "objective/kl0_avg", "objective/kl1_avg", "objective/kl2_avg", "objective/kl3_avg", "loss/kl_avg",
    "loss/policy_avg", "loss/total_avg", "policy/clipfrac_avg", "policy/entropy_avg", "val/ratio", "val/ratio_var",
    "val/rho_drop_frac", "val/rho_drop_low_frac", "val/rho_drop_high_frac",
})
#: Keys a rank's `step` returns for the driver only (dropped from the logged metrics).
TOKEN_COUNT, SEQUENCE_TOKENS, NUM_PARAMS, PEAK_FLOPS = "_token_count", "_sequence_tokens", "_num_params", "_peak_flops"
#: Array metrics of a rank's step: prompt lengths (one per prompt) and response lengths (one per sample).
PROMPT_LENGTHS, RESPONSE_LENGTHS = "batch/prompt_lengths", "batch/response_lengths"
#: The peaks `learner_mfu` divides by, summed over the ranks (FLOP/s; see `strategies.hardware.device_peak`).
LEARNER_PEAK_FLOPS = "perf/learner_peak_flops"


# ---------------------------------------------------------------------------------------------- configs
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
    """open-instruct's `ModelConfig`: the policy to load (a local Hugging Face directory, "tiny[-<type>]", "smollm2")."""

    model_name_or_path: str = "tiny"
    model_revision: str | None = None  # accepted, unused: nothing is downloaded


@dataclass
class StreamingDataLoaderConfig:
    """The fields of open-instruct's `StreamingDataLoaderConfig` this layer reads (open-instruct's defaults)."""

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
    """A maker's config for one of `vllm_num_engines` "engines": its share of the prompts per batch, one GRPO group
    of `num_samples_per_prompt_rollout` per prompt, the learner's sampling; `overrides` set other fields."""
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
        raise ValueError(f"num_unique_prompts_rollout x num_samples_per_prompt_rollout = {total} must split evenly "
                         f"over world_size {world_size} learner ranks")
    return total // world_size


def trainer_config_from(args: Any, streaming_config: Any, world_size: int) -> TrainerConfig:
    """The trainer's settings: per-rank batch, staleness bound `async_steps`, waits of `backend_timeout` minutes."""
    batch = rank_batch_size(streaming_config, world_size)
    async_steps = _stream(streaming_config, "async_steps")
    return TrainerConfig(train_batch_size=batch, max_staleness=None if async_steps is None else int(async_steps),
                         batch_timeout_s=60.0 * float(_args(args, "backend_timeout")),
                         buffer_max_samples=max(1024, 4 * batch), stop_makers_at_end=False)


def _optimizer_from(args: Any) -> OptimizerConfig:
    schedule = str(_args(args, "lr_scheduler_type")).removesuffix("_with_warmup")
    if schedule not in ("linear", "cosine", "constant"):
        raise ValueError(f"ExperimentConfig.lr_scheduler_type must be linear, cosine, constant or "
                         f"constant_with_warmup, got {_args(args, 'lr_scheduler_type')!r}")
    steps = _args(args, "num_training_steps")
    total = None if steps is None else int(steps) * int(_args(args, "num_epochs")) * int(_args(args, "num_mini_batches"))
    if schedule != "constant" and not total:
        raise ValueError(f"ExperimentConfig.num_training_steps is required by lr_scheduler_type {schedule!r}")
    warmup = int((total or 0) * float(_args(args, "warmup_ratio")))
    return OptimizerConfig(lr=float(_args(args, "learning_rate")), weight_decay=float(_args(args, "weight_decay")),
                           schedule=schedule, warmup_steps=warmup, total_steps=total,
                           max_grad_norm=_args(args, "max_grad_norm"))


def grpo_config_from(args: Any, streaming_config: Any, world_size: int) -> GRPOConfig:
    """This project's GRPO settings for open-instruct's: DAPO-style clipped loss with token-mean aggregation."""
    if _args(args, "loss_fn") != "dapo":
        raise ValueError(f"ExperimentConfig.loss_fn {_args(args, 'loss_fn')!r} is not available here (only 'dapo')")
    if _args(args, "loss_denominator") != "token":
        raise ValueError("ExperimentConfig.loss_denominator must be 'token' here (a constant denominator is not "
                         f"available), got {_args(args, 'loss_denominator')!r}")
    estimator = int(_args(args, "kl_estimator"))
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"ExperimentConfig.kl_estimator must be one of {sorted(KL_ESTIMATORS)}, got {estimator}")
    normalization = _stream(streaming_config, "advantage_normalization_type")
    if normalization not in ADVANTAGE_NORMALIZATIONS:
        raise ValueError(f"StreamingDataLoaderConfig.advantage_normalization_type must be one of "
                         f"{sorted(ADVANTAGE_NORMALIZATIONS)}, got {normalization!r}")
    batch = rank_batch_size(streaming_config, world_size)
    mini_batches = int(_args(args, "num_mini_batches"))
    if mini_batches < 1 or batch % mini_batches:
        raise ValueError(f"ExperimentConfig.num_mini_batches {mini_batches} must divide the per-rank batch {batch}")
    alpha = float(_args(args, "alpha"))
    beta = float(_args(args, "beta"))
    return GRPOConfig(
        algorithm="grpo", advantage_estimator=ADVANTAGE_NORMALIZATIONS[normalization], loss_agg="token-mean",
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
        raise ValueError(f"ExperimentConfig.deepspeed_stage must be one of {sorted(DEEPSPEED_STAGES)}, got {stage}")
    return DEEPSPEED_STAGES[stage]


def load_policy(model_name_or_path: str, dtype: str, seed: int, tokenizer: Any = None) -> Actor:
    """The policy `Actor` from a model spec in `dtype`, with `tokenizer` when given (else the model's own)."""
    model, own = load_causal_lm(model_name_or_path, dtype=getattr(torch, dtype), seed=seed)
    return Actor(model, ensure_pad_token(tokenizer) if tokenizer is not None else own)


# ---------------------------------------------------------------------------------------------- the learner
class SequenceRatioStats:
    """Token-weighted variance over sequences of each sequence's mean ratio new / old (open-instruct's val/ratio_var)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget what was added (once per step)."""
        self._sums: list[torch.Tensor] = []  # [tokens, tokens * mean, tokens * mean^2] per call, float64

    def add(self, log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> None:
        """Add a micro-batch's sequences [B, T] (the ratio clamped as the policy loss clamps it)."""
        with torch.no_grad():
            valid = mask.bool()
            log_ratio = (log_probs.detach() - old_log_probs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            ratio = torch.where(valid, log_ratio.exp(), torch.zeros_like(log_ratio)).double()
            tokens = valid.sum(-1).double()
            means = ratio.sum(-1) / tokens.clamp(min=1)
            self._sums.append(torch.stack([tokens.sum(), (tokens * means).sum(), (tokens * means.square()).sum()]))

    def variance(self) -> float:
        """The variance of what was added (0 without tokens)."""
        if not self._sums:
            return 0.0
        tokens, first, second = torch.stack(self._sums).sum(0).tolist()
        if tokens <= 0:
            return 0.0
        mean = first / tokens
        return max(second / tokens - mean * mean, 0.0)

    def observe(self, loss: Callable[..., Any]) -> Callable[..., Any]:
        """`loss` (a registered policy loss), recording each call's ratios first; its result is unchanged."""

        @functools.wraps(loss)
        def observed(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                     mask: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.add(log_probs, old_log_probs, mask)
            return loss(log_probs, old_log_probs, advantages, mask, *args, **kwargs)

        return observed


class ObservedGRPOLearner(GRPOLearner):
    """`GRPOLearner` that also reports `val/ratio_var` and keeps the last batch's lengths (for the driver's tokens)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ratio_stats = SequenceRatioStats()
        self.policy_loss = self.ratio_stats.observe(self.policy_loss)
        self.last_prompt_lengths: list[int] = []
        self.last_response_lengths: list[int] = []
        self.last_sequence_tokens = 0  # prompt + response tokens of every sample (what the forward passes see)

    def train_step(self, experiences: list[Experience], policy_version: int | None = None) -> dict[str, float]:
        """`GRPOLearner.train_step`, plus `val/ratio_var` (reduced across ranks with the other metrics)."""
        self.ratio_stats.reset()
        self.last_prompt_lengths, self.last_response_lengths = batch_lengths(experiences)
        self.last_sequence_tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in experiences)
        metrics = super().train_step(experiences, policy_version)
        metrics[names.RATIO_VAR] = self.ratio_stats.variance()
        return metrics


def batch_lengths(experiences: Sequence[Experience]) -> tuple[list[int], list[int]]:
    """Prompt lengths (one per group, i.e. per prompt) and response lengths (one per sample)."""
    seen: set[str] = set()
    prompts = []
    for experience in experiences:
        group = experience.group_id if experience.group_id is not None else f"single:{experience.id}"
        if group not in seen:
            seen.add(group)
            prompts.append(len(experience.prompt_ids))
    return prompts, [len(e.response_ids) for e in experiences]


def polyak_update_ref_policy(learner: GRPOLearner, alpha: float) -> bool:
    """ref <- alpha * policy + (1 - alpha) * ref; False (nothing done) without a reference or with alpha <= 0."""
    if learner.reference is None or alpha <= 0:
        return False
    learner.update_ref_policy(alpha)
    return True


def open_instruct_step_metrics(metrics: Mapping[str, float], beta: float, kl_kind: str) -> dict[str, float]:
    """A step's metrics with open-instruct's names and meanings added: `lr`, `optim/grad_norm`, the KL as
    `objective/kl<j>_avg` and `loss/kl_avg` = beta x KL (open-instruct logs the KL term with its coefficient)."""
    out = dict(metrics)
    for theirs, ours in names.OPEN_INSTRUCT_ALIASES.items():
        if ours in metrics:
            out[theirs] = metrics[ours]
    index = {kind: j for j, kind in KL_ESTIMATORS.items()}.get(kl_kind)
    if names.LOSS_KL in metrics and index is not None:
        out[f"objective/kl{index}_avg"] = metrics[names.LOSS_KL]
        out[names.LOSS_KL] = beta * metrics[names.LOSS_KL]
    return out


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _current_actor_name() -> str | None:
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return context.get_actor_name() if context.worker.mode == ray.WORKER_MODE else None


def _maker_name(engine: Any, timeout: float) -> str:
    """A maker's name: `engine` itself when a string, else what its `status()` says."""
    return engine if isinstance(engine, str) else ray.get(engine.status.remote(), timeout=timeout)["name"]


class PolicyTrainerProcess(GRPOTrainerShell):
    """open-instruct's `PolicyTrainerRayProcess` over this project's GRPO trainer (the Ray class: below).

    Built by `from_pretrained`, not by the constructor (as open-instruct's). `name` is the name makers push
    to (default: the actor's Ray name); `strategy` overrides the one `deepspeed_stage` picks; `master`, rank 0's
    handle, stands in for `master_addr`/`master_port` (asked in `from_pretrained`, so that all ranks start at once).
    """

    def __init__(self, world_size: int, rank: int, local_rank: int = 0, master_addr: str | None = None,
                 master_port: int | None = None, args: Any = None, streaming_config: Any = None,
                 vllm_config: Any = None, tokenizer: Any = None, *, name: str | None = None,
                 namespace: str | None = None, strategy: str | None = None, master: Any = None) -> None:
        if namespace is None and ray.is_initialized():
            namespace = ray.get_runtime_context().namespace
        # "ddp" defers building to from_pretrained (a "naive" shell builds in its constructor).
        super().__init__(name or _current_actor_name() or f"policy_trainer_{rank}", _not_loaded,
                         TrainerConfig(), None, namespace, rank, world_size, "ddp")
        self.strategy_name = strategy or strategy_from(args, world_size)
        self.local_rank = local_rank
        self.args, self.streaming_config, self.vllm_config, self.tokenizer = args, streaming_config, vllm_config, tokenizer
        self._master: tuple[str, int] | None = None
        self._master_actor = master
        if master_addr is not None and master_port is not None:
            self._master = (master_addr, int(master_port))
        elif rank == 0 and world_size > 1:
            self._master = self.master_address()

    def get_master_addr_port(self) -> tuple[str, int]:
        """The process group's address and port: rank 0 picks them; the other ranks take them from their
        constructor or ask rank 0 (`master`)."""
        if self._master is None and self._master_actor is not None:
            self._master = tuple(ray.get(self._master_actor.get_master_addr_port.remote()))
        if self._master is None:
            raise ValueError(f"learner rank {self.rank}: no master_addr/master_port (only rank 0 picks them)")
        return self._master

    def _make_learner(self, strategy: Strategy) -> ObservedGRPOLearner:
        return ObservedGRPOLearner(self.model_factory(), strategy, self.algorithm, sampling=self.sampling)

    @ray.method(concurrency_group="compute")
    def from_pretrained(self, args: Any, model_config: Any, beaker_config: Any = None, wandb_url: str | None = None,
                        tokenizer: Any = None) -> dict[str, Any]:
        """Load the policy, build optimizer and reference, join the ranks, resume from `args.checkpoint_state_dir`.

        Returns {"optimization_steps_done": steps of the restored checkpoint (0 without one), "checkpoint_state":
        the `client_state` saved with it (None without one)}.
        """
        self.args = args
        self.tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        _seed_everything(int(_args(args, "seed")) + self.rank)
        self.config = trainer_config_from(args, self.streaming_config, self.world_size)
        self.algorithm = grpo_config_from(args, self.streaming_config, self.world_size)
        self.sampling = self.algorithm.sampling
        self.model_factory = functools.partial(
            load_policy, str(_field(model_config, "model_name_or_path", ModelConfig)),
            str(_args(args, "model_dtype")), int(_args(args, "seed")), self.tokenizer)
        if self.strategy_name == "naive":
            if self.world_size != 1:
                raise ValueError(f"learner {self.name!r}: strategy 'naive' trains one rank, not {self.world_size}")
            self._build(NaiveStrategy(device=actor_device()))
        else:
            address, port = self.get_master_addr_port()
            self.join_process_group(address, port, {"timeout_s": 60.0 * float(_args(args, "backend_timeout"))})
        return self._resume(_args(args, "checkpoint_state_dir"))

    def _resume(self, directory: str | None) -> dict[str, Any]:
        core = self._core()
        found = directory is not None and has_checkpoint(Path(directory) / f"rank_{self.rank}")
        every = core.strategy.all_gather_object(found)
        if not any(every):
            if directory is not None:
                logger.info("learner %s: no checkpoint state in %s, starting at step 0", self.name, directory)
            return {"optimization_steps_done": 0, "checkpoint_state": None}
        if not all(every):
            raise ValueError(f"{directory}: only ranks {[r for r, f in enumerate(every) if f]} have checkpoint "
                             f"state; every one of the {len(every)} ranks needs its rank_<r> folder")
        core.load_checkpoint(directory, put_chunk)
        return {"optimization_steps_done": core.policy_version,
                "checkpoint_state": self._client_state(Path(directory), core.policy_version)}

    def _client_state(self, directory: Path, version: int) -> dict[str, Any] | None:
        path = directory / f"client_state_rank_{self.rank}"
        if not has_checkpoint(path):
            return None
        saved = load_state(path)
        if saved["policy_version"] != version:
            logger.warning("learner %s: client state in %s is of step %s, the checkpoint of step %s; not returned",
                           self.name, path, saved["policy_version"], version)
            return None
        return saved["client_state"]

    @ray.method(concurrency_group="model_io")
    def setup_model_update_group(self, vllm_engines: Sequence[Any]) -> None:
        """Have `broadcast_to_vllm` send weights to these makers (handles or names; they also register themselves)."""
        core = self._core()
        core.makers.update(_maker_name(engine, self.config.weight_push_timeout_s) for engine in vllm_engines)

    @ray.method(concurrency_group="compute")
    def step(self) -> tuple[dict[str, float], dict[str, list[int]]]:
        """One training step on what the makers pushed; returns (scalar metrics, array metrics) of this rank.

        The scalars are already token-weighted over all ranks (the strategy reduces them in the step);
        `_token_count` and the other "_" keys are this rank's, for the driver.
        """
        core = self._core()
        core.state = "training"
        try:
            metrics = core.train_step()
        except BaseException as error:
            core.state, core.last_error = "failed", f"{type(error).__name__}: {error}"
            raise
        core.history.append(metrics)
        learner: ObservedGRPOLearner = core.learner
        out = open_instruct_step_metrics(metrics, self.algorithm.kl_coef, self.algorithm.kl_kind)
        prompts, responses = learner.last_prompt_lengths, learner.last_response_lengths
        out.update({TOKEN_COUNT: float(sum(responses)), SEQUENCE_TOKENS: float(learner.last_sequence_tokens),
                    NUM_PARAMS: float(learner.num_parameters),
                    PEAK_FLOPS: device_peak(core.strategy.device, matmul_dtype(learner)).value})
        return out, {PROMPT_LENGTHS: list(prompts), RESPONSE_LENGTHS: list(responses)}

    @ray.method(concurrency_group="compute")
    def broadcast_to_vllm(self, model_step: int | None = None) -> dict[str, float]:
        """Push the current weights to this rank's share of the makers (call on every rank); returns sync metrics.

        `model_step` is accepted for open-instruct's signature: the update carries the policy version.
        """
        core = self._core()

        def send(update: Any, makers: list[str]) -> Mapping[str, Any]:
            return dispatch_weight_update(update, makers, self.namespace, self.config.weight_push_timeout_s)()

        return core.sync_weights(put_chunk, send)

    @ray.method(concurrency_group="compute")
    def update_ref_policy(self) -> None:
        """Polyak update of the reference: ref <- alpha * policy + (1 - alpha) * ref (no reference: nothing)."""
        core = self._core()
        with core.weights_lock:
            polyak_update_ref_policy(core.learner, float(_args(self.args, "alpha")))

    @ray.method(concurrency_group="compute")
    def save_checkpoint_state(self, checkpoint_state_dir: str, client_state: dict[str, Any]) -> None:
        """Save policy, reference, optimizer, schedule, buffer and RNG states, and `client_state` (call on every rank)."""
        core = self._core()
        core.save_checkpoint(checkpoint_state_dir)
        state = {"policy_version": core.policy_version, "client_state": {**client_state, "rank": self.rank}}
        save_atomic(state, Path(checkpoint_state_dir) / f"client_state_rank_{self.rank}")

    @ray.method(concurrency_group="compute")
    def save_model(self, output_dir: str, chat_template_name: str | None = None, tokenizer: Any = None) -> None:
        """Write the policy (LoRA merged) and tokenizer as a Hugging Face directory (call on every rank; rank 0
        writes); a directory already marked complete is left as it is."""
        path = Path(output_dir)
        if (path / CHECKPOINT_COMPLETE_MARKER).exists():
            logger.info("model already saved completely at %s, skipping", path)
            return
        core = self._core()
        strategy = core.strategy
        with core.weights_lock:
            policy = strategy.unwrap(core.learner.actor)
            gathered = dict(strategy.named_tensors(core.learner.actor, "model.")) if strategy.shards_weights else None
            if not strategy.is_rank_zero:
                return
            tokenizer = tokenizer if tokenizer is not None else policy.tokenizer
            if gathered is None:
                save_merged(policy.model, tokenizer, path)
            else:
                policy.model.save_pretrained(path, state_dict=gathered, safe_serialization=True)
                tokenizer.save_pretrained(path)
        (path / CHECKPOINT_COMPLETE_MARKER).touch()


def matmul_dtype(learner: GRPOLearner) -> str:
    """The dtype the learner's matmuls run in: its autocast dtype, else the policy's bf16/fp16, else float32."""
    if learner.config.autocast_dtype is not None:
        return learner.config.autocast_dtype
    dtype = str(next(learner.policy.model.parameters()).dtype).removeprefix("torch.")
    return dtype if dtype in ("bfloat16", "float16") else "float32"


def _not_loaded() -> Any:
    raise RuntimeError("the learner's model is loaded by from_pretrained")


#: The learner rank as a Ray actor class (`.options(...)` as usual; `ModelGroup` creates the ranks).
PolicyTrainerRayProcess = ray.remote(concurrency_groups=TRAINER_GROUPS)(PolicyTrainerProcess)


# ---------------------------------------------------------------------------------------------- the ranks
def bundle_index(rank: int, num_gpus_per_node: Sequence[int]) -> int:
    """The placement-group bundle (node) of `rank` when node i holds `num_gpus_per_node[i]` ranks."""
    for index, count in enumerate(num_gpus_per_node):
        if rank < count:
            return index
        rank -= count
    raise ValueError(f"rank beyond the {sum(num_gpus_per_node)} ranks of num_gpus_per_node {list(num_gpus_per_node)}")


class ModelGroup:
    """open-instruct's `ModelGroup`: `sum(num_gpus_per_node)` learner ranks, named `<name>_<rank>` in `namespace`.

    `pg` (a placement group with one bundle per node, or None) places rank r on bundle `bundle_index(r, ...)`.
    Each rank asks for `num_gpus_per_actor` GPUs: None means open-instruct's (1, or 0.48 with `single_gpu_mode`)
    on a cluster with GPUs, and 0 on one without.
    """

    def __init__(self, pg: Any, ray_process_cls: Any, num_gpus_per_node: Sequence[int], single_gpu_mode: bool,
                 args: Any, streaming_config: Any, vllm_config: Any, tokenizer: Any, *, name: str = "policy_trainer",
                 namespace: str | None = None, num_gpus_per_actor: float | None = None,
                 num_cpus_per_actor: float = 1.0) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = sum(num_gpus_per_node)
        if world_size < 1:
            raise ValueError(f"ModelGroup: num_gpus_per_node {list(num_gpus_per_node)} holds no rank")
        if num_gpus_per_actor is None:
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            num_gpus_per_actor = (0.48 if single_gpu_mode else 1.0) if has_gpus else 0.0
        self.namespace = namespace or ray.get_runtime_context().namespace
        self.names = [f"{name}_{rank}" for rank in range(world_size)]
        self.pg = pg

        def create(rank: int, master: Any) -> Any:
            options: dict[str, Any] = {"name": self.names[rank], "namespace": self.namespace,
                                       "num_cpus": num_cpus_per_actor, "num_gpus": num_gpus_per_actor}
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle_index(rank, num_gpus_per_node))
            return ray_process_cls.options(**options).remote(world_size, rank, 0, None, None, args, streaming_config,
                                                             vllm_config, tokenizer, name=self.names[rank],
                                                             namespace=self.namespace, master=master)

        # Every rank starts at once; ranks > 0 ask rank 0 for the process group's address in from_pretrained.
        self.models = [create(0, None)]
        self.models += [create(rank, self.models[0]) for rank in range(1, world_size)]

    def stop(self, timeout: float = 60.0) -> None:
        """Free every rank's models together (a DDP model freed alone can hang), then kill the ranks."""
        try:
            get_all([model.shutdown.remote() for model in self.models], timeout=timeout)
        except Exception as error:  # noqa: BLE001 - killing them below is what matters
            logger.warning("learner ranks %s did not shut down cleanly: %s", self.names, error)
        for model in self.models:
            ray.kill(model, no_restart=True)


# ---------------------------------------------------------------------------------------------- the driver
def compute_token_weights(metrics_list: Sequence[Mapping[str, float]]) -> list[float]:
    """Each rank's share of the step's tokens (`_token_count`; equal shares when there are none)."""
    counts = [float(m.get(TOKEN_COUNT, 1.0)) for m in metrics_list]
    total = sum(counts)
    if total > 0:
        return [count / total for count in counts]
    return [1.0 / len(metrics_list)] * len(metrics_list)


def average_rank_metrics(metrics_list: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The ranks' scalar metrics as one: token-weighted for `TOKEN_WEIGHTED_METRICS`, else the plain mean; a key
    some ranks lack (a rank's staleness histogram, `info/...`) is averaged over the ranks that have it; the
    driver-only "_" keys are left out."""
    averaged = {}
    for key in dict.fromkeys(key for metrics in metrics_list for key in metrics):
        if key.startswith("_"):
            continue
        having = [metrics for metrics in metrics_list if key in metrics]
        if key in TOKEN_WEIGHTED_METRICS:
            averaged[key] = sum(m[key] * w for m, w in zip(having, compute_token_weights(having), strict=True))
        else:
            averaged[key] = sum(m[key] for m in having) / len(having)
    return averaged


def learner_mfu(flops_per_token: float, sequence_tokens: float, training_time: float, peak_flops: float) -> float:
    """Learner MFU in percent: the step's model FLOPs per second over the ranks' summed dense matmul peaks."""
    if training_time <= 0 or peak_flops <= 0:
        return 0.0
    return 100.0 * flops_per_token * sequence_tokens / training_time / peak_flops


def training_step_metrics(
    rank_metrics: Sequence[Mapping[str, float]],
    rank_arrays: Sequence[Mapping[str, Any]],
    *,
    episode: int,
    training_step: int,
    num_total_tokens: int,
    step_time: float,
    total_training_time: float,
    training_time: float,
    save_time: float = 0.0,
    data_thread_metrics: Mapping[str, Any] | None = None,
    samples_per_prompt: int = 1,
    train_dataset_size: int | None = None,
    num_params: float | None = None,
) -> tuple[dict[str, Any], int]:
    """What `one_training_step` logs for the ranks' `step` results, and the step's token count.

    MFU counts 6 x `num_params` FLOPs (2 forward, 4 backward) per prompt + response token of every sample
    (the attention's sequence-length term is left out); `num_params` defaults to the ranks' model size.
    """
    averaged = average_rank_metrics(rank_metrics)
    averaged.update(rank_arrays[0])  # as open-instruct: the first rank's arrays
    step_tokens = sum(sum(a[PROMPT_LENGTHS]) + sum(a[RESPONSE_LENGTHS]) for a in rank_arrays)
    params = num_params if num_params is not None else rank_metrics[0][NUM_PARAMS]
    peak = sum(float(m[PEAK_FLOPS]) for m in rank_metrics)
    sequence_tokens = sum(float(m[SEQUENCE_TOKENS]) for m in rank_metrics)
    metrics: dict[str, Any] = {
        "episode": episode,
        "global_step": episode,
        "training_step": training_step,
        names.NUM_TOTAL_TOKENS: num_total_tokens,
        names.NUM_STEP_TOKENS: step_tokens,
        names.TOKENS_PER_SECOND_OVERALL: num_total_tokens / total_training_time if total_training_time > 0 else 0.0,
        names.TOKENS_PER_SECOND_STEP: step_tokens / step_time if step_time > 0 else 0.0,
        "time/total": step_time,
        names.TIME_TRAINING: training_time,
        "time/saving": save_time,
        **(data_thread_metrics or {}),
        **averaged,
        names.LEARNER_MFU: learner_mfu(6.0 * float(params), sequence_tokens, training_time, peak),
        LEARNER_PEAK_FLOPS: peak,
    }
    if train_dataset_size:
        metrics["epoch"] = episode / samples_per_prompt / train_dataset_size
    return metrics, step_tokens


def maybe_save_checkpoint(args: Any, training_step: int, policy_group: ModelGroup, chat_template_name: str | None,
                          tokenizer: Any, wandb_url: str | None = None) -> float:
    """Every `save_freq` steps (and at step 1 with `eval_on_step_0`), `save_model` to
    `<output_dir>_checkpoints/step_<n>` on every rank; returns the seconds it took (0 when not saving)."""
    save_freq = int(_args(args, "save_freq"))
    due = save_freq > 0 and ((_args(args, "eval_on_step_0") and training_step == 1)
                             or (training_step % save_freq == 0 and training_step > 1))
    if not due:
        return 0.0
    start = time.perf_counter()
    step_dir = f"{str(_args(args, 'output_dir')).rstrip('/')}_checkpoints/step_{training_step}"
    ray.get([model.save_model.remote(step_dir, chat_template_name, tokenizer) for model in policy_group.models])
    return time.perf_counter() - start


def one_training_step(
    args: Any,
    streaming_config: Any,
    vllm_config: Any = None,
    policy_group: ModelGroup | None = None,
    tokenizer: Any = None,
    data_thread_metrics: Mapping[str, Any] | None = None,
    episode: int = 0,
    training_step: int = 1,
    num_total_tokens: int = 0,
    start_time: float | None = None,
    train_dataset: Any = None,
    training_start_time: float | None = None,
    wandb_url: str | None = None,
    chat_template_name: str | None = None,
    model_dims: Any = None,
    actor_manager: Any = None,
    *,
    log_metrics: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """open-instruct's driver step: `step` on every rank, the Polyak reference update every
    `ref_policy_update_freq` steps, `maybe_save_checkpoint`, the metrics aggregated and handed to `log_metrics`
    (else logged); returns the step's tokens (prompts once, every response).

    `model_dims` may give `num_params` for MFU (default: the ranks' parameter count); `actor_manager`, if
    given, is told the training time as open-instruct's is.
    """
    if policy_group is None:
        raise ValueError("one_training_step: policy_group is required")
    now = time.perf_counter()
    start_time = now if start_time is None else start_time
    training_start_time = start_time if training_start_time is None else training_start_time
    train_start = time.perf_counter()
    results = ray.get([model.step.remote() for model in policy_group.models])
    frequency = _args(args, "ref_policy_update_freq")
    if (_args(args, "load_ref_policy") and frequency is not None and training_step % int(frequency) == 0
            and float(_args(args, "alpha")) > 0):
        ray.get([model.update_ref_policy.remote() for model in policy_group.models])
    training_time = time.perf_counter() - train_start
    save_time = maybe_save_checkpoint(args, training_step, policy_group, chat_template_name, tokenizer, wandb_url)
    if actor_manager is not None:
        ray.get(actor_manager.report_training_step_time.remote(training_time))
    rank_metrics, rank_arrays = zip(*results, strict=True)
    metrics, step_tokens = training_step_metrics(
        rank_metrics, rank_arrays, episode=episode, training_step=training_step, num_total_tokens=num_total_tokens,
        step_time=time.perf_counter() - start_time, total_training_time=time.perf_counter() - training_start_time,
        training_time=training_time, save_time=save_time, data_thread_metrics=data_thread_metrics,
        samples_per_prompt=int(_stream(streaming_config, "num_samples_per_prompt_rollout")),
        train_dataset_size=len(train_dataset) if train_dataset is not None else None,
        num_params=getattr(model_dims, "num_params", None),
    )
    if log_metrics is not None:
        log_metrics(metrics)
    else:
        logger.info("step %d: %s", training_step, {k: v for k, v in metrics.items() if isinstance(v, int | float)})
    return step_tokens
