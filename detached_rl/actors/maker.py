"""The `ExperienceMakerHolder` actor: a named maker that attaches to its trainers, generates, pushes and takes
weights.

Concurrency groups: `experience_io` (start, status, stop, save_state, load_state), `model_io`
(apply_weight_update), `compute` (run, sync, evaluate), `progress` (transfer_progress: answered while
an update is received, so a trainer tells a slow transfer from a dead one). Each group runs in its own
thread, so a status query or a weight update is answered while a batch is generated. What the maker decides
between batches is `MakerLoop`'s (detached_rl/maker/loop.py); this shell only finds its trainers
by name and carries the pushes to them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import ray

from detached_rl.actors.placement import actor_device
from detached_rl.actors.transport import (
    PIECED_PUSH_BYTES,
    attach,
    get_all,
    put_payload,
    resolve_namespace,
)
from detached_rl.core.checkpoint import has_checkpoint, load_state, save_atomic
from detached_rl.core.prompts import PromptSource
from detached_rl.core.sampling import SamplingConfig
from detached_rl.core.transfer import TransferProgress
from detached_rl.maker.config import ATTACH_TIMEOUT_S, MakerConfig
from detached_rl.maker.loop import MakerLoop
from detached_rl.maker.pusher import ExperiencePusher
from detached_rl.strategies import NaiveStrategy, Strategy
from detached_rl.weights.ray_wire import node_ip, relayed_piece, tracked_fetch
from detached_rl.weights.update import ApplyResult, WeightUpdate

if TYPE_CHECKING:
    from detached_rl.maker.experience_maker import MakerModels

logger = logging.getLogger(__name__)


# `evaluation` apart from `compute`: the held-out curve is graded while `run` generates (one batch at a time
# under the same generation lock).
# relay: pieces pulled at once for makers this one relays to (each task waits for its piece)
MAKER_GROUPS = {"experience_io": 1, "model_io": 1, "compute": 1, "progress": 1, "evaluation": 1, "relay": 4}


class MakerShell:
    """A named experience maker: attaches to its trainers by name, generates, pushes, receives weights.

    The plain class; `ExperienceMakerHolder` is it as a Ray actor with `MAKER_GROUPS`. Subclass this
    (e.g. `detached_rl.compat.coati.CoatiMakerHolder`) and wrap the subclass with `ray.remote` the same way.
    """

    def __init__(
        self,
        name: str,
        trainer_names: Sequence[str],
        model_factory: Callable[[], MakerModels],
        prompts: PromptSource | Callable[[], PromptSource],
        config: MakerConfig | None = None,
        namespace: str | None = None,
        strategy_factory: Callable[[], Strategy] | None = None,
        attach_timeout_s: float = ATTACH_TIMEOUT_S,
        resume_on_restart: bool = True,
        state_path: str | None = None,
    ) -> None:
        if not trainer_names:
            raise ValueError("maker {name!r}: trainer_names is empty")
        self.name = name
        self.trainer_names = list(trainer_names)
        if strategy_factory is not None and not callable(strategy_factory):
            raise TypeError(f"maker {name!r}: strategy_factory must be a callable returning a Strategy, got "
                            f"{type(strategy_factory).__name__}")
        self.namespace = resolve_namespace(namespace)
        self.attach_timeout_s = attach_timeout_s
        source = prompts() if callable(prompts) and not hasattr(prompts, "next_batch") else prompts
        strategy = strategy_factory() if strategy_factory else NaiveStrategy(device=actor_device())
        scoring = None
        if config is not None and config.scorers:
            from detached_rl.actors.scorer import RemoteScoring

            scoring = RemoteScoring(config.scorers, self.namespace, attach_timeout_s, config.scorer_timeout_s,
                                    config.scorer_attempts)
        # imported here, not with the module: a driver that looks this maker up by name imports the module
        from detached_rl.maker.experience_maker import ExperienceMaker

        self.core = ExperienceMaker(name, model_factory(), source, config, strategy, scoring)
        self.device = strategy.device
        self._stop = threading.Event()
        self._running = False
        self._handles: dict[str, Any] = {}  # trainer name -> handle; dropped when that trainer dies
        # Where the prompt cursor and counters are saved after every pushed batch, and resumed from.
        self.state_path = state_path
        if state_path is not None and has_checkpoint(state_path):
            self.core.load_state_dict(load_state(state_path))
        save = None if state_path is None else functools.partial(save_atomic, directory=state_path)
        self.loop = MakerLoop(self.core, self._stop, save,
                              resync=functools.partial(self._attach_trainers, True))
        self._handles_lock = threading.Lock()
        self._transfers: list[TransferProgress] = []  # weight transfers under way (registration, push)
        # (bytes, seconds) of the latest registration answer pulled from the trainers: told when admitted
        self._registration_pull: tuple[int, float] | None = None
        self._first_registration: tuple[float, int] | None = None  # (monotonic time, version) it ended at
        self.restarts = (ray.get_runtime_context().was_current_actor_reconstructed if ray.is_initialized()
                         else False)
        if self.restarts and resume_on_restart:
            # Ray restarted this actor after its process died: carry on feeding the trainers. `run`
            # re-attaches by name and pulls the trainers' current weights before it generates.
            self.start()

    def _attach_trainers(self, force: bool = False) -> None:
        """Find every trainer by name, register with it and start from the newest weights any of them offers
        (with `force`, also from older ones: this maker found its weights off its trainers')."""
        handles = {t: attach(t, self.namespace, self.attach_timeout_s) for t in self.trainer_names}
        self._register_with(list(handles.values()), force)
        with self._handles_lock:
            self._handles = dict(handles)
        self.core.last_error = None  # registered again and holding what they gave: earlier errors are over

    def _register_with(self, handles: list[Any], force: bool = False) -> None:
        """Register with these trainers and take what they offer (`WeightSubscriber.subscribe`)."""
        timeout = self.core.config.weight_timeout_s

        def ask(fingerprint: str | None, dtype: str | None) -> list[WeightUpdate | None]:
            calls = [h.register_maker.remote(self.name, fingerprint, dtype, node_ip()) for h in handles]
            return get_all(calls, timeout)  # node_ip: where it is, for relays

        def runs_of(indices: list[int]) -> list[str]:
            return get_all([handles[i].trainer_run.remote() for i in indices], timeout)

        pulls: list[TransferProgress] = []
        self.core.subscriber.subscribe(ask, functools.partial(self._receiving, record=pulls), runs_of, force)
        snapshots = [progress.snapshot() for progress in pulls]
        if snapshots and sum(s["done"] for s in snapshots) > 0:  # the time to the last bytes, not to now
            seconds = max(s["seconds"] - s["idle_s"] for s in snapshots)
            self._registration_pull = (sum(int(s["done"]) for s in snapshots), seconds)
        if self._first_registration is None:
            self._first_registration = (time.monotonic(), self.core.policy_version)

    def _connect(self) -> None:
        self._attach_trainers()
        self._admit()
        if self.core.scoring is not None:
            self.core.scoring.attach()  # scorer groups found before the first batch holds the generation lock

    def _admit(self) -> None:
        """Ask the trainers which weights this maker's first batches need to be trained (admission): as many
        batches as it makes before the first push's answer, shared among them; the pusher waits for them."""
        config, pusher = self.core.config, self.loop.pusher
        with self._handles_lock:
            handles = dict(self._handles)
        batches = -(-(config.answer_lag + 1) // len(handles))
        samples = config.experience_batch_size * config.group_size
        try:
            pulled = self._registration_pull  # how fast this host took the trainers' answer: ranks its relays
            calls = [h.admit_generation.remote(self.name, samples, batches, pulled) for h in handles.values()]
            answers = get_all(calls, timeout=config.push_timeout_s)
        except Exception as error:  # noqa: BLE001 - unpaced first batches may go stale; the run goes on
            logger.warning("maker %s: no admission from its trainers (%s: %s); its first batches are made "
                           "with the weights it holds", self.name, type(error).__name__, error)
            return
        if pusher is not None:
            for trainer, versions in zip(handles, answers, strict=True):
                pusher.admitted(trainer, versions)

    def _trainer_handle(self, trainer: str) -> Any:
        """The live handle of `trainer`; after it died, the actor now under its name, registered with
        afresh."""
        with self._handles_lock:
            handle = self._handles.get(trainer)
        if handle is not None:
            return handle
        try:
            handle = ray.get_actor(trainer, namespace=self.namespace)
        except ValueError:
            # Said as a ConnectionError: the pusher retries any error `submit` raises (nothing was sent).
            raise ConnectionError(
                f"trainer {trainer!r} is not running (waiting for it to come back)") from None
        self._register_with([handle])
        with self._handles_lock:
            self._handles[trainer] = handle
        return handle

    def _submit(self, trainer: str, experiences: list) -> Future:
        handle = self._trainer_handle(trainer)
        if sum(e.nbytes() for e in experiences if hasattr(e, "nbytes")) > PIECED_PUSH_BYTES:
            # Pulled by the trainer in pieces it counts: the pusher asks how it goes (`_push_progress`).
            call = handle.push_experience_pieces.remote(put_payload(experiences), self.name,
                                                        self.core.config.push_stall_timeout_s)
        else:
            call = handle.push_experience.remote(experiences)
        future = call.future()
        future.add_done_callback(functools.partial(self._forget_if_dead, trainer, handle))
        return future

    def _push_progress(self, trainer: str) -> Future:
        """A future of how `trainer` receives this maker's pushes (`ExperiencePusher`'s `progress`)."""
        with self._handles_lock:
            handle = self._handles.get(trainer)
        if handle is None:
            raise LookupError(f"trainer {trainer!r} is not attached")
        return handle.push_progress.remote(self.name).future()

    def _forget_if_dead(self, trainer: str, handle: Any, future: Future) -> None:
        if isinstance(future.exception(), ray.exceptions.RayActorError):
            with self._handles_lock:
                if self._handles.get(trainer) is handle:
                    del self._handles[trainer]

    def _trainers_finished(self) -> bool:
        """True when every trainer has ended its `fit` and would have stopped this maker (it has nobody to
        feed)."""
        with self._handles_lock:
            handles = list(self._handles.values())
        states = get_all([h.status.remote() for h in handles], timeout=self.core.config.push_timeout_s)
        return all(s["state"] == "done" and s["stops_makers_at_end"] for s in states)

    @ray.method(concurrency_group="compute")
    def sync(self) -> int:
        """Register with the trainers and take the newest weights they offer; returns the policy version
        served.

        The explicit reset of the weight protocol: the maker then follows the run of the trainer that
        offered them, even at an older version (a trainer resumed from a checkpoint) or far ahead.
        """
        self._attach_trainers()
        return self.core.policy_version

    @ray.method(concurrency_group="evaluation")
    def evaluate(self, items: Sequence[Any], sampling: SamplingConfig | None = None,
                 min_version: int | None = None) -> list[dict[str, Any]]:
        """Answer and grade held-out prompts with the current weights (greedy unless `sampling` says
        otherwise), once `min_version` is served if given."""
        return self.core.evaluate(items, sampling, min_version=min_version)

    @ray.method(concurrency_group="compute")
    def run(self, num_batches: int | None = None) -> dict[str, Any]:
        """Generate and push until `num_batches` batches are pushed or `stop()` is called; returns status."""
        self._running = True
        try:
            config = self.core.config
            pusher = ExperiencePusher(
                self._submit, self.trainer_names, max_in_flight=config.max_pushes_in_flight,
                policy=config.push_policy, push_timeout=config.push_timeout_s,
                should_stop=self._stop.is_set, progress=self._push_progress,
                stall_timeout=config.push_stall_timeout_s, on_rejected=self.core.note_rejection,
            )
            self.loop.run(pusher, num_batches, connect=self._connect,
                          trainers_finished=self._trainers_finished)
        finally:
            self._running = False
        return self.status()

    @ray.method(concurrency_group="experience_io")
    def start(self, num_batches: int | None = None) -> bool:
        """Run `run` in a background thread of the actor (it outlives the caller); False if already
        running."""
        if self._running:
            return False
        self._running = True  # set here so a status call right after sees "running"
        threading.Thread(target=self._run_logged, args=(num_batches,), daemon=True, name="maker-run").start()
        return True

    def _run_logged(self, num_batches: int | None) -> None:
        try:
            self.run(num_batches)
        except Exception:  # noqa: BLE001 - recorded in last_error by run, shown by status
            logger.exception("maker %s stopped with an error", self.name)

    @ray.method(concurrency_group="model_io")
    def apply_weight_update(self, update: WeightUpdate) -> ApplyResult:
        """Pull and verify a versioned weight update and acknowledge it; it is swapped in between two
        generation batches (at once when none is being generated), so the trainer never waits for a batch
        to end."""
        with self._receiving([update]) as fetch:
            return self.core.subscriber.receive(update, fetch)

    @ray.method(concurrency_group="relay")
    def relay_piece(self, piece: list[Any], timeout: float) -> Any:
        """This node's copy of a piece of a weight update, for makers this one relays to (`weights.relay`)."""
        return relayed_piece(piece, timeout)

    @contextlib.contextmanager
    def _receiving(self, updates: Sequence[WeightUpdate | None], record: list[TransferProgress] | None = None
                   ) -> Iterator[Callable[[Any], Any]]:
        """A fetch for `updates` that fails on stalls (`maker.weight_stall_timeout_s`) and shows its progress
        in `transfer_progress` until the block ends (and in `record`, if given)."""
        started: list[TransferProgress] = []

        def track(progress: TransferProgress) -> None:
            started.append(progress)
            if record is not None:
                record.append(progress)
            self._transfers.append(progress)

        try:
            yield tracked_fetch(updates, self.core.config.weight_stall_timeout_s, track)
        finally:
            for progress in started:
                self._transfers.remove(progress)

    @ray.method(concurrency_group="progress")
    def transfer_progress(self) -> dict[str, Any]:
        """The weight transfer under way, for a trainer whose push waits long: this node's IP, the update's
        version (None: none), bytes done and total, seconds since it started and since the last bytes."""
        transfers = list(self._transfers)
        if not transfers:
            return {"host": node_ip(), "version": None}
        snapshot = transfers[-1].snapshot()
        return {"host": node_ip(), "version": snapshot.pop("key"), **snapshot}

    @ray.method(concurrency_group="experience_io")
    def save_state(self, path: str) -> str:
        """Save the prompt cursor and counters atomically (weights are the trainer's to restore)."""
        return str(save_atomic(self.core.state_dict(), path))

    @ray.method(concurrency_group="experience_io")
    def load_state(self, path: str) -> None:
        """Resume the prompt cursor and counters saved by `save_state` (before `run`)."""
        if self._running:
            raise RuntimeError(f"maker {self.name!r} is running: load its state before run()")
        self.core.load_state_dict(load_state(path))

    @ray.method(concurrency_group="experience_io")
    def status(self) -> dict[str, Any]:
        """Version, counters, push statistics and the last error; answers while generation runs."""
        status = self.core.status()
        status["state"] = "running" if self._running else ("stopped" if self._stop.is_set() else "idle")
        status["trainers"] = self.trainer_names
        context = ray.get_runtime_context()
        status.update(pid=os.getpid(), node_id=context.get_node_id(), restarted=self.restarts,
                      first_batch_version=self.loop.first_batch_version, resyncs=self.loop.resyncs,
                      registration_pull=self._registration_pull, joined=self._joined(),
                      fresh_weight_waits={**self.loop.fresh_waits,
                                          "update_interval_s": self.loop.update_interval},
                      trainer_run=self.core.receiver.trainer_run, resources=context.get_assigned_resources(),
                      device=str(self.device))
        status["push"] = self.loop.pusher.stats() if self.loop.pusher else None
        return status

    def _joined(self) -> dict[str, Any] | None:
        """The version this process first registered at, and how long after that it began its first batch."""
        if self._first_registration is None:
            return None
        registered, version = self._first_registration
        started = self.loop.first_batch_started
        return {"registered_version": version,
                "first_batch_after_s": None if started is None else started - registered}

    @ray.method(concurrency_group="experience_io")
    def served_weights(self) -> dict[str, Any]:
        """The version served now and the fingerprint of the weights themselves (every tensor checksummed),
        read together between two batches (audits and tests: never a half-applied update)."""
        receiver = self.core.receiver
        with receiver.lock:
            return {"version": receiver.version, "fingerprint": receiver.refresh_fingerprint(),
                    "synced": self.core.synced, "pid": os.getpid()}

    @ray.method(concurrency_group="experience_io")
    def stop(self) -> None:
        """Finish the current batch, flush pushes and return from `run`."""
        self._stop.set()


#: The Ray actor class of `MakerShell`.
ExperienceMakerHolder = ray.remote(concurrency_groups=MAKER_GROUPS)(MakerShell)
