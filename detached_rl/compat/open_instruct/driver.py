"""open-instruct's driver step: rank metrics averaged, MFU, periodic saving, `one_training_step`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

from detached_rl.algorithms import metrics as names
from detached_rl.compat.open_instruct.config import _args, _stream
from detached_rl.compat.open_instruct.group import ModelGroup
from detached_rl.compat.open_instruct.keys import (
    NUM_PARAMS,
    PEAK_FLOPS,
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    SEQUENCE_TOKENS,
    TOKEN_COUNT,
)

logger = logging.getLogger(__name__)

#: The metrics `one_training_step` averages weighted by each rank's tokens (open-instruct's set); others:
#: plain mean.
TOKEN_WEIGHTED_METRICS = frozenset({
    "objective/kl0_avg", "objective/kl1_avg", "objective/kl2_avg", "objective/kl3_avg", "loss/kl_avg",
    "loss/policy_avg", "loss/total_avg", "policy/clipfrac_avg", "policy/entropy_avg", "val/ratio",
    "val/ratio_var", "val/rho_drop_frac", "val/rho_drop_low_frac", "val/rho_drop_high_frac",
})
#: The peaks `learner_mfu` divides by, summed over the ranks (FLOP/s; see `strategies.hardware.device_peak`).
LEARNER_PEAK_FLOPS = "perf/learner_peak_flops"


def compute_token_weights(metrics_list: Sequence[Mapping[str, float]]) -> list[float]:
    """Each rank's share of the step's tokens (`_token_count`; equal shares when there are none)."""
    counts = [float(m.get(TOKEN_COUNT, 1.0)) for m in metrics_list]
    total = sum(counts)
    if total > 0:
        return [count / total for count in counts]
    return [1.0 / len(metrics_list)] * len(metrics_list)


def average_rank_metrics(metrics_list: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The ranks' scalar metrics as one: token-weighted for `TOKEN_WEIGHTED_METRICS`, else the plain mean; a
    key some ranks lack (a rank's staleness histogram, `info/...`) is averaged over the ranks that have it;
    the driver-only "_" keys are left out."""
    averaged = {}
    for key in dict.fromkeys(key for metrics in metrics_list for key in metrics):
        if key.startswith("_"):
            continue
        having = [metrics for metrics in metrics_list if key in metrics]
        if key in TOKEN_WEIGHTED_METRICS:
            averaged[key] = sum(m[key] * w
                                for m, w in zip(having, compute_token_weights(having), strict=True))
        else:
            averaged[key] = sum(m[key] for m in having) / len(having)
    return averaged


def learner_mfu(flops_per_token: float, sequence_tokens: float, training_time: float,
                peak_flops: float) -> float:
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
        names.TOKENS_PER_SECOND_OVERALL: (num_total_tokens / total_training_time
                                          if total_training_time > 0 else 0.0),
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


def maybe_save_checkpoint(args: Any, training_step: int, policy_group: ModelGroup,
                          chat_template_name: str | None, tokenizer: Any,
                          wandb_url: str | None = None) -> float:
    """Every `save_freq` steps (and at step 1 with `eval_on_step_0`), `save_model` to
    `<output_dir>_checkpoints/step_<n>` on every rank; returns the seconds it took (0 when not saving)."""
    save_freq = int(_args(args, "save_freq"))
    due = save_freq > 0 and ((_args(args, "eval_on_step_0") and training_step == 1)
                             or (training_step % save_freq == 0 and training_step > 1))
    if not due:
        return 0.0
    start = time.perf_counter()
    step_dir = f"{str(_args(args, 'output_dir')).rstrip('/')}_checkpoints/step_{training_step}"
    ray.get([model.save_model.remote(step_dir, chat_template_name, tokenizer)
             for model in policy_group.models])
    return time.perf_counter() - start


def one_training_step(
    args: Any,
    streaming_config: Any,
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
    vllm_config: Any = None,
    log_metrics: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """open-instruct's driver step: `step` on every rank, the Polyak reference update every
    `ref_policy_update_freq` steps, `maybe_save_checkpoint`, the metrics aggregated and handed to
    `log_metrics` (else logged); returns the step's tokens (prompts once, every response).

    The arguments come in open-instruct's order; `vllm_config` (keyword only) is accepted and unused.
    `model_dims` may give `num_params` for MFU (default: the ranks' parameter count); `actor_manager`, if
    given, is told the training time as open-instruct's is.
    """
    del vllm_config  # makers, not the driver, read it here
    if policy_group is None:
        raise ValueError("one_training_step: policy_group is required")
    if not hasattr(policy_group, "models"):
        raise TypeError(f"one_training_step: policy_group must be a ModelGroup, got "
                        f"{type(policy_group).__name__} (open-instruct's order: args, streaming_config, "
                        "policy_group, tokenizer, ...; vllm_config only by name)")
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
    save_time = maybe_save_checkpoint(args, training_step, policy_group, chat_template_name, tokenizer,
                                      wandb_url)
    if actor_manager is not None:
        ray.get(actor_manager.report_training_step_time.remote(training_time))
    rank_metrics, rank_arrays = zip(*results, strict=True)
    metrics, step_tokens = training_step_metrics(
        rank_metrics, rank_arrays, episode=episode, training_step=training_step,
        num_total_tokens=num_total_tokens, step_time=time.perf_counter() - start_time,
        total_training_time=time.perf_counter() - training_start_time,
        training_time=training_time, save_time=save_time, data_thread_metrics=data_thread_metrics,
        samples_per_prompt=int(_stream(streaming_config, "num_samples_per_prompt_rollout")),
        train_dataset_size=len(train_dataset) if train_dataset is not None else None,
        num_params=getattr(model_dims, "num_params", None),
    )
    if log_metrics is not None:
        log_metrics(metrics)
    else:
        logger.info("step %d: %s", training_step,
                    {k: v for k, v in metrics.items() if isinstance(v, int | float)})
    return step_tokens
