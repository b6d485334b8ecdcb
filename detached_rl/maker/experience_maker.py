"""The experience maker: generate with the current policy, score, and tag each sample with its version.

`ExperienceMaker` is the plain class inside the `ExperienceMakerHolder` actor. It holds a
generation backend for the policy (`MakerConfig.backend`), for PPO a critic, a reference
model and a reward scorer, a prompt source and a `WeightReceiver` that writes updates through
the backend's weight sink. Generation of one batch runs under the receiver's lock, so a weight
update becomes visible only between two batches and a batch never mixes two versions.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from detached_rl.core.experience import Experience
from detached_rl.core.experience_batch import collate
from detached_rl.core.prompts import PromptSource, as_prompt_item, prompt_text
from detached_rl.core.sampling import SamplingConfig
from detached_rl.generation.base import GenerationBackend
from detached_rl.generation.registry import build_generation_backend
from detached_rl.maker.config import MakerConfig
from detached_rl.maker.refusals import refused_rows
from detached_rl.models.actor import Actor, reference_sampling
from detached_rl.models.lora_backend import lora_backend
from detached_rl.models.reward import RewardScorer
from detached_rl.models.scalar_heads import Critic
from detached_rl.scorer.requests import ScoreAnswer, ScoreRequest
from detached_rl.scorer.service import PendingScores, ScoringService
from detached_rl.strategies import NaiveStrategy, Strategy, check_strategy
from detached_rl.weights.base_fingerprint import BaseCheckedSink, base_keys, base_model_label
from detached_rl.weights.receiver import (
    WeightReceiver,
)
from detached_rl.weights.served_probe import PROBE_KEY, SERVED_MISMATCH, probe_ids
from detached_rl.weights.subscriber import WeightSubscriber
from detached_rl.weights.update import ApplyResult, Fetch, OffTrainerError, WeightUpdate, restrict_update

NOT_SYNCED = -1  # receiver version before the first weight update from a trainer

__all__ = ["NOT_SYNCED", "BatchCallback", "ExperienceMaker", "MakerConfig", "MakerModels", "prompt_text"]


@runtime_checkable
class BatchCallback(Protocol):
    """What `ExperienceMaker.add_callbacks` takes: called around each batch `make_experience` makes."""

    def on_batch_start(self) -> None:
        """Before the batch's prompts are taken."""
        ...

    def on_batch_end(self, experiences: list[Experience]) -> None:
        """After the batch is generated and scored (not called when making it raised)."""
        ...


@dataclass
class MakerModels:
    """What a maker's model factory builds."""

    actor: Actor
    reward: RewardScorer | None = None  # None when a reward scorer group serves the role
    critic: Critic | None = None
    reference: Actor | None = None


class ExperienceMaker:
    """Generates and scores experience with versioned weights."""

    def __init__(
        self,
        name: str,
        models: MakerModels,
        prompts: PromptSource,
        config: MakerConfig | None = None,
        strategy: Strategy | None = None,
        scoring: ScoringService | None = None,
    ) -> None:
        self.name = name
        self.config = config or MakerConfig()
        self.sampling = self.config.sampling or SamplingConfig()  # how responses are sampled
        self.strategy = (NaiveStrategy() if strategy is None
                         else check_strategy(strategy, f"maker {name!r}: strategy"))
        # Roles `scoring` serves replace the local models of those roles.
        self.scoring = scoring
        remote = scoring.roles if scoring is not None else frozenset()
        if models.reward is None and "reward" not in remote:
            raise ValueError(f"maker {name!r} has no reward: give MakerModels.reward or a 'reward' scorer")
        models = dataclasses.replace(models, **{role: None for role in remote})
        device = self.strategy.device
        actor = models.actor.to(device).eval()
        self.critic = models.critic.to(device).eval() if models.critic is not None else None
        self.reference = models.reference.to(device).eval() if models.reference is not None else None
        # A reward model scores the batch where it is generated; a reward function runs on the host anyway.
        reward = models.reward
        self.reward = reward.to(device).eval() if isinstance(reward, torch.nn.Module) else reward
        self.prompts = prompts
        self.callbacks: list[BatchCallback] = []
        self.generation_lock = threading.Lock()
        self.remote_roles = remote
        is_lora = lora_backend(actor.model) is not None
        if self.config.lora_mode == "merge" and not is_lora:
            raise ValueError(
                "MakerConfig.lora_mode='merge' needs the factory's policy to carry a LoRA adapter")
        self.tokenizer = actor.tokenizer
        # The policy is served by the backend (merge mode: a plain copy the backend re-merges on updates).
        self.backend: GenerationBackend = build_generation_backend(
            self.config.backend, actor, lora_mode=self.config.lora_mode, options=self.config.backend_kwargs()
        )
        # Weights stored narrower than they came (a vLLM engine's bf16, an HF `dtype` option) take the
        # trainer's float32 updates cast, and may be sent them in that dtype (`WeightReceiver.serving_dtype`).
        cast = (getattr(torch, self.config.weight_cast_dtype) if self.config.weight_cast_dtype
                else getattr(self.backend, "stored_dtype", None))
        # A LoRA policy's sink refuses LoRA updates computed against another base than the one it serves
        # (a maker that casts weights fingerprints its base cast to its coarsest stored dtype, as its
        # trainer does).
        self.base_check: BaseCheckedSink | None = None
        if is_lora:
            self.base_check = BaseCheckedSink(self.backend.weight_sink, base_keys(actor.model),
                                              casts=cast is not None,
                                              base_model=base_model_label(actor.model))
        synced: dict[str, Any] = {"actor": self.base_check or self.backend.weight_sink}
        if self.critic is not None:
            synced["critic"] = self.critic
        self.receiver = WeightReceiver(
            synced, cast_dtype=cast, mode=self.config.weight_sync_mode, lock=self.generation_lock,
            version=NOT_SYNCED, max_version_jump=self.config.max_version_jump,
            max_weight_change=self.config.max_weight_change, lock_timeout=self.config.weight_timeout_s,
        )
        # Registration and its answer go through the weight path's subscriber, pushes through the same intake.
        self.subscriber = WeightSubscriber(self.receiver, self._take_update,
                                           lambda: self.registration_fingerprint)
        self.batches = 0
        self.samples_made = 0
        self.tokens_made = 0
        self.generate_seconds = 0.0
        self.last_error: str | None = None
        self.reward_refused: Counter = Counter()  # samples left out of pushes: their reward was refused
        self.last_reward_refusal: str | None = None
        # Why this maker should register with its trainers again (an update showed it off their weights),
        # or None.
        self.resync_reason: str | None = None
        # The probe log-probs the engine served for a version (`weights.served_probe`), sent with each push.
        self._probe_ids = probe_ids(self.tokenizer)
        self._proof: dict[str, Any] | None = None

    @property
    def policy_version(self) -> int:
        """Version of the weights this maker serves (-1 before its first update)."""
        return self.receiver.version

    @property
    def synced(self) -> bool:
        """True once the maker holds a complete version received from a trainer."""
        return self.receiver.version > NOT_SYNCED and self.receiver.consistent

    @property
    def base_fingerprint(self) -> str | None:
        """Fingerprint of the served policy's base weights (None without LoRA)."""
        return None if self.base_check is None else self.base_check.fingerprint

    @property
    def registration_fingerprint(self) -> str | None:
        """What registering reports: the base fingerprint, or None to ask for a full update
        (`MakerConfig.first_update` "full")."""
        return None if self.config.first_update == "full" else self.base_fingerprint

    def expect_runs(self, runs: Iterable[str | None]) -> None:
        """Registered with trainers of these runs that had no weights yet: their first update is a reset."""
        self.receiver.expect_runs(runs)

    def apply_weight_update(self, update: WeightUpdate, fetch: Fetch, *, reset: bool = False,
                            swap: str = "now") -> ApplyResult:
        """The maker's one weight intake: a trainer's push, a registration's answer (`reset=True`), a test's.

        Takes the parts of `update` this maker holds (a critic served by scorers takes its own) and hands
        them to `WeightReceiver.receive` (see it for `reset` and `swap`: the actor's pushes use
        "at_safe_point", so a trainer never waits for a batch). Refused updates change nothing and are
        recorded in `last_error`; one that shows this maker off its trainers' weights (`OffTrainerError`)
        outside a registration sets `resync_reason`.
        """
        if "critic" in self.remote_roles:
            # The trainer's updates carry its critic too; the critic scorers take that part themselves.
            held = {spec.name.partition("/")[0] for spec in update.manifest.tensors} - {"critic"}
            update, fetch = restrict_update(update, held, fetch)
        try:
            # No deadline over the whole update: the fetch fails a stalled transfer itself, however long a
            # progressing one takes (`maker.weight_stall_timeout_s`, `weights.ray_wire.tracked_fetch`).
            return self.receiver.receive(update, fetch, timeout=None, reset=reset, swap=swap)
        except Exception as error:
            self.last_error = f"weight update v{update.manifest.version}: {error}"
            if isinstance(error, OffTrainerError) and not reset:
                self.resync_reason = self.last_error
            raise

    def _take_update(self, update: WeightUpdate, fetch: Fetch, *, reset: bool = False) -> ApplyResult:
        """The subscriber's intake: a registration's answer swapped in now, a push at the next safe point (the
        trainer never waits for a batch)."""
        return self.apply_weight_update(update, fetch, reset=reset, swap="now" if reset else "at_safe_point")

    def add_callbacks(self, *callbacks: BatchCallback) -> None:
        """Call these (in order) around every batch `make_experience` makes; see `BatchCallback`."""
        for callback in callbacks:
            if not isinstance(callback, BatchCallback):
                raise TypeError(f"maker {self.name!r}: a callback needs on_batch_start() and "
                                f"on_batch_end(experiences), got {type(callback).__name__}")
        self.callbacks.extend(callbacks)

    def set_prompts(self, source: PromptSource) -> None:
        """Take the next batches' prompts from `source` (the cursor state is then `source`'s)."""
        if not isinstance(source, PromptSource):
            raise TypeError(f"maker {self.name!r}: a prompt source needs next_batch(count), got "
                            f"{type(source).__name__}")
        self.prompts = source

    def make_experience(self) -> list[Experience]:
        """Generate, score and package one batch (experience_batch_size prompts x group_size responses).

        The batch is sampled with `self.sampling`, or with the `sampling` a `PromptBatch` from the prompt
        source carries; the callbacks are called around it.
        """
        for callback in self.callbacks:
            callback.on_batch_start()
        experiences = self._make_batch()
        for callback in self.callbacks:
            callback.on_batch_end(experiences)
        return experiences

    def _make_batch(self) -> list[Experience]:
        if not self.synced:
            raise RuntimeError(f"maker {self.name!r} has no complete weights from a trainer yet")
        config = self.config
        items = self.prompts.next_batch(config.experience_batch_size)
        sampling = getattr(items, "sampling", None) or self.sampling
        metadata = [item.metadata for item in items for _ in range(config.group_size)]
        start = time.perf_counter()
        # A verified update waiting for a safe point is swapped in before and after the batch, never
        # during it.
        with self.receiver.serving() as version, torch.no_grad():
            fingerprint = self.receiver.fingerprint if config.record_weights_fingerprint else None
            prompts = [item.prompt for item in items for _ in range(config.group_size)]
            if config.seed is not None:
                torch.manual_seed(config.seed * 1_000_003 + self.batches)
            out = self.backend.generate_text(prompts, sampling)
            proof = self._served_proof(version)
            placeholder, batch = self._collate_output(out)
            # Remote roles are asked at once, all together; their answers are collected after the lock.
            pending = self._submit_remote(batch, metadata, version)
            args = (batch.sequences, batch.attention_mask, batch.response_mask)
            values = self.critic(*args).cpu() if self.critic is not None else None
            # Reference log-probs: the temperature-scaled full distribution, finite for every sampleable
            # token.
            ref = self.reference.log_probs(*args, reference_sampling(sampling)).cpu() \
                if self.reference is not None else None
        remote = pending(config.scorer_timeout_s * config.scorer_attempts) if pending is not None else {}
        if "critic" in remote:
            values = remote["critic"].token_scores
        if "reference" in remote:
            ref = remote["reference"].token_scores
        # Scoring needs no synced weights: outside the lock, so a slow verifier never delays a swap.
        rewards, components = self._score(batch, metadata, remote.get("reward"))
        rewards = rewards.detach().float().cpu()  # to the host once per batch, not once per row
        left_out, refused, detail = refused_rows(components, config.group_size)
        self.reward_refused.update(refused)
        self.last_reward_refusal = detail or self.last_reward_refusal
        elapsed = time.perf_counter() - start
        group_ids = [uuid.uuid4().hex for _ in items]
        # The engine of the behaviour log-probs ("hf:float32", "vllm:bfloat16"): the trainers correct
        # the log-probs of any engine but their own (`detached_rl.algorithms.mismatch`).
        engine = getattr(self.backend, "engine", None) or f"{config.backend}:<unknown>"
        experiences = []
        for row, base in enumerate(placeholder):
            if row in left_out:
                continue
            length = base.response_length
            info: dict[str, Any] = {"finished": out.finished[row], **components[row], "engine": engine}
            if ref is not None:  # mean k1 KL to the reference, for inspection (the trainer shapes rewards)
                gap = base.log_probs - ref[row, :length]
                finite = torch.isfinite(gap)  # a bad reference answer: `validate` below refuses it by field
                info["kl"] = float(gap[finite].mean()) if bool(finite.any()) else 0.0
            if fingerprint is not None:
                info["weights_fingerprint"] = fingerprint
            if "critic" in remote:
                info["critic_version"] = remote["critic"].version
            experiences.append(Experience(
                prompt_ids=base.prompt_ids,
                response_ids=base.response_ids,
                log_probs=base.log_probs,
                reward=rewards[row].clone(),
                values=values[row, :length].clone() if values is not None else None,
                ref_log_probs=ref[row, :length].clone() if ref is not None else None,
                policy_version=version,
                maker=self.name,
                group_id=group_ids[row // config.group_size] if config.group_size > 1 else None,
                info=info,
            ).validate())
        if proof is not None and experiences:
            experiences[0].info[PROBE_KEY] = proof
        self.batches += 1
        self.samples_made += len(experiences)
        self.tokens_made += sum(e.response_length for e in experiences)
        self.generate_seconds += elapsed
        return experiences

    def note_rejection(self, error: Exception) -> None:
        """A trainer refused a push. Refused because the engine did not serve the version it names
        (`weights.served_probe`): register again, and read back what the engine serves anew."""
        if SERVED_MISMATCH in str(error):
            self._proof = None
            self.resync_reason = f"a trainer refused a push: {str(error).splitlines()[0][:300]}"

    def _served_proof(self, version: int) -> dict[str, Any] | None:
        """What the engine serves as `version`: its probe log-probs (`weights.served_probe`), read back once
        per version (None for a backend that cannot say)."""
        probe = getattr(self.backend, "probe_log_probs", None)
        if probe is None:
            return None
        if self._proof is None or self._proof["version"] != version:
            self._proof = {"version": version, "log_probs": [round(v, 6) for v in probe(self._probe_ids)]}
        return self._proof

    def _collate_output(self, out: Any) -> tuple[list[Experience], Any]:
        """Generated responses as placeholder experiences (reward 0) and their padded batch on the device."""
        placeholder = [Experience(p, r, lp, torch.tensor(0.0))
                       for p, r, lp in zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True)]
        return placeholder, collate(placeholder, self.tokenizer.pad_token_id, device=self.strategy.device)

    def _submit_remote(self, batch: Any, metadata: list[dict[str, Any]], version: int,
                       roles: frozenset[str] | None = None) -> PendingScores | None:
        """Send the padded batch to the scoring service's roles (`roles`, default all); None without one."""
        if self.scoring is None:
            return None
        request = ScoreRequest(batch.sequences.cpu(), batch.attention_mask.cpu(), batch.response_mask.cpu(),
                               list(metadata), min_version=version)
        if roles is not None:
            return self.scoring.submit(request, roles)
        return self.scoring.submit(request)

    def _score(self, batch: Any, metadata: list[dict[str, Any]], answer: ScoreAnswer | None = None
               ) -> tuple[torch.Tensor, list[dict[str, float]]]:
        """Rewards [B] of a batch and, per sample, the components its scorer reports (empty if none)."""
        if answer is None and self.reward is None:
            pending = self._submit_remote(batch, metadata, NOT_SYNCED, frozenset({"reward"}))
            answer = pending(self.config.scorer_timeout_s * self.config.scorer_attempts)["reward"]
        if answer is not None:
            return answer.rewards, answer.components or [{} for _ in metadata]
        args = (batch.sequences, batch.attention_mask, batch.response_mask)
        with torch.no_grad():
            if hasattr(self.reward, "score_detailed"):
                return self.reward.score_detailed(*args, metadata)
            return self.reward.score(*args, metadata), [{} for _ in metadata]

    def evaluate(self, items: Sequence[Any], sampling: SamplingConfig | None = None,
                 batch_size: int = 32, min_version: int | None = None) -> list[dict[str, Any]]:
        """Answer held-out prompts (greedy by default) and grade them with this maker's reward; one dict each.

        Each dict holds the prompt, the decoded response, the reward and its components, and
        the policy version that answered. Counters and the prompt cursor are left alone. With
        `min_version`, grading waits (up to `weight_timeout_s`) for that version to be served, then
        grades with what is served (its version is in every dict).
        """
        if batch_size < 1:
            raise ValueError(f"evaluate: batch_size must be >= 1, got {batch_size}")
        if min_version is not None:
            self.wait_for_served_version(min_version, self.config.weight_timeout_s)
        if not self.synced:
            raise RuntimeError(f"maker {self.name!r} has no complete weights from a trainer yet")
        sampling = sampling or dataclasses.replace(self.sampling, do_sample=False)
        prompt_items = [as_prompt_item(item) for item in items]
        results: list[dict[str, Any]] = []
        tokenizer = self.tokenizer
        for begin in range(0, len(prompt_items), batch_size):
            chunk = prompt_items[begin : begin + batch_size]
            with self.receiver.serving() as version, torch.no_grad():
                out = self.backend.generate_text([item.prompt for item in chunk], sampling)
            _, batch = self._collate_output(out)
            rewards, components = self._score(batch, [item.metadata for item in chunk])
            texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
            for item, text, reward, parts, ids in zip(chunk, texts, rewards.tolist(), components,
                                                       out.response_ids, strict=True):
                results.append({"prompt": prompt_text(item.prompt),
                                "response": text, "reward": float(reward), **parts,
                                "response_length": len(ids), "policy_version": version})
        return results

    def wait_for_served_version(self, version: int, timeout: float, poll_s: float = 0.05) -> bool:
        """Wait until the served weights are at `version` or newer (True), or `timeout` s pass (False)."""
        deadline = time.monotonic() + timeout
        while self.receiver.version < version:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    def state_dict(self) -> dict[str, Any]:
        """The prompt cursor and counters, to resume a maker where it stopped."""
        prompts = self.prompts.state_dict() if hasattr(self.prompts, "state_dict") else None
        return {"prompts": prompts, "batches": self.batches, "samples_made": self.samples_made,
                "tokens_made": self.tokens_made}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (the weights come from the trainer, not from here)."""
        if state.get("prompts") is not None:
            if not hasattr(self.prompts, "load_state_dict"):
                raise ValueError("this maker's prompt source has no cursor to restore (field prompts)")
            self.prompts.load_state_dict(state["prompts"])
        self.batches, self.samples_made = state["batches"], state["samples_made"]
        self.tokens_made = state["tokens_made"]

    @property
    def backend_name(self) -> str:
        """The backend that generates ("hf", "vllm"; what `MakerConfig.backend: auto` chose)."""
        engine = getattr(self.backend, "engine", None)
        return engine.partition(":")[0] if engine else self.config.backend

    def status(self) -> dict[str, Any]:
        """Counters for `detached-rl status` (cheap; safe to call while a batch is generated)."""
        receiver = self.receiver
        return {
            "name": self.name,
            "role": "maker",
            "backend": self.backend_name,
            # "<backend>:<dtype>" of what it serves ("vllm:float32"): an "auto" dtype shows what it chose
            "engine": getattr(self.backend, "engine", self.config.backend),
            "policy_version": self.receiver.version,
            "synced": self.synced,
            "batches": self.batches,
            "samples_made": self.samples_made,
            "tokens_made": self.tokens_made,
            "tokens_per_s": self.tokens_made / self.generate_seconds if self.generate_seconds else 0.0,
            "samples_per_s": self.samples_made / self.generate_seconds if self.generate_seconds else 0.0,
            "last_error": self.last_error or (str(receiver.last_error) if receiver.last_error else None),
            "reward_refused": dict(self.reward_refused), "last_reward_refusal": self.last_reward_refusal,
            # Updates acknowledged, swapped in, and dropped for a newer one before their swap; the one
            # waiting.
            "weight_updates": {"received": receiver.received, "swapped": receiver.swapped,
                               "superseded": receiver.superseded, "swap_failures": receiver.swap_failures,
                               "pending_version": receiver.pending_version},
        }
