"""The GRPO family on experience groups: GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE++ (and its group baseline).

`GRPOLearner` is the plain class inside `DetachedGRPOTrainer`. It is critic-free: advantages
come from the rewards of the other responses to the same prompt (the maker's `group_size`
responses share a `group_id`). The variants and their settings are in `grpo_config` (`PRESETS`,
`GRPOConfig`); batches of whole groups and dynamic sampling in `grpo_batches`.

Off-policy control: the PPO ratio's "old" policy is the behaviour policy when every sample in
the batch is fresh (staleness 0, one pass over the batch) and came from the trainer's own engine;
otherwise the trainer recomputes the old log-probs with its current weights before updating (the
proximal policy), weights each token by a truncated importance weight min(pi_old / pi_behaviour,
`tis_cap`) and reports the train/inference mismatch (`detached_rl.algorithms.mismatch`).

The reference model (only when `kl_coef` > 0) lives on the trainer: a frozen copy of the
initial policy, optionally moved towards the policy by `update_ref_policy` (Polyak averaging). Its
log-probs use the makers' temperature over the full vocabulary (`reference_sampling`: no top-k/top-p).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from detached_rl.algorithms import metrics as names
from detached_rl.algorithms._common import LOG_RATIO_CLAMP as LOG_RATIO_CLAMP  # public here
from detached_rl.algorithms.advantages import (
    AdvantageInputs,
    AdvantageSettings,
    get_advantage_estimator,
    scores_at_last_token,
)
from detached_rl.algorithms.aggregation import aggregate_loss
from detached_rl.algorithms.grpo_batches import draw_groups
from detached_rl.algorithms.grpo_config import GRPOConfig
from detached_rl.algorithms.kl import kl_estimate
from detached_rl.algorithms.learner import EpochsFromConfig
from detached_rl.algorithms.losses import PolicyLossSettings, get_policy_loss
from detached_rl.algorithms.masks import masked_mean
from detached_rl.algorithms.mismatch import (
    apply_behaviour_correction,
    experience_engine,
    finite_token_mask,
    masked_kl,
    needs_behaviour_correction,
    trainer_engine,
)
from detached_rl.algorithms.ppo import TokenWeightedMeans, micro_batches, recompute_log_probs
from detached_rl.algorithms.provenance import ProvenanceConfig, ProvenanceVerdicts, exclude_unproven
from detached_rl.algorithms.step_guard import skip_metrics, step_unless_nonfinite
from detached_rl.core.devices import host_floats
from detached_rl.core.experience import Experience
from detached_rl.core.experience_batch import ExperienceBatch, collate
from detached_rl.core.native_dtypes import resolve_auto_dtype
from detached_rl.core.sampling import SamplingConfig
from detached_rl.models.actor import Actor, reference_sampling
from detached_rl.models.lora import lora_backend, merged_model
from detached_rl.strategies import check_strategy
from detached_rl.strategies.base import Strategy
from detached_rl.strategies.hardware import peak_flops

logger = logging.getLogger(__name__)

# The learner's config, importable from here too: the trainers, the run config and compat
# build it with the learner.
__all__ = ["GRPOConfig", "GRPOLearner", "overlong_penalty"]


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment [B]: 0 up to max_length - buffer, then linear down
    to -penalty at max_length."""
    start = max_length - buffer
    return (-(lengths.float() - start).clamp(min=0) / buffer * penalty).clamp(min=-penalty)


# Sees a micro-batch's new and old log-probs and its token mask (`GRPOLearner.add_ratio_observer`).
RatioObserver = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


class GRPOLearner(EpochsFromConfig):
    """Trains a policy with a group-relative (critic-free) objective (a `Learner`).

    `sampling` is how the makers sample (the trainer recomputes log-probs under the same
    temperature and top-k/top-p, and overlong shaping measures against its max_new_tokens);
    without it, `config.sampling`, else the defaults.
    """

    assembles_batches = True  # whole groups, and dynamic sampling draws again

    def __init__(self, actor: Actor, strategy: Strategy, config: GRPOConfig | None = None,
                 sampling: SamplingConfig | None = None) -> None:
        strategy = check_strategy(strategy, "GRPOLearner: strategy")
        self.config = config or GRPOConfig()
        self.sampling = sampling or self.config.sampling or SamplingConfig()
        self.config.check_overlong_buffer(self.sampling.max_new_tokens)
        self.estimate_advantages = get_advantage_estimator(self.config.advantage_estimator)
        self.policy_loss = get_policy_loss(self.config.policy_loss)
        self.ratio_observers: list[RatioObserver] = []
        self.strategy = strategy
        self.autocast_dtype = resolve_auto_dtype(self.config.autocast_dtype, strategy.device, otherwise=None)
        if self.config.autocast_dtype == "auto":
            logger.info("autocast_dtype auto on %s: %s", strategy.device,
                        self.autocast_dtype or "float32 (no native bfloat16 there)")
        self.actor, self.optimizer, self.scheduler = strategy.prepare_training(
            actor, self.config.actor_optimizer)
        self.reference: Actor | None = None
        if self.config.kl_coef > 0:
            plain = self._effective_policy()
            for p in plain.parameters():
                p.requires_grad_(False)
            self.reference = Actor(plain.to(strategy.device).eval(), self.policy.tokenizer)
        self.optimizer_steps = 0
        self.order_generator = torch.Generator().manual_seed(self.config.seed)  # mini-batch order
        # Set by the trainer: check on-version samples against the recompute (`algorithms.provenance`).
        self.provenance: ProvenanceConfig | None = None
        self.last_provenance: ProvenanceVerdicts | None = None
        self.steps = 0
        unwrapped = self.strategy.unwrap(self.actor).model
        self.num_parameters = sum(p.numel() for p in unwrapped.parameters())
        self.num_trainable = sum(p.numel() for p in unwrapped.parameters() if p.requires_grad)

    @property
    def policy(self) -> Actor:
        """The unwrapped Actor."""
        return self.strategy.unwrap(self.actor)

    @property
    def engine(self) -> str:
        """The engine of this trainer's log-probs (`trainer_engine`): "hf:float32",
        "hf:autocast-bfloat16", ..."""
        return trainer_engine(self.policy.model, self.autocast_dtype)

    @property
    def max_sampling_rounds(self) -> int:
        """Draws `make_batch` makes at most per batch: `max_sampling_rounds` with dynamic sampling, else 1."""
        return self.config.max_sampling_rounds if self.config.dynamic_sampling else 1

    @property
    def group_size(self) -> int | None:
        """Samples per group; `TrainerCore` makes its buffer refuse pushes that are not whole groups of it."""
        return self.config.group_size

    def synced_models(self) -> dict[str, nn.Module]:
        """What makers mirror: the policy only (no critic)."""
        return {"actor": self.policy.model}

    def synced_sources(self) -> dict[str, tuple[nn.Module, str]]:
        """Each synced model as (prepared model, key prefix) for the strategy to gather."""
        return {"actor": (self.actor, "model.")}

    def state_dict(self) -> dict[str, Any]:
        """Everything training changes: policy, reference (Polyak-updated), optimizer, schedule, counters."""
        return {"actor": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "steps": self.steps,
                "optimizer_steps": self.optimizer_steps, "order_generator": self.order_generator.get_state(),
                "reference": self.reference.state_dict() if self.reference is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.strategy.load_weights(self.actor, state["actor"], self.optimizer)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps, self.optimizer_steps = state["steps"], state["optimizer_steps"]
        if "order_generator" in state:  # checkpoints before it drew from torch's global generator
            self.order_generator.set_state(state["order_generator"])
        if self.reference is not None and state["reference"] is not None:
            self.reference.load_state_dict(state["reference"])

    def _effective_policy(self) -> nn.Module:
        """A plain copy of the policy with any LoRA adapter merged in."""
        model = self.policy.model
        return merged_model(model) if lora_backend(model) is not None else copy.deepcopy(model)

    def add_ratio_observer(self, observe: RatioObserver) -> None:
        """Call `observe(log_probs, old_log_probs, mask)` ([B, T] each) with what every micro-batch's policy
        loss gets (log-probs masked; the ratio is exp(log_probs - old_log_probs), clamped by
        `LOG_RATIO_CLAMP`)."""
        self.ratio_observers.append(observe)

    def update_ref_policy(self, alpha: float | None = None) -> None:
        """Polyak update of the reference: ref <- alpha * policy + (1 - alpha) * ref (alpha=1 copies)."""
        if self.reference is None:
            raise ValueError("update_ref_policy: there is no reference model (kl_coef is 0)")
        alpha = self.config.ref_update_alpha if alpha is None else alpha
        source = dict(self._effective_policy().named_parameters())
        with torch.no_grad():
            for name, param in self.reference.model.named_parameters():
                param.mul_(1 - alpha).add_(source[name].to(param.device, param.dtype), alpha=alpha)

    # ---------------------------------------------------------------- batches
    def make_batch(self, sample: Callable[[int], list[Experience]], size: int
                   ) -> tuple[list[Experience], dict[str, float]]:
        """Draw `size` samples of whole groups; with dynamic sampling drop groups whose rewards are all equal.

        `sample(count)` returns `count` experiences from the buffer (waiting as needed); see `draw_groups`.
        """
        return draw_groups(sample, size, self.max_sampling_rounds, bool(self.config.dynamic_sampling))

    # ---------------------------------------------------------------- advantages
    def scores(self, batch: ExperienceBatch) -> torch.Tensor:
        """Sequence rewards [B], with DAPO's overlong penalty when enabled."""
        scores = batch.scores.clone()
        if self.config.overlong_shaping:
            max_length = self.sampling.max_new_tokens
            buffer = self.config.overlong_buffer or max(1, max_length // 5)
            lengths = batch.response_mask.sum(1)
            scores = scores + overlong_penalty(lengths, max_length, buffer,
                                               self.config.overlong_penalty).to(scores)
        return scores

    def advantages(self, batch: ExperienceBatch, scores: torch.Tensor,
                   kl: torch.Tensor | None) -> torch.Tensor:
        """Token-level advantages [B, R] of the configured estimator; `kl` [B, R], when given, is subtracted
        (times kl_coef) from the token rewards."""
        token_rewards = scores_at_last_token(scores, batch.response_mask)
        if kl is not None:
            token_rewards = token_rewards - self.config.kl_coef * kl
        inputs = AdvantageInputs(mask=batch.response_mask, scores=scores, token_rewards=token_rewards,
                                 group_ids=batch.group_ids)
        advantages, _ = self.estimate_advantages(inputs, AdvantageSettings(eps=self.config.advantage_eps))
        return advantages

    # ---------------------------------------------------------------- training
    def train_step(self, experiences: list[Experience],
                   policy_version: int | None = None) -> dict[str, float]:
        """One GRPO step on a batch of whole groups; returns token-weighted metrics."""
        start = time.perf_counter()
        config = self.config
        batch = collate(experiences, self.policy.tokenizer.pad_token_id, device=self.strategy.device)
        # From the host-side versions: deciding on it needs no device sync.
        staleness = [policy_version - e.policy_version
                     for e in experiences] if policy_version is not None else None
        multi_pass = config.train_epochs > 1 or (config.mini_batch_size or batch.size) < batch.size
        recompute_old = config.proximal_recompute and self._any_rank(needs_behaviour_correction(
            staleness, multi_pass, (experience_engine(e.info) for e in experiences), self.engine))
        checking = self.provenance is not None and self.provenance.check and staleness is not None
        extra_forwards = 0
        with torch.no_grad():
            # The proximal "old" policy, when recomputed: this trainer's weights before the update.
            recomputed = None
            if recompute_old or checking:
                recomputed = self._forward_in_micro_batches(self.actor, batch)
                extra_forwards += 1
            self.last_provenance = None
            if checking:  # before the advantages: a sample taken out counts in none of them
                self.last_provenance = exclude_unproven(self.provenance, batch, recomputed, experiences,
                                                        staleness, self.engine)
            kl = None
            if self.reference is not None:
                # Over the full vocabulary (`reference_sampling`), never -inf for a sampled token; the
                # policy's side stays the processed distribution it samples from: the KL is
                # KL(sampling policy || reference).
                batch.ref_log_probs = recompute_log_probs(self.reference, batch,
                                                          reference_sampling(self.sampling),
                                                          self.config.micro_batch_size, self._autocast)
                kl = masked_kl(batch.log_probs, batch.ref_log_probs, batch.response_mask, config.kl_kind)
                extra_forwards += 1
            scores = self.scores(batch)
            batch.advantages = self.advantages(batch, scores, kl if config.kl_in_reward else None)
            old = recomputed if recompute_old else None
            mismatch = apply_behaviour_correction(batch, old, config.tis_cap)
        means = TokenWeightedMeans()
        skipped: Counter[str] = Counter()
        losses: list[torch.Tensor] = []
        self.actor.train()
        for micro, weight, mini_tokens, last in micro_batches(
            batch, config.train_epochs, config.mini_batch_size, config.micro_batch_size, config.loss_agg,
            share=self.strategy.gradient_share, generator=self.order_generator,
        ):
            micro_metrics = self._micro_step(micro, weight)
            losses.append(micro_metrics[names.LOSS_TOTAL])
            means.add(micro_metrics, micro.num_response_tokens)
            if last:
                (norm,), skip = step_unless_nonfinite(
                    self.strategy, [(self.optimizer, self.actor, config.actor_optimizer.max_grad_norm)],
                    losses)
                losses = []
                if skip is None:
                    self.scheduler.step()
                    self.optimizer_steps += 1
                else:
                    skipped[skip] += 1
                means.add({"grad_norm/actor": norm}, mini_tokens)
        self.steps += 1
        every = config.ref_update_every
        if self.reference is not None and every and self.steps % every == 0:
            self.update_ref_policy()
        metrics = means.means()
        metrics.update(skip_metrics(skipped))
        elapsed = time.perf_counter() - start
        tokens = batch.num_response_tokens
        metrics.update(self._batch_metrics(batch, scores, staleness, kl, mismatch))
        if self.last_provenance is not None:
            metrics.update(self.last_provenance.metrics())
        flops = self._training_flops(batch, extra_forwards)
        metrics.update({
            names.TIME_TRAINING: elapsed,
            "perf/tokens_per_s": tokens / elapsed,
            "perf/samples_per_s": batch.size / elapsed,
            "perf/mfu": flops / elapsed / peak_flops(self.strategy.device, self.matmul_dtype()),
            "lr/actor": self.optimizer.param_groups[0]["lr"],
        })
        return names.with_aliases(metrics)

    def _any_rank(self, flag: bool) -> bool:
        """True when `flag` is true on some rank: ranks must agree on forwards through the wrapped model and
        on their metrics' keys."""
        return not self.strategy.all_true(not flag)

    def matmul_dtype(self) -> str:
        """The dtype the training matmuls run in: the autocast dtype in use, else the policy's bf16/fp16, else
        float32."""
        if self.autocast_dtype is not None:
            return self.autocast_dtype
        dtype = str(next(self.policy.model.parameters()).dtype).removeprefix("torch.")
        return dtype if dtype in ("bfloat16", "float16") else "float32"

    def _autocast(self) -> contextlib.AbstractContextManager:
        """torch.autocast to the autocast dtype in use on the strategy's device, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.strategy.device.type, dtype=getattr(torch, self.autocast_dtype))

    def _forward_in_micro_batches(self, actor: nn.Module, batch: ExperienceBatch) -> torch.Tensor:
        return recompute_log_probs(actor, batch, self.sampling, self.config.micro_batch_size, self._autocast)

    def _micro_step(self, micro: ExperienceBatch, weight: float) -> dict[str, Any]:
        config, response_mask = self.config, micro.response_mask
        with self._autocast():
            log_probs, entropy = self.actor(micro.sequences, micro.attention_mask, response_mask,
                                            self.sampling,
                                            return_entropy=True, entropy_grad=config.entropy_coef > 0)
        # Tokens with a non-finite log-prob on any side stay out of every loss term (and its gradient).
        mask = finite_token_mask(response_mask, log_probs.detach(), micro.old_log_probs, micro.log_probs,
                                 micro.ref_log_probs)
        log_probs = torch.where(mask, log_probs, torch.zeros_like(log_probs))
        max_length = self.sampling.max_new_tokens
        loss_settings = PolicyLossSettings(config.clip_low, config.clip_high, config.dual_clip,
                                           config.loss_agg,
                                           max_length=max_length)
        for observe in self.ratio_observers:
            observe(log_probs, micro.old_log_probs, mask)
        policy_loss, stats = self.policy_loss(log_probs, micro.old_log_probs, micro.advantages, mask,
                                              loss_settings,
                                              weights=micro.loss_weights)
        total = policy_loss
        kl_loss = torch.zeros((), device=log_probs.device)
        # with the KL in the reward it is in the advantages; here only reported
        if self.reference is not None:
            in_loss = not config.kl_in_reward
            ref_log_probs = torch.where(mask, micro.ref_log_probs, torch.zeros_like(log_probs))
            kl_loss = aggregate_loss(kl_estimate(log_probs if in_loss else log_probs.detach(), ref_log_probs,
                                                 config.kl_kind), mask, config.loss_agg,
                                     max_length=max_length)
            if in_loss:
                total = total + config.kl_coef * kl_loss
        entropy_term = aggregate_loss(entropy, mask, config.loss_agg)
        if config.entropy_coef > 0:
            total = total - config.entropy_coef * entropy_term
        self.strategy.backward(total * weight, self.actor, self.optimizer)
        return {
            names.LOSS_POLICY: policy_loss.detach(), names.LOSS_KL: kl_loss.detach(),
            names.LOSS_ENTROPY: entropy_term.detach(), names.LOSS_TOTAL: total.detach(),
            names.POLICY_CLIPFRAC: stats["clipfrac"], names.POLICY_APPROX_KL: stats["approx_kl"],
            names.POLICY_RATIO: stats["ratio_mean"],
            names.POLICY_ENTROPY: masked_mean(entropy.detach(), response_mask),
            names.POLICY_IMPORTANCE_WEIGHT: masked_mean(micro.loss_weights, mask),
            names.POLICY_NONFINITE_FRACTION: masked_mean((~mask).to(entropy.dtype), response_mask),
        }

    def _training_flops(self, batch: ExperienceBatch, extra_forwards: int) -> float:
        """Model FLOPs of the step: 2N per token per forward, 2N for activation gradients, 2N more for
        trainable weight gradients (N = parameters; attention's sequence-length term is left out)."""
        tokens = int(batch.attention_mask.sum())
        forwards = 2 * self.num_parameters * (1 + extra_forwards)
        per_token = forwards + 2 * self.num_parameters + 2 * self.num_trainable
        return float(per_token * tokens * self.config.train_epochs)

    def _batch_metrics(self, batch: ExperienceBatch, scores: torch.Tensor, staleness: list[int] | None,
                       kl: torch.Tensor | None, mismatch: dict[str, torch.Tensor]) -> dict[str, float]:
        lengths = batch.response_mask.sum(1).float()
        out: dict[str, float | torch.Tensor] = {
            "reward/mean": scores.mean(),
            "reward/std": scores.std() if batch.size > 1 else 0.0,
            "reward/raw_mean": batch.scores.mean(),
            "response_length/mean": lengths.mean(),
            "samples": float(batch.size),
            "tokens": batch.response_mask.sum(),
        }
        if batch.advantages is not None:
            out["advantages/mean"] = masked_mean(batch.advantages, batch.response_mask)
        out.update(names.reward_part_means(batch.infos))  # the reward's parts and each of the task's rewards
        finished = [bool(info["finished"]) for info in batch.infos if info.get("finished") is not None]
        if finished:
            out["response/truncated_fraction"] = 1.0 - sum(finished) / len(finished)
        if kl is not None:
            out[names.OBJECTIVE_KL] = masked_mean(kl, batch.response_mask)
        if staleness is not None:  # the histogram is added per rank by the trainer (its keys vary)
            out["staleness/mean"] = sum(staleness) / len(staleness)
            out["staleness/max"] = float(max(staleness))
        out.update(mismatch)
        return host_floats(out)  # one device-to-host transfer for all of them
