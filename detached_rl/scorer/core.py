"""`Scorer`: one role over one model, answering batches of requests with one forward pass per batch.

`answer(requests)` merges the requests of several makers into one padded batch, runs one forward pass, and
splits the result back per request: `reward` -> rewards [B] (+ components), `reference` -> log-probs [B, R],
`critic` -> values [B, R]. A critic scorer mirrors the trainer's critic: it takes the `critic/` part of the
trainer's weight updates (`apply_weight_update`) and answers a request only with weights at least as new as
the policy version the request names.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from detached_rl.core.devices import to_device
from detached_rl.core.sampling import SamplingConfig
from detached_rl.scorer.config import SCORER_ROLES
from detached_rl.scorer.requests import ScoreAnswer, ScoreRequest, merge_requests
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.subscriber import WeightSubscriber
from detached_rl.weights.update import ApplyResult, Fetch, WeightUpdate, restrict_update


class Scorer:
    """One role over one model; answers batches of requests with one forward pass per batch.

    `model`: a `RewardScorer` for "reward", an `Actor` for "reference", a `Critic` for "critic".
    `sampling`: the makers' sampling settings (the reference's log-probs use its temperature over the full
    vocabulary, no top-k/top-p: `reference_sampling`).
    """

    def __init__(self, role: str, model: Any, sampling: SamplingConfig | None = None,
                 device: torch.device | None = None, weight_timeout_s: float = 300.0) -> None:
        if role not in SCORER_ROLES:
            raise ValueError(f"Scorer: role must be one of {SCORER_ROLES}, got {role!r}")
        self.role = role
        self.device = device or torch.device("cpu")
        self.sampling = sampling or SamplingConfig()
        self.model = model.to(self.device).eval() if isinstance(model, torch.nn.Module) else model
        self.weight_timeout_s = weight_timeout_s
        self.lock = threading.Lock()  # forward passes and weight swaps take turns
        self.version_changed = threading.Condition()
        self.receiver: WeightReceiver | None = None
        if role == "critic":
            # Starts below any trainer version: the first update (offered on registration) is always taken.
            self.receiver = WeightReceiver({"critic": self.model}, lock=self.lock, version=-1)
        # Critic: registers with the trainers and takes their pushes through the weight path's subscriber.
        self.subscriber = (None if self.receiver is None
                           else WeightSubscriber(self.receiver, self.apply_weight_update))
        self.requests = 0
        self.batches = 0
        self.rows = 0
        self.busy_seconds = 0.0

    @property
    def version(self) -> int | None:
        """The critic weights' policy version (None for roles without trained weights)."""
        return self.receiver.version if self.receiver is not None else None

    def apply_weight_update(self, update: WeightUpdate, fetch: Fetch, reset: bool = False) -> ApplyResult:
        """Critic: take the `critic/` tensors of a trainer's update (refused as a whole on any error).

        `reset`: the update answers this scorer's registration (see `WeightReceiver.receive`).
        """
        if self.receiver is None:
            raise ValueError(f"a {self.role!r} scorer holds no trained weights; it takes no weight updates")
        restricted, fetch_critic = restrict_update(update, ["critic"], fetch)
        result = self.receiver.receive(restricted, fetch_critic, timeout=self.weight_timeout_s, reset=reset)
        with self.version_changed:
            self.version_changed.notify_all()
        return result

    def wait_for_version(self, version: int, timeout: float) -> None:
        """Critic: block until the weights are at least `version`; TimeoutError naming both versions."""
        if self.receiver is None or version < 0:
            return
        deadline = time.monotonic() + timeout
        with self.version_changed:
            while self.receiver.version < version:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"critic scorer holds weights v{self.receiver.version}; a "
                                       f"request needs v{version} and no update came within {timeout:.0f} s")
                self.version_changed.wait(min(remaining, 1.0))

    def answer(self, requests: Sequence[ScoreRequest]) -> list[ScoreAnswer]:
        """Score several requests in one forward pass; one answer per request, in order."""
        for request in requests:
            request.validate()
        start = time.perf_counter()
        merged = merge_requests(requests)
        self.wait_for_version(merged.min_version, self.weight_timeout_s)
        batch = [to_device(t, self.device)
                 for t in (merged.sequences, merged.attention_mask, merged.response_mask)]
        with self.lock, torch.no_grad():
            version = self.version
            rewards, components, token_scores = self._forward(*batch, merged.metadata)
        # To the host once for the merged batch; each answer then takes (a copy of) its rows.
        rewards = rewards.float().cpu() if rewards is not None else None
        token_scores = token_scores.float().cpu() if token_scores is not None else None
        elapsed = time.perf_counter() - start
        answers, row = [], 0
        for request in requests:
            rows = slice(row, row + request.size)
            width = int(request.response_mask.shape[1])
            answers.append(ScoreAnswer(
                role=self.role,
                rewards=rewards[rows].clone() if rewards is not None else None,
                components=components[rows] if components is not None else None,
                token_scores=token_scores[rows, :width].clone() if token_scores is not None else None,
                version=version, batched_requests=len(requests), seconds=elapsed,
            ))
            row += request.size
        self.requests += len(requests)
        self.batches += 1
        self.rows += merged.size
        self.busy_seconds += elapsed
        return answers

    def _forward(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                 metadata: list[dict[str, Any]]) -> tuple[torch.Tensor | None, list | None,
                                                          torch.Tensor | None]:
        if self.role == "reward":
            if hasattr(self.model, "score_detailed"):
                rewards, components = self.model.score_detailed(sequences, attention_mask, response_mask,
                                                                metadata)
                return rewards, components, None
            return self.model.score(sequences, attention_mask, response_mask, metadata), None, None
        if self.role == "reference":
            # The temperature-scaled full distribution (`reference_sampling`): finite
            # for every sampleable token. Imported here: a reward scorer never loads transformers for it.
            from detached_rl.models.actor import reference_sampling

            return None, None, self.model.log_probs(sequences, attention_mask, response_mask,
                                                    reference_sampling(self.sampling))
        return None, None, self.model(sequences, attention_mask, response_mask)

    def status(self) -> dict[str, Any]:
        """Counters: requests, batches (forward passes), rows, busy seconds, critic version."""
        return {"role": self.role, "requests": self.requests, "batches": self.batches, "rows": self.rows,
                "busy_seconds": self.busy_seconds, "version": self.version,
                "requests_per_batch": self.requests / self.batches if self.batches else 0.0}
