"""Ray shells: named, long-lived actors with concurrency groups and timeouts around the plain classes.

* `ExperienceMakerHolder` wraps `ExperienceMaker` (+ `ExperiencePusher`).
  Groups: `experience_io` (status, stop), `model_io` (apply_weight_update), `compute` (run).
* `DetachedPPOTrainer` wraps `TrainerCore` (+ `PPOLearner`).
  Groups: `buffer_length` (buffer_length, buffer_stats, status), `buffer_append`
  (push_experience), `buffer_sample` (buffer_sample, buffer_peek), `model_io`
  (register_maker, current_weights, master_address), `compute` (setup, fit).
Each group runs in its own thread, so a long `fit` never delays a push or a status query.
Actors find each other only by name and namespace (`attach`), never by handles passed
around by a driver, so makers and trainers may start in any order and in separate jobs.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import ray
import torch

from detached_rl.grpo import GRPOConfig, GRPOLearner
from detached_rl.maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.models.generation import SamplingConfig
from detached_rl.ppo import PPOConfig, PPOLearner
from detached_rl.prompts import PromptSource
from detached_rl.pusher import ExperiencePusher
from detached_rl.replay_buffer import AppendResult
from detached_rl.strategies import NaiveStrategy, Strategy
from detached_rl.trainer import TrainerConfig, TrainerCore, TrainerGroupConfig
from detached_rl.weight_sync import ApplyResult, WeightUpdate, state_fingerprint

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "detached_rl"


def get_all(refs: Sequence[Any], timeout: float) -> list[Any]:
    """`ray.get` of every ref within `timeout`; on errors, raise the first only after all were retrieved.

    A plain `ray.get(list)` raises at the first failed ref and leaves the others unretrieved, so Ray
    later logs their errors as unhandled (a second traceback on the user's terminal).
    """
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    results: list[Any] = []
    first_error: BaseException | None = None
    for ref in refs:
        if ref not in ready:
            continue
        try:
            results.append(ray.get(ref))
        except Exception as error:  # noqa: BLE001 - raised below, after every ref was retrieved
            first_error = first_error or error
    if first_error is not None:
        raise first_error
    if pending:
        raise ray.exceptions.GetTimeoutError(f"{len(pending)} of {len(refs)} calls did not finish within {timeout:.0f} s")
    return results


def attach(name: str, namespace: str | None = None, timeout: float = 60.0, poll_interval: float = 0.2):
    """The handle of the named actor, waiting up to `timeout` s for it to exist."""
    namespace = namespace or DEFAULT_NAMESPACE
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"no actor named {name!r} in Ray namespace {namespace!r} after {timeout:.1f} s "
                    "(is it started, and in this namespace?)"
                ) from None
            time.sleep(poll_interval)


def put_chunk(chunk: dict[str, torch.Tensor]) -> Any:
    """`ray.put` a weight chunk as raw byte arrays, which the object store hands back without a copy.

    Pickled torch tensors are copied on both sides; numpy arrays travel out of band, so a maker
    reads them straight from shared memory and copies each byte once, into its model.
    """
    return ray.put({
        name: (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
        for name, t in chunk.items()
    })


def fetch_chunk(ref: Any, timeout: float) -> dict[str, torch.Tensor]:
    """`ray.get` a chunk stored by `put_chunk` as tensors viewing the object store's memory (read-only)."""
    raw = ray.get(ref, timeout=timeout)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")  # only read: verified, then copied
        return {
            name: torch.from_numpy(array).view(getattr(torch, dtype)).reshape(shape)
            for name, (dtype, shape, array) in raw.items()
        }


def _ray_fetch(timeout: float) -> Callable[[Any], dict[str, torch.Tensor]]:
    return lambda ref: fetch_chunk(ref, timeout)


def dispatch_weight_update(update: WeightUpdate, makers: Sequence[str], namespace: str, timeout: float
                           ) -> Callable[[], dict[str, ApplyResult | BaseException]]:
    """Send the same update (the same chunk refs) to every maker at once; returns a function that waits
    (at most `timeout` seconds from now) and gives each maker's result or error."""
    pending: dict[str, Any] = {}
    results: dict[str, ApplyResult | BaseException] = {}
    for name in makers:
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            results[name] = LookupError(f"no maker named {name!r} in namespace {namespace!r}")
            continue
        pending[name] = handle.apply_weight_update.remote(update)
    deadline = time.monotonic() + timeout

    def collect() -> dict[str, ApplyResult | BaseException]:
        for name, ref in pending.items():
            try:
                results[name] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.01))
            except Exception as error:  # noqa: BLE001
                results[name] = error
        pending.clear()
        return results

    return collect


def deliver_weight_update(
    update: WeightUpdate, makers: Sequence[str], namespace: str, timeout: float
) -> dict[str, ApplyResult | BaseException]:
    """Send the same update to every maker concurrently and wait; per-maker result or error."""
    return dispatch_weight_update(update, makers, namespace, timeout)()


@ray.remote(concurrency_groups={"experience_io": 1, "model_io": 1, "compute": 1})
class ExperienceMakerHolder:
    """A named experience maker: attaches to its trainers by name, generates, pushes, receives weights."""

    def __init__(
        self,
        name: str,
        trainer_names: Sequence[str],
        model_factory: Callable[[], MakerModels],
        prompts: PromptSource | Callable[[], PromptSource],
        config: MakerConfig | None = None,
        namespace: str | None = None,
        strategy_factory: Callable[[], Strategy] | None = None,
        attach_timeout_s: float = 120.0,
        resume_on_restart: bool = True,
        state_path: str | None = None,
    ) -> None:
        if not trainer_names:
            raise ValueError("ExperienceMakerHolder: trainer_names is empty")
        self.name = name
        self.trainer_names = list(trainer_names)
        self.namespace = namespace or DEFAULT_NAMESPACE
        self.attach_timeout_s = attach_timeout_s
        source = prompts() if callable(prompts) and not hasattr(prompts, "next_batch") else prompts
        strategy = strategy_factory() if strategy_factory else NaiveStrategy()
        scoring = None
        if config is not None and config.scorers:
            from detached_rl.scorer_actors import RemoteScoring

            scoring = RemoteScoring(config.scorers, self.namespace, attach_timeout_s, config.scorer_timeout_s,
                                    config.scorer_attempts)
        self.core = ExperienceMaker(name, model_factory(), source, config, strategy, scoring)
        self.pusher: ExperiencePusher | None = None
        self._stop = threading.Event()
        self._running = False
        self._handles: dict[str, Any] = {}  # trainer name -> handle; dropped when that trainer dies
        self.first_batch_version: int | None = None  # policy version of this process's first batch
        # Where the prompt cursor and counters are saved after every pushed batch, and resumed from.
        self.state_path = state_path
        if state_path is not None and os.path.isdir(state_path):
            from detached_rl.checkpoint import load_state

            self.core.load_state_dict(load_state(state_path))
        self._handles_lock = threading.Lock()
        self.restarts = ray.get_runtime_context().was_current_actor_reconstructed if ray.is_initialized() else False
        if self.restarts and resume_on_restart:
            # Ray restarted this actor after its process died: carry on feeding the trainers. `run`
            # re-attaches by name and pulls the trainers' current weights before it generates.
            self.start()

    def _attach_trainers(self) -> dict[str, Any]:
        handles = {t: attach(t, self.namespace, self.attach_timeout_s) for t in self.trainer_names}
        # Register with every trainer; start from the newest weights any of them offers.
        base = self.core.base_fingerprint
        updates = get_all([h.register_maker.remote(self.name, base) for h in handles.values()],
                          timeout=self.core.config.weight_timeout_s)
        self._take_offered(updates)
        with self._handles_lock:
            self._handles = dict(handles)
        return handles

    def _take_offered(self, updates: Sequence[WeightUpdate | None]) -> None:
        """Apply the newest update offered, or one from a trainer run this maker does not follow (a resumed trainer)."""
        offered = [u for u in updates if u is not None]
        if not offered:
            return
        newest = max(offered, key=lambda u: u.manifest.version)
        receiver = self.core.receiver
        new_run = newest.manifest.metadata.get("trainer_run") not in (None, receiver.trainer_run)
        if newest.manifest.version > self.core.policy_version or new_run:
            self.core.apply_weight_update(newest, _ray_fetch(self.core.config.weight_timeout_s))

    def _trainer_handle(self, trainer: str) -> Any:
        """The live handle of `trainer`; after it died, the actor now under its name, registered with afresh."""
        with self._handles_lock:
            handle = self._handles.get(trainer)
        if handle is not None:
            return handle
        try:
            handle = ray.get_actor(trainer, namespace=self.namespace)
        except ValueError:
            # Not a ValueError: the pusher treats those as a refused push and would not retry it.
            raise ConnectionError(f"trainer {trainer!r} is not running (waiting for it to come back)") from None
        update = ray.get(handle.register_maker.remote(self.name, self.core.base_fingerprint),
                         timeout=self.core.config.weight_timeout_s)
        self._take_offered([update])
        with self._handles_lock:
            self._handles[trainer] = handle
        return handle

    def _forget_if_dead(self, trainer: str, handle: Any, future: Future) -> None:
        if isinstance(future.exception(), ray.exceptions.RayActorError):
            with self._handles_lock:
                if self._handles.get(trainer) is handle:
                    del self._handles[trainer]

    def _trainers_finished(self, handles: dict[str, Any]) -> bool:
        """True when every trainer has ended its `fit` and would have stopped this maker (it has nobody to feed)."""
        states = get_all([h.status.remote() for h in handles.values()], timeout=self.core.config.push_timeout_s)
        return all(s["state"] == "done" and s["stops_makers_at_end"] for s in states)

    @ray.method(concurrency_group="compute")
    def sync(self) -> int:
        """Register with the trainers and take the newest weights they offer; returns the policy version served."""
        self._attach_trainers()
        return self.core.policy_version

    @ray.method(concurrency_group="compute")
    def evaluate(self, items: Sequence[Any], sampling: SamplingConfig | None = None) -> list[dict[str, Any]]:
        """Answer and grade held-out prompts with the current weights (greedy unless `sampling` says otherwise)."""
        return self.core.evaluate(items, sampling)

    @ray.method(concurrency_group="compute")
    def run(self, num_batches: int | None = None) -> dict[str, Any]:
        """Generate and push until `num_batches` batches are pushed or `stop()` is called; returns status."""
        self._stop.clear()
        self._running = True
        try:
            handles = self._attach_trainers()
            if self.core.scoring is not None:
                self.core.scoring.attach()  # scorer groups found before the first batch holds the generation lock
            config = self.core.config
            if num_batches is None and self._trainers_finished(handles):
                # Arrived after the trainers finished (they stop their makers at the end): nothing to do.
                self._stop.set()

            def submit(trainer: str, experiences: list) -> Future:
                handle = self._trainer_handle(trainer)
                future = handle.push_experience.remote(experiences).future()
                future.add_done_callback(functools.partial(self._forget_if_dead, trainer, handle))
                return future

            self.pusher = ExperiencePusher(
                submit, self.trainer_names, max_in_flight=config.max_pushes_in_flight, policy=config.push_policy,
                push_timeout=config.push_timeout_s, should_stop=self._stop.is_set,
            )
            made = 0
            stale_seen = 0
            while not self._stop.is_set() and (num_batches is None or made < num_batches):
                if not self.core.synced:  # not yet given weights (or half-updated): wait for an update
                    time.sleep(0.05)
                    continue
                experiences = self.core.make_experience()
                if self.first_batch_version is None:
                    self.first_batch_version = experiences[0].policy_version if experiences else None
                self.pusher.push(experiences)
                if self.state_path is not None:
                    from detached_rl.checkpoint import save_atomic

                    save_atomic(self.core.state_dict(), self.state_path)
                # Backpressure, not a failure: a full trainer takes the push once it trains. A trainer that is
                # gone makes the pusher drop the push after its retries, which ends this wait too.
                while config.wait_for_ack and not self.pusher.flush(timeout=1.0) and not self._stop.is_set():
                    pass
                made += 1
                needed = self.pusher.oldest_useful_version
                if config.wait_for_fresh_weights and needed is not None and self.core.policy_version < needed:
                    self._wait_for_version(needed, config.weight_timeout_s)
                stats = self.pusher.stats()
                if stats["dropped_stale_by_trainer"] > stale_seen:
                    # Samples arrived too old: catch up with the trainers' version before generating more.
                    stale_seen = stats["dropped_stale_by_trainer"]
                    versions = [t["last_version"] for t in stats["per_trainer"].values() if t["last_version"]]
                    if versions:
                        self._wait_for_version(max(versions), config.weight_timeout_s)
            self.pusher.flush(timeout=config.push_timeout_s)
        except Exception as error:
            self.core.last_error = f"{type(error).__name__}: {error}"
            raise
        finally:
            self._running = False
        return self.status()

    def _wait_for_version(self, version: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.core.policy_version < version and time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(0.02)

    @ray.method(concurrency_group="experience_io")
    def start(self, num_batches: int | None = None) -> bool:
        """Run `run` in a background thread of the actor (it outlives the caller); False if already running."""
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
        """Pull, verify and apply a versioned weight update between two generation batches."""
        return self.core.apply_weight_update(update, _ray_fetch(self.core.config.weight_timeout_s))

    @ray.method(concurrency_group="experience_io")
    def save_state(self, path: str) -> str:
        """Save the prompt cursor and counters atomically (weights are the trainer's to restore)."""
        from detached_rl.checkpoint import save_atomic

        return str(save_atomic(self.core.state_dict(), path))

    @ray.method(concurrency_group="experience_io")
    def load_state(self, path: str) -> None:
        """Resume the prompt cursor and counters saved by `save_state` (before `run`)."""
        from detached_rl.checkpoint import load_state

        if self._running:
            raise RuntimeError(f"maker {self.name!r} is running: load its state before run()")
        self.core.load_state_dict(load_state(path))

    @ray.method(concurrency_group="experience_io")
    def status(self) -> dict[str, Any]:
        """Version, counters, push statistics and the last error; answers while generation runs."""
        status = self.core.status()
        status["state"] = "running" if self._running else ("stopped" if self._stop.is_set() else "idle")
        status["trainers"] = self.trainer_names
        status.update(pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id(), restarted=self.restarts,
                      first_batch_version=self.first_batch_version,
                      trainer_run=self.core.receiver.trainer_run)
        status["push"] = self.pusher.stats() if self.pusher else None
        return status

    @ray.method(concurrency_group="experience_io")
    def stop(self) -> None:
        """Finish the current batch, flush pushes and return from `run`."""
        self._stop.set()


TRAINER_GROUPS = {"buffer_length": 1, "buffer_append": 1, "buffer_sample": 1, "model_io": 1, "compute": 1}


class _TrainerShell:
    """The Ray-facing methods every trainer shares; subclasses say which learner to build."""

    def __init__(
        self,
        name: str,
        model_factory: Callable[[], Any],
        config: TrainerConfig | None = None,
        algorithm: Any = None,
        namespace: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        strategy: str = "naive",
    ) -> None:
        self.name = name
        self.namespace = namespace or DEFAULT_NAMESPACE
        self.config = config or TrainerConfig()
        self.algorithm = algorithm
        self.rank, self.world_size, self.strategy_name = rank, world_size, strategy
        self.model_factory = model_factory
        self.core: TrainerCore | None = None
        self._fit_thread: threading.Thread | None = None
        self._ready = threading.Event()
        if strategy == "naive":
            if world_size != 1:
                raise ValueError(f"trainer {name!r}: strategy 'naive' trains in one process, not {world_size}")
            self._build(NaiveStrategy())

    def _make_learner(self, strategy: Strategy) -> Any:
        raise NotImplementedError

    def _build(self, strategy: Strategy) -> None:
        self.core = TrainerCore(self.name, self._make_learner(strategy), self.config)
        self.core.build_update(put_chunk)  # version 0, offered to makers that register
        self._ready.set()

    def _core(self) -> TrainerCore:
        if not self._ready.wait(timeout=self.config.batch_timeout_s):
            raise RuntimeError(f"trainer {self.name!r} is not set up (its process group was never joined)")
        return self.core

    @ray.method(concurrency_group="model_io")
    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for rank 0 to host the process group."""
        from detached_rl.strategies.ddp import find_free_port

        return ray.util.get_node_ip_address(), find_free_port()

    @ray.method(concurrency_group="compute")
    def join_process_group(self, master_addr: str, master_port: int, options: dict[str, Any] | None = None) -> None:
        """Form the data-parallel process group with the other ranks (all ranks call this together)."""
        from detached_rl.strategies import make_strategy

        strategy = make_strategy(self.strategy_name, rank=self.rank, world_size=self.world_size,
                                 master_addr=master_addr, master_port=master_port, **(options or {}))
        strategy.setup()
        self._build(strategy)

    @ray.method(concurrency_group="buffer_append")
    def push_experience(self, experiences: list) -> AppendResult:
        """Append a maker's push (acknowledged; `full=True` asks the maker to back off and retry)."""
        return self._core().push_experience(experiences)

    @ray.method(concurrency_group="buffer_length")
    def buffer_length(self) -> int:
        """Samples in the replay buffer."""
        return len(self._core().buffer)

    @ray.method(concurrency_group="buffer_length")
    def buffer_stats(self) -> dict[str, Any]:
        """Size, bytes, accounting, staleness histogram, per-maker counts, reward statistics."""
        return self._core().buffer.stats()

    @ray.method(concurrency_group="buffer_length")
    def status(self) -> dict[str, Any]:
        """State, version, steps, buffer fill, samples/s, last error, process id and run id."""
        core = self._core()
        return {**core.status(), "pid": os.getpid(), "trainer_run": core.run_id,
                "node_id": ray.get_runtime_context().get_node_id()}

    @ray.method(concurrency_group="buffer_length")
    def metrics(self, last: int | None = None) -> list[dict[str, float]]:
        """Per-step metrics of `fit` (the last `last` steps)."""
        history = list(self._core().history)
        return history[-last:] if last else history

    @ray.method(concurrency_group="model_io")
    def export_policy(self) -> dict[str, bytes]:
        """The policy as files: the LoRA adapter (peft format) under adapter/ and a merged model under merged/."""
        from detached_rl.models.export import policy_files

        core = self._core()
        with core.weights_lock:
            actor = core.strategy.unwrap(core.learner.actor)
            return policy_files(actor.model, actor.tokenizer)

    @ray.method(concurrency_group="buffer_sample")
    def buffer_peek(self, count: int = 5, maker: str | None = None, min_reward: float | None = None,
                    max_reward: float | None = None) -> list[dict[str, Any]]:
        """The newest samples, decoded to text, without removing them."""
        core = self._core()
        tokenizer = core.strategy.unwrap(core.learner.actor).tokenizer
        return core.buffer.peek(count, maker=maker, min_reward=min_reward, max_reward=max_reward,
                                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    @ray.method(concurrency_group="buffer_sample")
    def buffer_sample(self, count: int, timeout: float = 0.0) -> list:
        """Take `count` samples out of the buffer (for external consumers); [] if not enough in time."""
        core = self._core()
        return core.buffer.sample(count, current_version=core.policy_version, timeout=timeout)

    @ray.method(concurrency_group="model_io")
    def register_maker(self, maker_name: str, base_fingerprint: str | None = None) -> WeightUpdate | None:
        """Record a maker; returns the weight update it should start from (full unless its base matches)."""
        return self._core().register_maker(maker_name, base_fingerprint, put_chunk)

    @ray.method(concurrency_group="model_io")
    def policy_version(self) -> int:
        """Version of the current weights (completed training steps)."""
        return self._core().policy_version

    @ray.method(concurrency_group="model_io")
    def weights_fingerprint(self) -> str:
        """Fingerprint of the weights makers mirror (for tests and audits; checksums every tensor)."""
        core = self._core()
        with core.weights_lock:
            return state_fingerprint(core.synced_state())

    @ray.method(concurrency_group="model_io")
    def update_fingerprints(self) -> dict[int, str]:
        """Version -> weights fingerprint of every update sent (with `record_weights_fingerprint`)."""
        return dict(self._core().fingerprints)

    @ray.method(concurrency_group="compute")
    def fit(self, total_steps: int, update_steps: int = 1, train_epochs: int | None = None,
            checkpoint_every: int = 0, checkpoint_dir: str | None = None, resume_from: str | None = None,
            ) -> dict[str, Any]:
        """Train up to step `total_steps`; push weights every `update_steps` steps and at the end; checkpoint."""
        core = self._core()

        def send(update: WeightUpdate, makers: list[str]) -> Any:
            collect = dispatch_weight_update(update, makers, self.namespace, self.config.weight_push_timeout_s)
            return collect if self.config.overlap_weight_push else collect()

        def stop_makers(makers: list[str]) -> None:
            pending = {}
            for name in makers:
                try:
                    pending[name] = attach(name, self.namespace, timeout=5.0).stop.remote()
                except Exception as error:  # noqa: BLE001 - a vanished maker needs no stopping
                    logger.warning("could not stop maker %s: %s", name, error)
            for name, ref in pending.items():  # wait for the acknowledgement: a dropped reference is not a delivery
                try:
                    ray.get(ref, timeout=30.0)
                except Exception as error:  # noqa: BLE001
                    logger.warning("maker %s did not acknowledge stop: %s", name, error)

        return core.fit(total_steps, put_chunk, send, update_steps, train_epochs, stop_makers,
                        checkpoint_every, checkpoint_dir, resume_from)

    @ray.method(concurrency_group="model_io")
    def start_fit(self, total_steps: int, update_steps: int = 1, train_epochs: int | None = None,
                  **checkpointing: Any) -> bool:
        """Run `fit` in a background thread of the actor (it outlives the caller); False if one runs already."""
        core = self._core()
        if core.state == "training" or self._fit_thread is not None and self._fit_thread.is_alive():
            return False
        core.state = "training"
        self._fit_thread = threading.Thread(
            target=self._fit_logged, args=(total_steps, update_steps, train_epochs), kwargs=checkpointing,
            daemon=True, name="trainer-fit",
        )
        self._fit_thread.start()
        return True

    def _fit_logged(self, total_steps: int, update_steps: int, train_epochs: int | None, **checkpointing: Any) -> None:
        try:
            self.fit(total_steps, update_steps, train_epochs, **checkpointing)
        except Exception:  # noqa: BLE001 - recorded in last_error by fit, shown by status
            logger.exception("trainer %s stopped with an error", self.name)

    @ray.method(concurrency_group="buffer_length")
    def stop(self) -> None:
        """Ask a running `fit` to end after its current step."""
        self._core().stop()

    @ray.method(concurrency_group="buffer_sample")
    def buffer_export(self, start: int = 0, count: int = 256) -> list[dict[str, Any]]:
        """Samples `start`..`start+count` (arrival order) as plain dicts with decoded text, without removing them."""
        core = self._core()
        tokenizer = core.strategy.unwrap(core.learner.actor).tokenizer
        rows = []
        for experience in core.buffer.experiences(start, count):
            row = experience.to_dict()
            row["prompt_text"] = tokenizer.decode(row["prompt_ids"], skip_special_tokens=True)
            row["response_text"] = tokenizer.decode(row["response_ids"], skip_special_tokens=True)
            rows.append(row)
        return rows

    @ray.method(concurrency_group="model_io")
    def shutdown(self) -> None:
        """Free the models, then leave the process group (DDP models freed after it can hang)."""
        core, self.core = self.core, None
        self._ready.clear()
        if core is not None:
            strategy = core.strategy
            del core
            gc.collect()
            strategy.destroy()

    @ray.method(concurrency_group="compute")
    def busy(self, seconds: float) -> float:
        """Occupy the compute group for `seconds` (to check that other groups stay responsive)."""
        time.sleep(seconds)
        return seconds


class PPOTrainerShell(_TrainerShell):
    """PPO: actor and critic from the factory (`(Actor, Critic)`); makers mirror both."""

    def _make_learner(self, strategy: Strategy) -> PPOLearner:
        actor, critic = self.model_factory()
        return PPOLearner(actor, critic, strategy, self.algorithm or PPOConfig())


class GRPOTrainerShell(_TrainerShell):
    """The GRPO family: the policy from the factory (an `Actor`, or `(Actor, ...)`); critic-free."""

    def _make_learner(self, strategy: Strategy) -> GRPOLearner:
        built = self.model_factory()
        actor = built[0] if isinstance(built, tuple) else built
        return GRPOLearner(actor, strategy, self.algorithm or GRPOConfig())


DetachedPPOTrainer = ray.remote(concurrency_groups=TRAINER_GROUPS)(PPOTrainerShell)
DetachedGRPOTrainer = ray.remote(concurrency_groups=TRAINER_GROUPS)(GRPOTrainerShell)


def trainer_names(prefix: str, world_size: int) -> list[str]:
    """Names of the ranks of a trainer group: prefix_0 … prefix_{n-1}."""
    return [f"{prefix}_{rank}" for rank in range(world_size)]


def placement_group_name(prefix: str) -> str:
    """Name of the placement group that holds the ranks of trainer group `prefix`."""
    return f"{prefix}-placement"


def start_trainer_group(
    prefix: str,
    world_size: int,
    model_factory: Callable[[], Any],
    config: TrainerConfig | None = None,
    algorithm: PPOConfig | GRPOConfig | None = None,
    namespace: str | None = None,
    strategy: str = "ddp",
    actor_options: dict[str, Any] | None = None,
    timeout: float = 300.0,
    group: TrainerGroupConfig | None = None,
) -> list[Any]:
    """Create `world_size` named trainer ranks (prefix_0 ...) in a placement group and form their process group.

    The ranks are detached actors, one per bundle of a detached placement group named
    `<prefix>-placement` (`group.placement_strategy`, PACK by default). Rank 0 hosts the process
    group at its own node address and a port free there. If any rank fails to start or join
    (e.g. a strategy that needs CUDA on a CPU node), every rank and the placement group are
    removed and the error is raised.
    """
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if group is None:
        group = TrainerGroupConfig(strategy=strategy, world_size=world_size)
    elif (group.world_size, group.strategy) != (world_size, strategy):
        raise ValueError(f"start_trainer_group: world_size/strategy ({world_size}, {strategy!r}) disagree with "
                         f"group ({group.world_size}, {group.strategy!r})")
    namespace = namespace or DEFAULT_NAMESPACE
    bundle = {"CPU": group.num_cpus_per_rank} if group.num_cpus_per_rank else {}
    if group.num_gpus_per_rank:
        bundle["GPU"] = group.num_gpus_per_rank
    bundle.update(group.resources)
    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=group.placement_strategy,
                         name=placement_group_name(prefix), lifetime="detached")
    handles: list[Any] = []
    try:
        if not pg.wait(timeout_seconds=timeout):
            raise TimeoutError(
                f"trainer group {prefix!r}: {world_size} bundles of {bundle} ({group.placement_strategy}) could not be "
                f"placed within {timeout:.0f} s; the cluster has {ray.available_resources()} available"
            )
        trainer_class = DetachedGRPOTrainer if isinstance(algorithm, GRPOConfig) else DetachedPPOTrainer
        for rank, name in enumerate(trainer_names(prefix, world_size)):
            options = {
                "lifetime": "detached", "namespace": namespace, "name": name,
                "num_cpus": group.num_cpus_per_rank, "num_gpus": group.num_gpus_per_rank,
                "resources": dict(group.resources) or None,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                **(actor_options or {}),
            }
            handles.append(trainer_class.options(**options).remote(
                name, model_factory, config, algorithm, namespace, rank, world_size, group.strategy))
        if group.strategy != "naive":
            address, port = ray.get(handles[0].master_address.remote(), timeout=timeout)
            get_all([h.join_process_group.remote(address, port, group.strategy_options()) for h in handles],
                    timeout=timeout)
        else:
            ray.get(handles[0].policy_version.remote(), timeout=timeout)  # built in its constructor: surface errors
    except BaseException:
        remove_group(pg, handles)
        raise
    return handles


def remove_group(pg: Any, handles: Sequence[Any]) -> None:
    """Kill a group's actors and remove its placement group (a group that failed to start)."""
    from ray.util.placement_group import remove_placement_group

    for handle in handles:
        ray.kill(handle)
    remove_placement_group(pg)


def stop_trainer_group(prefix: str, world_size: int, namespace: str | None = None, timeout: float = 60.0) -> None:
    """Free each rank's models, kill the ranks and remove their placement group (missing parts are skipped)."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    namespace = namespace or DEFAULT_NAMESPACE
    handles = []
    for name in trainer_names(prefix, world_size):
        try:
            handles.append(ray.get_actor(name, namespace=namespace))
        except ValueError:
            continue
    try:  # all ranks at once: a DDP model freed after its group is gone can hang
        get_all([h.shutdown.remote() for h in handles], timeout=timeout)
    except Exception as error:  # noqa: BLE001 - killing them below is what matters
        logger.warning("trainer group %s did not shut down cleanly: %s", prefix, error)
    for handle in handles:
        ray.kill(handle)
    with contextlib.suppress(ValueError):
        remove_placement_group(get_placement_group(placement_group_name(prefix)))
