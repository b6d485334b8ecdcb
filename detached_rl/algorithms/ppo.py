"""PPO on experience batches: reward shaping, advantages (GAE by default), clipped policy and value losses.

`PPOLearner` is the plain class inside `DetachedPPOTrainer`; it owns the actor, the critic,
their optimizers and schedules, and turns a list of `Experience` into optimizer steps
(mini-batches, epochs, token-weighted micro-batch accumulation). The advantage estimator and
the policy loss are looked up by name in `ADVANTAGE_ESTIMATORS` and `POLICY_LOSSES`.
Experience must carry `values` (the maker's critic) and, when the KL coefficient is
non-zero, `ref_log_probs` (the maker's reference model). The "old" policy of the PPO ratio
is the behaviour policy (the log-probs the maker sampled with) when every sample is fresh, the
batch is trained on in one pass and it came from the trainer's own engine; otherwise, as in GRPO,
the trainer recomputes the old log-probs with its current weights (the proximal policy), weights
tokens by truncated importance weights (`tis_cap`) and reports the mismatch
(`detached_rl.algorithms.mismatch`).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from detached_rl.algorithms import metrics as names
from detached_rl.algorithms.advantages import AdvantageInputs, AdvantageSettings, get_advantage_estimator
from detached_rl.algorithms.aggregation import aggregate_loss
from detached_rl.algorithms.kl import kl_estimate
from detached_rl.algorithms.learner import EpochsFromConfig
from detached_rl.algorithms.losses import PolicyLossSettings, get_policy_loss, value_loss
from detached_rl.algorithms.masks import masked_mean, masked_whiten
from detached_rl.algorithms.mismatch import (
    apply_behaviour_correction,
    experience_engine,
    finite_token_mask,
    masked_kl,
    needs_behaviour_correction,
    trainer_engine,
)
from detached_rl.algorithms.ppo_config import PPOConfig
from detached_rl.algorithms.provenance import ProvenanceConfig, ProvenanceVerdicts, exclude_unproven
from detached_rl.algorithms.step_guard import skip_metrics, step_unless_nonfinite
from detached_rl.core.devices import host_floats
from detached_rl.core.experience import Experience
from detached_rl.core.experience_batch import ExperienceBatch, collate
from detached_rl.core.sampling import SamplingConfig
from detached_rl.models.actor import Actor
from detached_rl.models.scalar_heads import Critic
from detached_rl.strategies import check_strategy
from detached_rl.strategies.base import Strategy


def shaped_rewards(batch: ExperienceBatch, config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token rewards [B, R] with the KL penalty subtracted when `kl_mode="reward"`, and the per-token KL."""
    if config.kl_coef == 0:
        return batch.token_rewards, None
    if batch.ref_log_probs is None:
        raise ValueError("PPO with kl_coef > 0 needs ref_log_probs on every experience (field ref_log_probs)")
    kl = masked_kl(batch.log_probs, batch.ref_log_probs, batch.response_mask, config.kl_kind)
    if config.kl_mode == "reward":
        return batch.token_rewards - config.kl_coef * kl, kl
    return batch.token_rewards, kl


def ppo_advantages(batch: ExperienceBatch,
                   config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(advantages, returns, kl) [B, R]: the configured estimator (GAE) over shaped rewards and the maker's
    values, optionally whitened."""
    if batch.values is None:
        raise ValueError("PPO needs values on every experience (field values), computed by the "
                         "maker's critic")
    rewards, kl = shaped_rewards(batch, config)
    inputs = AdvantageInputs(mask=batch.response_mask, scores=batch.scores, token_rewards=rewards,
                             values=batch.values, group_ids=batch.group_ids)
    estimator = get_advantage_estimator(config.advantage_estimator)
    advantages, returns = estimator(inputs, AdvantageSettings(gamma=config.gamma, lam=config.lam))
    if config.whiten_advantages and batch.num_response_tokens >= 2:
        advantages = masked_whiten(advantages, batch.response_mask)
    return advantages, returns, kl


def micro_batches(
    batch: ExperienceBatch, epochs: int, mini_batch_size: int | None, micro_batch_size: int,
    loss_agg: str = "token-mean", share: Callable[[float], float] | None = None,
    generator: torch.Generator | None = None,
) -> Iterator[tuple[ExperienceBatch, float, int, bool]]:
    """(micro-batch, loss weight, mini-batch tokens, last micro-batch of its mini-batch) over shuffled epochs.

    Gradient accumulation that equals one pass over the mini-batch: a micro-batch's loss is
    weighted by its share of the mini-batch's tokens for "token-mean", and by its share of the
    sequences for the "seq-mean-*" modes (they average over sequences). An optimizer step
    belongs after each `last`. `share` (a strategy's `gradient_share`) scales each mini-batch so
    that data-parallel ranks holding different amounts of data still average over all of it;
    it is called once per mini-batch, on every rank alike. `generator` (a CPU one) draws each epoch's
    order; None: torch's global one.
    """
    mini_size = mini_batch_size or batch.size
    by_tokens = loss_agg == "token-mean"
    lengths = batch.response_mask.sum(1).tolist()  # read back once: token counts are host arithmetic below
    for _ in range(epochs):
        # A CPU generator on every device: the same order on CPU and GPU. The order decides the summation
        # order of the gradient, so a generator nothing else draws from keeps two runs bit-identical.
        order = torch.randperm(batch.size, device="cpu", generator=generator).tolist()
        for mini_start in range(0, batch.size, mini_size):
            rows = order[mini_start : mini_start + mini_size]
            tokens = sum(lengths[row] for row in rows)
            mini_tokens = max(tokens, 1)
            scale = share(tokens if by_tokens else len(rows)) if share is not None else 1.0
            starts = range(0, len(rows), micro_batch_size)
            for micro_start in starts:
                micro_rows = rows[micro_start : micro_start + micro_batch_size]
                micro = batch.select(micro_rows)
                micro_tokens = sum(lengths[row] for row in micro_rows)
                weight = micro_tokens / mini_tokens if by_tokens else micro.size / len(rows)
                yield micro, weight * scale, mini_tokens, micro_start == starts[-1]


def recompute_log_probs(
    actor: torch.nn.Module, batch: ExperienceBatch, sampling: SamplingConfig, micro_batch_size: int,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """`actor`'s log-probs [B, R] of the batch's responses under `sampling`,
    `micro_batch_size` rows at a time."""
    out = torch.zeros_like(batch.log_probs)
    for start in range(0, batch.size, micro_batch_size):
        end = min(start + micro_batch_size, batch.size)
        micro = batch.select(range(start, end))
        with autocast():
            lp = actor(micro.sequences, micro.attention_mask, micro.response_mask, sampling)
        out[start:end, : lp.shape[1]] = lp.float()
    return out


class TokenWeightedMeans:
    """Accumulates metrics as token-weighted means over micro-batches.

    Tensor values are summed where they are (in float64) and read back once in `means`, so a
    micro-batch on a GPU costs no device sync for its metrics.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float | torch.Tensor] = {}
        self.weights: dict[str, float] = {}

    def add(self, values: dict[str, float | torch.Tensor], weight: float) -> None:
        """Add each value with `weight` (e.g. the micro-batch's token count)."""
        for key, value in values.items():
            term = value.detach().to(torch.float64) * weight if isinstance(value, torch.Tensor) \
                else float(value) * weight
            self.sums[key] = self.sums.get(key, 0.0) + term
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def means(self) -> dict[str, float]:
        """The weighted mean of each key, as Python floats."""
        sums = host_floats(self.sums)
        return {key: sums[key] / max(self.weights[key], 1e-12) for key in self.sums}


class PPOLearner(EpochsFromConfig):
    """Trains an actor and a critic with PPO on batches of experience (a `Learner`).

    `sampling` is how the makers sample (the trainer recomputes log-probs under the same
    temperature and top-k/top-p); without it, `config.sampling`, else the defaults.
    """

    assembles_batches = False  # plain FIFO batches: TrainerCore waits for them on every rank together
    max_sampling_rounds = 1

    def __init__(self, actor: Actor, critic: Critic, strategy: Strategy, config: PPOConfig | None = None,
                 sampling: SamplingConfig | None = None) -> None:
        strategy = check_strategy(strategy, "PPOLearner: strategy")
        self.config = config or PPOConfig()
        self.sampling = sampling or self.config.sampling or SamplingConfig()
        self.strategy = strategy
        self.policy_loss = get_policy_loss(self.config.policy_loss)
        self.actor, self.actor_optimizer, self.actor_scheduler = strategy.prepare_training(
            actor, self.config.actor_optimizer)
        self.critic, self.critic_optimizer, self.critic_scheduler = strategy.prepare_training(
            critic, self.config.critic_optimizer)
        self.optimizer_steps = 0
        self.order_generator = torch.Generator().manual_seed(self.config.seed)  # mini-batch order
        # Set by the trainer: check on-version samples against the recompute (`algorithms.provenance`).
        self.provenance: ProvenanceConfig | None = None
        self.last_provenance: ProvenanceVerdicts | None = None

    def make_batch(self, sample: Callable[[int], list[Experience]], size: int
                   ) -> tuple[list[Experience], dict[str, float]]:
        """`size` experiences in the buffer's order (PPO has no batch structure)."""
        return sample(size), {}

    def synced_models(self) -> dict[str, torch.nn.Module]:
        """What makers mirror: the policy's model and the critic."""
        return {"actor": self.strategy.unwrap(self.actor).model, "critic": self.strategy.unwrap(self.critic)}

    def synced_sources(self) -> dict[str, tuple[torch.nn.Module, str]]:
        """Each synced model as (prepared model, key prefix) for the strategy to gather."""
        return {"actor": (self.actor, "model."), "critic": (self.critic, "")}

    def state_dict(self) -> dict[str, Any]:
        """Everything training changes: models, optimizers, schedules, counters."""
        unwrap = self.strategy.unwrap
        return {"actor": unwrap(self.actor).state_dict(), "critic": unwrap(self.critic).state_dict(),
                "actor_optimizer": self.actor_optimizer.state_dict(),
                "critic_optimizer": self.critic_optimizer.state_dict(),
                "actor_scheduler": self.actor_scheduler.state_dict(),
                "critic_scheduler": self.critic_scheduler.state_dict(),
                "optimizer_steps": self.optimizer_steps, "order_generator": self.order_generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.strategy.load_weights(self.actor, state["actor"], self.actor_optimizer)
        self.strategy.load_weights(self.critic, state["critic"], self.critic_optimizer)
        for name in ("actor_optimizer", "critic_optimizer", "actor_scheduler", "critic_scheduler"):
            getattr(self, name).load_state_dict(state[name])
        self.optimizer_steps = state["optimizer_steps"]
        if "order_generator" in state:  # checkpoints before it drew from torch's global generator
            self.order_generator.set_state(state["order_generator"])

    @property
    def engine(self) -> str:
        """The engine of this trainer's log-probs (`trainer_engine`), e.g. "hf:float32"."""
        return trainer_engine(self.strategy.unwrap(self.actor).model)

    @property
    def pad_token_id(self) -> int:
        """Pad id used when collating."""
        return int(self.strategy.unwrap(self.actor).tokenizer.pad_token_id)

    def train_step(self, experiences: list[Experience],
                   policy_version: int | None = None) -> dict[str, float]:
        """Train on one batch (epochs x mini-batches x micro-batches); returns token-weighted metrics."""
        start = time.perf_counter()
        config = self.config
        batch = collate(experiences, self.pad_token_id, device=self.strategy.device)
        staleness = [policy_version - e.policy_version
                     for e in experiences] if policy_version is not None else None
        multi_pass = config.train_epochs > 1 or (config.mini_batch_size or batch.size) < batch.size
        # Every rank decides alike: the recompute runs through the wrapped model, and metric keys must match.
        needs_correction = needs_behaviour_correction(
            staleness, multi_pass, (experience_engine(e.info) for e in experiences), self.engine)
        recompute_old = config.proximal_recompute and not self.strategy.all_true(not needs_correction)
        checking = self.provenance is not None and self.provenance.check and staleness is not None
        with torch.no_grad():
            recomputed = (recompute_log_probs(self.actor, batch, self.sampling, config.micro_batch_size)
                          if recompute_old or checking else None)
            self.last_provenance = None
            if checking:  # before the advantages: a sample taken out counts in none of them
                self.last_provenance = exclude_unproven(self.provenance, batch, recomputed, experiences,
                                                        staleness, self.engine)
            advantages, returns, kl = ppo_advantages(batch, config)
            old = recomputed if recompute_old else None
            mismatch = apply_behaviour_correction(batch, old, config.tis_cap)
        batch.advantages, batch.returns = advantages, returns
        means = TokenWeightedMeans()
        skipped: Counter[str] = Counter()
        losses: list[torch.Tensor] = []
        self.actor.train()
        self.critic.train()
        for micro, weight, mini_tokens, last in micro_batches(
            batch, config.train_epochs, config.mini_batch_size, config.micro_batch_size, config.loss_agg,
            share=self.strategy.gradient_share, generator=self.order_generator,
        ):
            micro_metrics = self._micro_step(micro, weight)
            losses.append(micro_metrics[names.LOSS_TOTAL])
            means.add(micro_metrics, micro.num_response_tokens)
            if last:
                norms, skip = self._optimizer_step(losses)
                losses = []
                if skip is not None:
                    skipped[skip] += 1
                means.add(norms, mini_tokens)
        metrics = means.means()
        metrics.update(skip_metrics(skipped))
        metrics.update(self._batch_metrics(batch, kl, policy_version, mismatch))
        if self.last_provenance is not None:
            metrics.update(self.last_provenance.metrics())
        elapsed = time.perf_counter() - start
        metrics.update({
            names.TIME_TRAINING: elapsed,
            "perf/samples_per_s": batch.size / elapsed,
            "perf/tokens_per_s": batch.num_response_tokens / elapsed,
            "lr/actor": self.actor_optimizer.param_groups[0]["lr"],
            "lr/critic": self.critic_optimizer.param_groups[0]["lr"],
        })
        return names.with_aliases(metrics)

    def _micro_step(self, micro: ExperienceBatch, weight: float) -> dict[str, Any]:
        config = self.config
        response_mask = micro.response_mask
        log_probs, entropy = self.actor(
            micro.sequences, micro.attention_mask, response_mask, self.sampling, return_entropy=True,
            entropy_grad=config.entropy_coef > 0,
        )
        # Tokens with a non-finite log-prob on any side stay out of the policy's loss
        # terms (and their gradient).
        mask = finite_token_mask(response_mask, log_probs.detach(), micro.old_log_probs, micro.log_probs,
                                 micro.ref_log_probs)
        log_probs = torch.where(mask, log_probs, torch.zeros_like(log_probs))
        loss_settings = PolicyLossSettings(config.clip_low, config.clip_high, config.dual_clip,
                                           config.loss_agg)
        policy_loss, stats = self.policy_loss(log_probs, micro.old_log_probs, micro.advantages, mask,
                                              loss_settings,
                                              weights=micro.loss_weights)
        entropy_term = aggregate_loss(entropy, mask, config.loss_agg)
        actor_loss = policy_loss - config.entropy_coef * entropy_term
        kl_loss = torch.zeros((), device=log_probs.device)
        # The KL to the reference is reported whenever the makers sent reference log-probs; it is a loss term
        # only with kl_coef > 0 and kl_mode="loss" (with kl_mode="reward" it is in the advantages already).
        if micro.ref_log_probs is not None:
            in_loss = config.kl_coef > 0 and config.kl_mode == "loss"
            ref_log_probs = torch.where(mask, micro.ref_log_probs, torch.zeros_like(log_probs))
            kl_loss = aggregate_loss(kl_estimate(log_probs if in_loss else log_probs.detach(), ref_log_probs,
                                                 config.kl_kind), mask, config.loss_agg)
            if in_loss:
                actor_loss = actor_loss + config.kl_coef * kl_loss
        self.strategy.backward(actor_loss * weight, self.actor, self.actor_optimizer)

        values = self.critic(micro.sequences, micro.attention_mask, response_mask)
        critic_loss, value_stats = value_loss(values, micro.values, micro.returns, response_mask,
                                              config.value_clip,
                                              config.loss_agg)
        self.strategy.backward(config.value_coef * critic_loss * weight, self.critic, self.critic_optimizer)
        value_error = masked_mean((values.detach() - micro.returns) ** 2, response_mask)
        return {
            names.LOSS_POLICY: policy_loss.detach(), names.LOSS_VALUE: critic_loss.detach(),
            names.LOSS_ENTROPY: entropy_term.detach(), names.LOSS_KL: kl_loss.detach(),
            names.LOSS_TOTAL: (actor_loss + config.value_coef * critic_loss).detach(),
            names.POLICY_ENTROPY: masked_mean(entropy.detach(), response_mask),
            names.POLICY_CLIPFRAC: stats["clipfrac"], names.POLICY_APPROX_KL: stats["approx_kl"],
            names.POLICY_RATIO: stats["ratio_mean"], names.VALUE_CLIPFRAC: value_stats["vf_clipfrac"],
            names.VALUE_ERROR: value_error,
            names.POLICY_IMPORTANCE_WEIGHT: masked_mean(micro.loss_weights, mask),
            names.POLICY_NONFINITE_FRACTION: masked_mean((~mask).to(entropy.dtype), response_mask),
        }

    def _optimizer_step(self, losses: list[torch.Tensor]) -> tuple[dict[str, float], str | None]:
        """Step actor and critic together, or neither (`step_unless_nonfinite`); their
        norms and any skip reason."""
        (actor_norm, critic_norm), skip = step_unless_nonfinite(self.strategy, [
            (self.actor_optimizer, self.actor, self.config.actor_optimizer.max_grad_norm),
            (self.critic_optimizer, self.critic, self.config.critic_optimizer.max_grad_norm),
        ], losses)
        if skip is None:
            self.actor_scheduler.step()
            self.critic_scheduler.step()
            self.optimizer_steps += 1
        return {"grad_norm/actor": actor_norm, "grad_norm/critic": critic_norm}, skip

    @staticmethod
    def _batch_metrics(batch: ExperienceBatch, kl: torch.Tensor | None, policy_version: int | None,
                       mismatch: dict[str, torch.Tensor]) -> dict[str, float]:
        lengths = batch.response_mask.sum(1).float()
        out: dict[str, float | torch.Tensor] = {
            "reward/mean": batch.scores.mean(),
            "reward/std": batch.scores.std() if batch.size > 1 else 0.0,
            "response_length/mean": lengths.mean(),
            "response_length/max": lengths.max(),
            "samples": float(batch.size),
            "tokens": batch.response_mask.sum(),
        }
        out.update(names.reward_part_means(batch.infos))  # the reward's parts and each of the task's rewards
        if kl is not None:
            out[names.OBJECTIVE_KL] = masked_mean(kl, batch.response_mask)
        if policy_version is not None:
            staleness = (policy_version - batch.policy_versions).float()
            out["staleness/mean"] = staleness.mean()
            out["staleness/max"] = staleness.max()
        out.update(mismatch)
        return host_floats(out)  # one device-to-host transfer for all of them
