"""Train/inference mismatch: which engine made the behaviour log-probs, when the trainer corrects for them,
and by how much they differ.

Engines. Every generation backend names the engine its behaviour log-probs come from,
``"<backend>:<dtype>"`` (``engine_name``): ``"hf:float32"`` for Hugging Face ``generate`` in float32,
``"vllm:bfloat16"`` for vLLM in bfloat16; the dtype is torch's name without ``torch.``. The maker
stamps it into ``Experience.info["engine"]``. An experience without the tag (made before tags
existed) counts as ``UNKNOWN_ENGINE`` ("hf:<unknown>"), which is taken to match the trainer exactly.
The trainer's own engine is ``trainer_engine``: ``"hf:<dtype of its parameters>"``, or
``"hf:autocast-<dtype>"`` when its forward passes run under autocast (no maker reproduces those).

Correction. The PPO ratio's "old" policy is the behaviour policy only when the behaviour log-probs
are what the trainer would compute itself: fresh samples (staleness 0), one pass over the batch,
the trainer's engine. Otherwise (``needs_behaviour_correction``) the trainer recomputes the old
log-probs with its current weights (the proximal policy) and weights each token by the truncated
importance weight min(pi_old / pi_behaviour, tis_cap) (``apply_behaviour_correction``).

Conventions (see ``_common``): token tensors are ``[B, T]`` (any shape works: everything is
elementwise or a reduction over all positions); ``mask`` marks valid response tokens (nonzero =
valid). A valid token whose behaviour or recomputed log-prob is not finite (-inf: a bf16 engine
sampled a token at the top-k/top-p boundary that the float32 recompute filters out; NaN) is left
out of every statistic, gets loss weight 0, and is counted in ``mismatch/masked_tokens``. Every
metric is a detached 0-d float tensor (one device-to-host transfer reads them all).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from detached_rl.algorithms import metrics as names
from detached_rl.algorithms._common import LOG_RATIO_CLAMP, bool_mask, check_shape
from detached_rl.algorithms.kl import kl_estimate
from detached_rl.algorithms.losses import truncated_importance_weight
from detached_rl.algorithms.masks import masked_mean, masked_sum
from detached_rl.core.experience_batch import ExperienceBatch

#: The `Experience.info` key of the engine tag.
ENGINE_KEY = "engine"
#: The engine of an experience without a tag: taken to be the trainer's own (exact) engine.
UNKNOWN_ENGINE = "hf:<unknown>"


def engine_name(backend: str, dtype: torch.dtype | str) -> str:
    """The engine tag "<backend>:<dtype>", e.g. "hf:float32" or "vllm:bfloat16" (dtype without "torch.")."""
    return f"{backend}:{str(dtype).removeprefix('torch.')}"


def module_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of `model`'s first floating-point parameter (float32 for a model without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def trainer_engine(model: nn.Module, autocast_dtype: str | None = None) -> str:
    """The engine of a trainer's recompute: "hf:<parameter dtype>", or
    "hf:autocast-<dtype>" under autocast."""
    if autocast_dtype is not None:
        return engine_name("hf", f"autocast-{autocast_dtype}")
    return engine_name("hf", module_dtype(model))


def backend_engine(backend: object, backend_name: str) -> str:
    """A generation backend's `engine`; a backend that names none: "<backend_name>:<unknown>"."""
    engine = getattr(backend, "engine", None)
    return engine if isinstance(engine, str) and engine else f"{backend_name}:<unknown>"


def experience_engine(info: Mapping[str, Any]) -> str:
    """The engine an experience's behaviour log-probs came from (`info["engine"]`;
    untagged: UNKNOWN_ENGINE)."""
    engine = info.get(ENGINE_KEY)
    return engine if isinstance(engine, str) and engine else UNKNOWN_ENGINE


def needs_behaviour_correction(
    staleness: Sequence[int] | None, multi_pass: bool, engines: Iterable[str], own_engine: str
) -> bool:
    """True when the behaviour log-probs cannot stand in for the trainer's "old" log-probs.

    That is: any sample is stale (staleness > 0; None: versions unknown, taken as fresh), the
    batch is trained on in more than one pass (epochs or mini-batches), or any sample's engine
    differs from `own_engine` (UNKNOWN_ENGINE counts as the trainer's own).
    """
    if multi_pass or (staleness is not None and any(s > 0 for s in staleness)):
        return True
    return any(engine not in (UNKNOWN_ENGINE, own_engine) for engine in engines)


def finite_token_mask(mask: torch.Tensor, *log_probs: torch.Tensor | None) -> torch.Tensor:
    """Bool mask of the valid tokens where every given log-prob tensor is finite
    (None entries are skipped)."""
    fn = "finite_token_mask"
    kept = mask if mask.dtype == torch.bool else mask != 0
    for index, values in enumerate(log_probs):
        if values is not None:
            check_shape(fn, f"log_probs[{index}]", values, "mask", mask)
            kept = kept & torch.isfinite(values)
    return kept


def mismatch_metrics(
    behaviour_log_probs: torch.Tensor,
    recomputed_log_probs: torch.Tensor,
    mask: torch.Tensor,
    tis_cap: float | None = None,
) -> dict[str, torch.Tensor]:
    """How far the behaviour log-probs are from the trainer's recompute of them, over the valid tokens.

    Conventions: inputs share one shape ([B, T]); valid = mask and both log-probs finite. With
    d = recomputed - behaviour: `mismatch/kl` = mean k3 estimate of KL(behaviour || recomputed)
    (``kl_estimate(behaviour, recomputed, "k3")``: exp(d) - d - 1, d clamped to ±20, the estimate
    to 10), `mismatch/mean_abs_log_prob_diff` and `mismatch/max_abs_log_prob_diff` = mean and max of
    |d|, `mismatch/tis_clipped_fraction` = share whose weight exp(d) exceeds `tis_cap` (0 with None),
    all over valid tokens (0 with none); `mismatch/masked_tokens` = count of mask tokens left out
    for a non-finite log-prob.
    """
    fn = "mismatch_metrics"
    check_shape(fn, "recomputed_log_probs", recomputed_log_probs, "behaviour_log_probs", behaviour_log_probs)
    m = bool_mask(fn, mask, "behaviour_log_probs", behaviour_log_probs)
    if tis_cap is not None and not tis_cap > 0:
        raise ValueError(f"{fn}: tis_cap must be > 0 or None, got {tis_cap}")
    with torch.no_grad():
        valid = finite_token_mask(m, behaviour_log_probs, recomputed_log_probs)
        zero = torch.zeros_like(behaviour_log_probs)
        behaviour = torch.where(valid, behaviour_log_probs, zero)
        recomputed = torch.where(valid, recomputed_log_probs, zero)
        abs_diff = (recomputed - behaviour).abs()
        if tis_cap is None:
            clipped = torch.zeros_like(abs_diff)
        else:
            log_ratio = (recomputed - behaviour).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            clipped = (torch.exp(log_ratio) > tis_cap).to(abs_diff.dtype)
        out = {
            names.MISMATCH_KL: masked_mean(kl_estimate(behaviour, recomputed, "k3"), valid),
            names.MISMATCH_MEAN_ABS_DIFF: masked_mean(abs_diff, valid),
            names.MISMATCH_MAX_ABS_DIFF: (torch.where(valid, abs_diff, zero).max() if abs_diff.numel()
                                          else zero.sum()),
            names.MISMATCH_TIS_CLIPPED: masked_mean(clipped, valid),
            names.MISMATCH_MASKED_TOKENS: masked_sum(torch.ones_like(abs_diff), m & ~valid),
        }
    return {key: value.detach().float() for key, value in out.items()}


def apply_behaviour_correction(
    batch: ExperienceBatch, recomputed_log_probs: torch.Tensor | None, tis_cap: float | None
) -> dict[str, torch.Tensor]:
    """Set `batch.old_log_probs` and `batch.loss_weights`; return the mismatch metrics (none without a
    recompute).

    Without a recompute (None) the old policy is the behaviour policy and every weight is 1. With
    one, old = the recompute and each token is weighted by ``truncated_importance_weight(behaviour,
    old, tis_cap)`` (1 with tis_cap None); in both cases tokens whose behaviour or old log-prob is
    not finite get weight 0 (and padding 0).
    """
    mask, behaviour = batch.response_mask, batch.log_probs
    if recomputed_log_probs is None:
        batch.old_log_probs = behaviour
        batch.loss_weights = finite_token_mask(mask, behaviour).to(behaviour.dtype)
        return {}
    batch.old_log_probs = recomputed_log_probs
    if tis_cap is None:
        batch.loss_weights = finite_token_mask(mask, behaviour, recomputed_log_probs).to(behaviour.dtype)
    else:
        batch.loss_weights = truncated_importance_weight(behaviour, recomputed_log_probs, tis_cap, mask)
    return mismatch_metrics(behaviour, recomputed_log_probs, mask, tis_cap)


def masked_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, mask: torch.Tensor,
              kind: str) -> torch.Tensor:
    """Per-token ``kl_estimate`` [B, T], 0 at padding and wherever either log-prob is not finite."""
    valid = finite_token_mask(mask, log_probs, ref_log_probs)
    zero = torch.zeros_like(log_probs)
    kl = kl_estimate(torch.where(valid, log_probs, zero), torch.where(valid, ref_log_probs, zero), kind)
    return torch.where(valid, kl, zero)
