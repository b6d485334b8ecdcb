"""Ray shells for scorer groups: named workers that serve one role (reward, reference, critic) to many makers.

A scorer group `<prefix>` is an `ActorGroup` of `num_nodes x max(1, num_gpus_per_node)` detached,
named workers `<prefix>_0` ... in one detached placement group `<prefix>-placement`, one bundle per
worker (`ScorerGroupConfig`). Each worker wraps a `Scorer` and a `RequestBatcher`: requests of
several makers that arrive within `max_wait_s` are answered by one forward pass.

A maker configured with scorer group names talks to them through `RemoteScoring`: it puts its
batch into the object store once, asks every role at once (object refs; it waits for none
before asking the next) and collects the answers. A worker that is down or does not answer in
time is retried on the group's next worker; after `attempts` tries the scorer is reported
down with its name.

A critic scorer mirrors the trainer's critic: it registers with the trainers like a maker, so
the trainers push their weight updates to it too, and it keeps only the `critic/` tensors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import ray

from detached_rl.actors.group import ActorGroup, worker_names
from detached_rl.actors.placement import actor_device
from detached_rl.actors.transport import attach, get_all, resolve_namespace
from detached_rl.core.sampling import SamplingConfig
from detached_rl.scorer.batching import RequestBatcher
from detached_rl.scorer.config import SCORER_ROLES, ScorerGroupConfig
from detached_rl.scorer.core import Scorer
from detached_rl.scorer.requests import ScoreAnswer, ScoreRequest
from detached_rl.scorer.service import PendingScores
from detached_rl.weights.ray_wire import ray_fetch
from detached_rl.weights.update import ApplyResult, Fetch, WeightUpdate

logger = logging.getLogger(__name__)


class ScorerUnavailableError(RuntimeError):
    """A scorer group did not answer after its retries; the message names the group and the worker."""


def scorer_names(prefix: str, num_workers: int) -> list[str]:
    """The worker names of a scorer group."""
    return worker_names(prefix, num_workers)


@ray.remote(concurrency_groups={"score": 16, "model_io": 1, "control": 1})
class ScorerWorker:
    """A named scorer worker: one role, requests batched across makers, critic weights from the trainers."""

    def __init__(
        self,
        name: str,
        group: str,
        group_size: int,
        role: str,
        model_factory: Callable[[], Any],
        sampling: SamplingConfig | None = None,
        namespace: str | None = None,
        trainer_names: Sequence[str] = (),
        max_batch_rows: int = 64,
        max_wait_s: float = 0.01,
        attach_timeout_s: float = 300.0,
    ) -> None:
        if role not in SCORER_ROLES:
            raise ValueError(f"ScorerWorker {name!r}: role must be one of {SCORER_ROLES}, got {role!r}")
        if role == "critic" and not trainer_names:
            raise ValueError(f"critic scorer {name!r} needs the trainer names (its weights come from them)")
        self.name, self.group, self.group_size = name, group, group_size
        self.namespace = resolve_namespace(namespace)
        from detached_rl.strategies import NaiveStrategy

        self.core = Scorer(role, model_factory(), sampling,
                           device=NaiveStrategy(device=actor_device()).device)
        self.batcher = RequestBatcher(self.core.answer, max_batch_rows=max_batch_rows, max_wait_s=max_wait_s)
        self.trainer_names = list(trainer_names)
        self.last_error: str | None = None
        if role == "critic":
            # Register in the background: trainers may start after their scorers.
            threading.Thread(target=self._register, args=(attach_timeout_s,), daemon=True,
                             name="scorer-register").start()

    def _register(self, timeout: float) -> None:
        try:
            handles = [attach(t, self.namespace, timeout) for t in self.trainer_names]

            def ask(fingerprint: str | None, dtype: str | None) -> list[WeightUpdate | None]:
                calls = [h.register_maker.remote(self.name, fingerprint, dtype) for h in handles]
                return get_all(calls, timeout)

            assert self.core.subscriber is not None  # a critic's
            self.core.subscriber.subscribe(ask, self._receiving)
        except Exception as error:  # noqa: BLE001 - shown by status; requests wait for weights meanwhile
            self.last_error = f"registering with trainers {self.trainer_names}: {error}"
            logger.exception("scorer %s could not register with its trainers", self.name)

    @contextlib.contextmanager
    def _receiving(self, offered: Sequence[WeightUpdate | None]) -> Iterator[Fetch]:
        """The fetch a registration's answer is pulled with (stalls fail it after `weight_timeout_s`)."""
        yield ray_fetch(self.core.weight_timeout_s)

    @ray.method(concurrency_group="score")
    def score(self, request: ScoreRequest, timeout: float = 300.0) -> ScoreAnswer:
        """Answer one maker's request (merged with others that arrive meanwhile)."""
        return self.batcher.submit(request).result(timeout=timeout)

    @ray.method(concurrency_group="model_io")
    def apply_weight_update(self, update: WeightUpdate) -> ApplyResult:
        """Critic: take the `critic/` tensors of a trainer's update (refused as a whole on any error)."""
        fetch = ray_fetch(self.core.weight_timeout_s)
        try:
            if self.core.subscriber is None:  # refused, naming the role
                return self.core.apply_weight_update(update, fetch)
            return self.core.subscriber.receive(update, fetch)
        except Exception as error:
            self.last_error = f"weight update v{update.manifest.version}: {error}"
            raise

    @ray.method(concurrency_group="control")
    def group_info(self) -> dict[str, Any]:
        """The group this worker belongs to: prefix, size and role."""
        return {"group": self.group, "size": self.group_size, "role": self.core.role}

    @ray.method(concurrency_group="control")
    def status(self) -> dict[str, Any]:
        """Role, counters, critic version and where the worker runs; answers while requests are scored."""
        status = self.core.status()
        context = ray.get_runtime_context()
        status.update(name=self.name, scorer_role=status.pop("role"), role="scorer", state="serving",
                      policy_version=status["version"] if status["version"] is not None else "",
                      group=self.group, node_id=context.get_node_id(), pid=os.getpid(),
                      last_error=self.last_error)
        return status

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        """Nothing to drain: a scorer serves until it is removed (trainers call this
        on their makers at the end)."""


def start_scorer_group(
    prefix: str,
    role: str,
    model_factory: Callable[[], Any],
    group: ScorerGroupConfig | None = None,
    sampling: SamplingConfig | None = None,
    namespace: str | None = None,
    trainer_names: Sequence[str] = (),
) -> list[Any]:
    """Create a scorer group's named workers in a detached placement group; wait until each has its model.

    If any worker fails to start, every worker and the placement group are removed and the error is raised.
    """
    group = group or ScorerGroupConfig()
    namespace = resolve_namespace(namespace)
    count = group.num_workers
    options = {"num_cpus": group.num_cpus_per_worker, "num_gpus": 1 if group.num_gpus_per_node else 0,
               "resources": dict(group.resources) or None}
    return ActorGroup(prefix, count, namespace, kind="scorer group").start(
        ScorerWorker,
        lambda index, name: (name, prefix, count, role, model_factory, sampling, namespace,
                             list(trainer_names),
                             group.max_batch_rows, group.max_wait_s),
        group.bundle(), group.placement_strategy, group.timeout_s, options,
        ready=lambda handles: get_all([h.group_info.remote() for h in handles], timeout=group.timeout_s),
    )


def stop_scorer_group(prefix: str, num_workers: int, namespace: str | None = None) -> None:
    """Kill a scorer group's workers and remove its placement group (missing parts are skipped)."""
    ActorGroup(prefix, num_workers, resolve_namespace(namespace), kind="scorer group").stop()


class RemoteScoring:
    """A maker's client of scorer groups (a `ScoringService`): ask all roles at once, retry, report."""

    RETRIED = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError,
               ray.exceptions.ActorUnavailableError)

    def __init__(self, groups: dict[str, str], namespace: str | None = None, attach_timeout_s: float = 120.0,
                 timeout_s: float = 120.0, attempts: int = 3) -> None:
        unknown = sorted(set(groups) - set(SCORER_ROLES))
        if unknown:
            raise ValueError(f"RemoteScoring: unknown role {unknown[0]!r} (roles: {SCORER_ROLES})")
        self.groups = dict(groups)
        self.roles = frozenset(groups)
        self.namespace = resolve_namespace(namespace)
        self.attach_timeout_s = attach_timeout_s
        self.timeout_s = timeout_s
        self.attempts = attempts
        self._workers: dict[str, list[str]] = {}
        self._turn: dict[str, int] = dict.fromkeys(groups, 0)
        self.retries = 0

    def attach(self) -> None:
        """Find every role's group now (waiting for its first worker), not inside the first batch."""
        for role in self.roles:
            self.workers(role)

    def workers(self, role: str) -> list[str]:
        """The worker names of the role's group (asked of worker 0, which is waited for)."""
        if role not in self._workers:
            prefix = self.groups[role]
            info = ray.get(attach(f"{prefix}_0", self.namespace, self.attach_timeout_s).group_info.remote(),
                           timeout=self.timeout_s)
            if info["role"] != role:
                raise ValueError(f"scorer group {prefix!r} serves role {info['role']!r}, not {role!r}")
            self._workers[role] = scorer_names(prefix, info["size"])
        return self._workers[role]

    def _ask(self, role: str, request_ref: Any) -> tuple[str, Any]:
        workers = self.workers(role)
        name = workers[self._turn[role] % len(workers)]
        self._turn[role] += 1
        try:
            handle = ray.get_actor(name, namespace=self.namespace)
        except ValueError:
            return name, None
        return name, handle.score.remote(request_ref, self.timeout_s)

    def submit(self, request: ScoreRequest, roles: frozenset[str] | None = None) -> PendingScores:
        """Put the request once and ask each role's next worker; the returned
        function collects and retries."""
        request.validate()
        request_ref = ray.put(request)
        asked = {role: self._ask(role, request_ref) for role in (self.roles if roles is None else roles)}

        def collect(timeout: float) -> dict[str, ScoreAnswer]:
            deadline = time.monotonic() + timeout
            answers = {}
            for role, (name, ref) in asked.items():
                answers[role] = self._collect(role, name, ref, request_ref, deadline)
            return answers

        return collect

    def _collect(self, role: str, name: str, ref: Any, request_ref: Any, deadline: float) -> ScoreAnswer:
        last = "not found"
        for attempt in range(self.attempts):
            if ref is not None:
                remaining = max(0.01, min(self.timeout_s, deadline - time.monotonic()))
                try:
                    return ray.get(ref, timeout=remaining)
                except self.RETRIED as error:
                    text = str(error).strip()
                    last = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
            if attempt + 1 < self.attempts and time.monotonic() < deadline:
                self.retries += 1
                logger.warning("scorer %s (%s) failed (%s); retrying on the next worker", name, role, last)
                name, ref = self._ask(role, request_ref)
        raise ScorerUnavailableError(
            f"{role} scorer group {self.groups[role]!r} did not answer after {self.attempts} attempts "
            f"(last worker {name!r}: {last})"
        )
