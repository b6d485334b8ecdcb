"""Scorers: the reward, reference and critic roles, served to many makers by named actor groups.

For models too big to copy into every maker (the `train_prompts_on_ray` shape), a maker sends
each generated batch to scorer actors and composes its experience from their answers.
This module is the plain-Python part, testable without Ray:

* `ScoreRequest`: one maker's padded batch. `sequences` [B, P+R] holds left-padded prompts
  and right-padded responses; `attention_mask` [B, P+R]; `response_mask` [B, R] (responses are
  the last R columns, as in `ExperienceBatch`); `metadata` one dict per row (e.g. the answer).
* `Scorer`: one role over one model. `answer(requests)` merges the requests of several makers
  into one padded batch, runs one forward pass, and splits the result back per request:
  `reward` -> rewards [B] (+ components), `reference` -> log-probs [B, R], `critic` -> values
  [B, R]. A critic scorer mirrors the trainer's critic: it takes the `critic/` part of the
  trainer's weight updates (`apply_weight_update`) and answers a request only with weights
  at least as new as the policy version the request names.
* `RequestBatcher`: requests from many threads (one per maker call) wait at most
  `max_wait_s` to be merged; one worker thread runs the batches.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from detached_rl.core.devices import to_device
from detached_rl.core.resources import PLACEMENT_STRATEGIES, check_resources
from detached_rl.core.sampling import SamplingConfig
from detached_rl.core.weight_receiver import WeightReceiver
from detached_rl.core.weight_sync import ApplyResult, Fetch, WeightUpdate, restrict_update
from detached_rl.models.actor import reference_sampling

SCORER_ROLES = ("reward", "reference", "critic")


@dataclass
class ScorerGroupConfig:
    """How many workers serve a role and where they go (one placement-group bundle per worker)."""

    num_nodes: int = 1
    num_gpus_per_node: int = 0  # 0: CPU workers, one per node; else one worker per GPU
    num_cpus_per_worker: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # custom resources per bundle, to pick nodes
    placement_strategy: str = "PACK"
    max_batch_rows: int = 64  # rows merged into one forward pass
    max_wait_s: float = 0.01  # how long a request waits for others to merge with
    timeout_s: float = 300.0  # placing and starting the group

    def __post_init__(self) -> None:
        for name in ("num_nodes", "max_batch_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ScorerGroupConfig.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.num_gpus_per_node, bool) or not isinstance(self.num_gpus_per_node, int) \
                or self.num_gpus_per_node < 0:
            raise ValueError(f"ScorerGroupConfig.num_gpus_per_node must be an int >= 0, got {self.num_gpus_per_node!r}")
        if not self.num_cpus_per_worker >= 0 or (self.num_cpus_per_worker == 0 and self.num_gpus_per_node == 0
                                                 and not self.resources):
            raise ValueError(f"ScorerGroupConfig.num_cpus_per_worker must be > 0 for CPU workers, got "
                             f"{self.num_cpus_per_worker!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"ScorerGroupConfig.placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                             f"got {self.placement_strategy!r}")
        check_resources(self.resources, "ScorerGroupConfig.resources")
        if not self.max_wait_s >= 0 or not self.timeout_s > 0:
            raise ValueError("ScorerGroupConfig.max_wait_s must be >= 0 and timeout_s > 0")

    @property
    def num_workers(self) -> int:
        """Workers in the group: one per GPU, or one per node for CPU workers."""
        return self.num_nodes * max(1, self.num_gpus_per_node)

    def bundle(self) -> dict[str, float]:
        """The resources of one worker's bundle."""
        bundle: dict[str, float] = {"CPU": self.num_cpus_per_worker} if self.num_cpus_per_worker else {}
        if self.num_gpus_per_node:
            bundle["GPU"] = 1
        bundle.update(self.resources)
        return bundle


class ScoreRequestError(ValueError):
    """A malformed score request; the message names the field."""


@dataclass
class ScoreRequest:
    """A maker's padded batch to score (see the module docstring for the layout)."""

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    metadata: list[dict[str, Any]] = field(default_factory=list)
    min_version: int = -1  # critic: answer with weights of at least this policy version

    @property
    def size(self) -> int:
        """Rows in the batch."""
        return int(self.sequences.shape[0])

    @property
    def prompt_length(self) -> int:
        """P: columns before the responses."""
        return int(self.sequences.shape[1] - self.response_mask.shape[1])

    def validate(self) -> ScoreRequest:
        """Check shapes and dtypes; raise `ScoreRequestError` naming the field."""
        for name in ("sequences", "attention_mask", "response_mask"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dim() != 2:
                raise ScoreRequestError(f"{name}: expected a 2-D tensor, got {_describe(value)}")
            if value.dtype.is_floating_point or value.dtype == torch.bool:
                raise ScoreRequestError(f"{name}: expected an integer tensor, got {value.dtype}")
        rows, width = self.sequences.shape
        if rows < 1:
            raise ScoreRequestError("sequences: the batch is empty")
        if tuple(self.attention_mask.shape) != (rows, width):
            raise ScoreRequestError(f"attention_mask: shape {tuple(self.attention_mask.shape)} != sequences "
                                    f"{(rows, width)}")
        if self.response_mask.shape[0] != rows or not 1 <= self.response_mask.shape[1] < width:
            raise ScoreRequestError(f"response_mask: shape {tuple(self.response_mask.shape)} does not fit "
                                    f"sequences {(rows, width)} (needs [B, R] with 1 <= R < P+R)")
        if not bool(((self.response_mask == 0) | (self.response_mask == 1)).all()):
            raise ScoreRequestError("response_mask: values must be 0 or 1")
        if not isinstance(self.metadata, list) or (self.metadata and len(self.metadata) != rows):
            raise ScoreRequestError(f"metadata: expected a list of {rows} dicts")
        if not all(isinstance(m, dict) for m in self.metadata):
            raise ScoreRequestError("metadata: every entry must be a dict")
        return self


@dataclass
class ScoreAnswer:
    """A scorer's answer to one request: rewards [B] (+ components) or per-token scores [B, R]."""

    role: str
    rewards: torch.Tensor | None = None
    components: list[dict[str, float]] | None = None
    token_scores: torch.Tensor | None = None  # reference log-probs or critic values
    version: int | None = None  # critic: the weights' policy version
    batched_requests: int = 1  # how many requests the forward pass served
    seconds: float = 0.0


PendingScores = Callable[[float], dict[str, ScoreAnswer]]
"""Waits at most the given seconds and returns each role's answer (raises if a role cannot answer)."""


class ScoringService(Protocol):
    """What a maker sends its batches to when some roles are served elsewhere (remote scorer groups)."""

    roles: frozenset[str]

    def attach(self) -> None:
        """Find the services of every role (may wait); called before the first batch."""
        ...

    def submit(self, request: ScoreRequest, roles: frozenset[str] | None = None) -> PendingScores:
        """Ask every role (or `roles`) at once, without waiting; the returned function collects the answers."""
        ...


class LocalScoring:
    """A `ScoringService` over in-process `Scorer`s (tests, and one-process runs)."""

    def __init__(self, scorers: dict[str, Scorer]) -> None:
        for role, scorer in scorers.items():
            if role != scorer.role:
                raise ValueError(f"LocalScoring: scorer under {role!r} serves role {scorer.role!r}")
        self.scorers = dict(scorers)
        self.roles = frozenset(scorers)

    def attach(self) -> None:
        """Nothing to find: the scorers are in this process."""

    def submit(self, request: ScoreRequest, roles: frozenset[str] | None = None) -> PendingScores:
        """Answer at once; the returned function only hands the answers over."""
        asked = self.roles if roles is None else roles
        answers = {role: self.scorers[role].answer([request])[0] for role in asked}
        return lambda timeout: answers


def merge_requests(requests: Sequence[ScoreRequest]) -> ScoreRequest:
    """One padded batch of several requests: prompts left-padded to the longest, responses right-padded."""
    prompt_length = max(r.prompt_length for r in requests)
    response_length = max(int(r.response_mask.shape[1]) for r in requests)

    def pad(value: torch.Tensor, left: int, right: int) -> torch.Tensor:
        return torch.nn.functional.pad(value, (left, right), value=0)

    sequences, attention, response = [], [], []
    for r in requests:
        left, right = prompt_length - r.prompt_length, response_length - int(r.response_mask.shape[1])
        sequences.append(pad(r.sequences, left, right))
        attention.append(pad(r.attention_mask, left, right))
        response.append(pad(r.response_mask, 0, right))
    metadata = [m for r in requests for m in (r.metadata or [{} for _ in range(r.size)])]
    return ScoreRequest(torch.cat(sequences), torch.cat(attention), torch.cat(response), metadata,
                        max(r.min_version for r in requests))


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

        `reset`: the update answers this scorer's registration (see `WeightReceiver.apply`).
        """
        if self.receiver is None:
            raise ValueError(f"a {self.role!r} scorer holds no trained weights; it takes no weight updates")
        restricted, fetch_critic = restrict_update(update, ["critic"], fetch)
        result = self.receiver.apply(restricted, fetch_critic, timeout=self.weight_timeout_s, reset=reset)
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
                    raise TimeoutError(f"critic scorer holds weights v{self.receiver.version}; a request needs "
                                       f"v{version} and no update came within {timeout:.0f} s")
                self.version_changed.wait(min(remaining, 1.0))

    def answer(self, requests: Sequence[ScoreRequest]) -> list[ScoreAnswer]:
        """Score several requests in one forward pass; one answer per request, in order."""
        for request in requests:
            request.validate()
        start = time.perf_counter()
        merged = merge_requests(requests)
        self.wait_for_version(merged.min_version, self.weight_timeout_s)
        batch = [to_device(t, self.device) for t in (merged.sequences, merged.attention_mask, merged.response_mask)]
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
                 metadata: list[dict[str, Any]]) -> tuple[torch.Tensor | None, list | None, torch.Tensor | None]:
        if self.role == "reward":
            if hasattr(self.model, "score_detailed"):
                rewards, components = self.model.score_detailed(sequences, attention_mask, response_mask, metadata)
                return rewards, components, None
            return self.model.score(sequences, attention_mask, response_mask, metadata), None, None
        if self.role == "reference":
            # The temperature-scaled full distribution (`reference_sampling`): finite for every sampleable token.
            return None, None, self.model.log_probs(sequences, attention_mask, response_mask,
                                                    reference_sampling(self.sampling))
        return None, None, self.model(sequences, attention_mask, response_mask)

    def status(self) -> dict[str, Any]:
        """Counters: requests, batches (forward passes), rows, busy seconds, critic version."""
        return {"role": self.role, "requests": self.requests, "batches": self.batches, "rows": self.rows,
                "busy_seconds": self.busy_seconds, "version": self.version,
                "requests_per_batch": self.requests / self.batches if self.batches else 0.0}


class RequestBatcher:
    """Merges requests submitted from many threads; one worker thread answers them in batches.

    A batch closes when it holds `max_batch_rows` rows or the oldest request has waited
    `max_wait_s`. A request larger than `max_batch_rows` runs alone. If `answer` raises, every
    request of that batch gets the error.
    """

    def __init__(self, answer: Callable[[list[ScoreRequest]], list[ScoreAnswer]], max_batch_rows: int = 64,
                 max_wait_s: float = 0.01) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"RequestBatcher: max_batch_rows must be >= 1, got {max_batch_rows}")
        if not max_wait_s >= 0 or math.isinf(max_wait_s):
            raise ValueError(f"RequestBatcher: max_wait_s must be a finite number >= 0, got {max_wait_s}")
        self._answer = answer
        self.max_batch_rows = max_batch_rows
        self.max_wait_s = max_wait_s
        self._pending: list[tuple[ScoreRequest, Future, float]] = []
        self._condition = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="scorer-batcher", daemon=True)
        self._worker.start()

    def submit(self, request: ScoreRequest) -> Future:
        """Queue a request; the future resolves to its `ScoreAnswer`."""
        request.validate()  # refuse a malformed request here, so it never spoils a merged batch
        future: Future = Future()
        with self._condition:
            if self._closed:
                raise RuntimeError("RequestBatcher is closed")
            self._pending.append((request, future, time.monotonic()))
            self._condition.notify_all()
        return future

    def close(self) -> None:
        """Answer what is queued, then stop the worker."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._worker.join(timeout=60)

    def _take_batch(self) -> list[tuple[ScoreRequest, Future, float]]:
        with self._condition:
            while True:
                if self._pending:
                    rows = sum(r.size for r, _, _ in self._pending)
                    waited = time.monotonic() - self._pending[0][2]
                    if rows >= self.max_batch_rows or waited >= self.max_wait_s or self._closed:
                        break
                    self._condition.wait(self.max_wait_s - waited)
                elif self._closed:
                    return []
                else:
                    self._condition.wait()
            batch, rows = [], 0
            while self._pending and (not batch or rows + self._pending[0][0].size <= self.max_batch_rows):
                item = self._pending.pop(0)
                batch.append(item)
                rows += item[0].size
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                return
            try:
                answers = self._answer([request for request, _, _ in batch])
            except Exception as error:  # noqa: BLE001 - every caller of the batch gets it
                for _, future, _ in batch:
                    future.set_exception(error)
                continue
            for (_, future, _), answer in zip(batch, answers, strict=True):
                future.set_result(answer)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return type(value).__name__
