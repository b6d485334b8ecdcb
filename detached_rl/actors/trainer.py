"""The trainer actors `DetachedPPOTrainer` and `DetachedGRPOTrainer`: thin shells over `TrainerCore`.

Concurrency groups: `buffer_length` (buffer_length, buffer_stats, status, metrics, stop),
`buffer_append` (push_experience, admit_generation), `buffer_sample` (buffer_sample, buffer_peek,
buffer_export),
`model_io` (register_maker, policy_version, weights_fingerprint, update_fingerprints,
export_policy, master_address, start_fit, shutdown), `compute` (fit, join_process_group). Each
group runs in its own thread, so a long `fit` never delays a push or a status query.

`TRAINER_CLASSES` maps an algorithm name to its trainer actor class; every place that creates
trainers picks the class there.

The learners and `TrainerCore` (torch, transformers, peft) are imported where the trainer is built, not
when this module is: a driver that looks a trainer up by name (`detached-rl status`) imports this module
to make its handle, and answers in about a second instead of seven.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from detached_rl.actors.placement import actor_device
from detached_rl.actors.transport import IncomingPushes, actor_host, attach, resolve_namespace
from detached_rl.algorithms.grpo_config import GRPOConfig
from detached_rl.algorithms.ppo_config import PPOConfig
from detached_rl.strategies import NaiveStrategy, Strategy, check_strategy_name
from detached_rl.trainer.config import TrainerConfig
from detached_rl.weights.ray_wire import chunk_store, ray_push_queue
from detached_rl.weights.update import WeightUpdate, state_fingerprint

if TYPE_CHECKING:
    from detached_rl.algorithms.grpo import GRPOLearner
    from detached_rl.algorithms.ppo import PPOLearner
    from detached_rl.core.replay_buffer import AppendResult
    from detached_rl.core.sampling import SamplingConfig
    from detached_rl.trainer.core import TrainerCore

logger = logging.getLogger(__name__)


# experience_in: pushes pulled in pieces (a far maker's slow one never holds up buffer_append's).
TRAINER_GROUPS = {"buffer_length": 1, "buffer_append": 1, "buffer_sample": 1, "model_io": 1, "compute": 1,
                  "experience_in": 4}


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
        sampling: SamplingConfig | None = None,
    ) -> None:
        # Refused here, at construction: a strategy this shell cannot build would only show as a process group
        # that is never joined, `batch_timeout_s` later.
        strategy = check_strategy_name(strategy, f"trainer {name!r}: strategy")
        self.name = name
        self.sampling = sampling  # how makers sample: the learner recomputes log-probs under it
        self.namespace = resolve_namespace(namespace)
        self.config = config or TrainerConfig()
        self.put_chunk = chunk_store(self.config.weight_piece_bytes, self.config.wire_compression)
        self.algorithm = algorithm
        self.rank, self.world_size, self.strategy_name = rank, world_size, strategy
        self.model_factory = model_factory
        self.core: TrainerCore | None = None
        self._fit_thread: threading.Thread | None = None
        self._stops_unacknowledged: list[Any] = []  # stops sent to silent makers at the end of a fit
        self._ready = threading.Event()
        self.incoming = IncomingPushes()
        if strategy == "naive":
            if world_size != 1:
                raise ValueError(f"trainer {name!r}: strategy 'naive' trains in one process, not "
                                 f"{world_size}")
            self.build(NaiveStrategy(device=actor_device()))

    def make_learner(self, strategy: Strategy) -> Any:
        """The learner to train (subclasses override: this is the hook that picks it)."""
        raise NotImplementedError

    def build(self, strategy: Strategy) -> TrainerCore:
        """Build the trainer core over `make_learner(strategy)` and its version-0 update (ready from now
        on)."""
        from detached_rl.trainer.core import TrainerCore

        self.core = TrainerCore(self.name, self.make_learner(strategy), self.config)
        self.core.weights.snapshot(self.put_chunk)  # version 0, offered to makers that register
        self._ready.set()
        return self.core

    def trainer_core(self, timeout: float | None = None) -> TrainerCore:
        """The trainer core, once built (waits up to `timeout`, default `batch_timeout_s`)."""
        if not self._ready.wait(timeout=self.config.batch_timeout_s if timeout is None else timeout):
            raise RuntimeError(f"trainer {self.name!r} is not set up (its process group was never joined)")
        assert self.core is not None
        return self.core

    @ray.method(concurrency_group="model_io")
    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for rank 0 to host the process group."""
        from detached_rl.strategies.ddp import find_free_port

        return ray.util.get_node_ip_address(), find_free_port()

    @ray.method(concurrency_group="compute")
    def join_process_group(self, master_addr: str, master_port: int,
                           options: dict[str, Any] | None = None) -> None:
        """Form the data-parallel process group with the other ranks (all ranks call this together)."""
        from detached_rl.strategies import make_strategy

        options = {key: value for key, value in (options or {}).items() if value is not None}
        if actor_device() == "cpu" and options.get("backend", "gloo") == "gloo":
            # A rank Ray gave no GPU trains on the CPU even where GPUs are visible (Ray does not hide them).
            options = {"backend": "gloo", "device": "cpu", **options}
        strategy = make_strategy(self.strategy_name, rank=self.rank, world_size=self.world_size,
                                 master_addr=master_addr, master_port=master_port, **options)
        strategy.setup()
        self.build(strategy)

    @ray.method(concurrency_group="buffer_append")
    def push_experience(self, experiences: list) -> AppendResult:
        """Append a maker's push (acknowledged; `full=True` asks the maker to back off and retry)."""
        return self.trainer_core().push_experience(experiences)

    @ray.method(concurrency_group="buffer_append")
    def admit_generation(self, maker: str, samples: int, batches: int = 1,
                         pulled: tuple[int, float] | None = None) -> list[int] | None:
        """The oldest weights `maker` may make each of its first batches with and have them trained; `pulled`:
        (bytes, seconds) it took to pull its registration answer."""
        return self.trainer_core().admit_generation(maker, samples, batches, pulled)

    @ray.method(concurrency_group="experience_in")
    def push_experience_pieces(self, payload: Any, maker: str, stall_s: float) -> AppendResult:
        """A push too big to travel inside the call: pulled in pieces (failing only when none arrives for
        `stall_s`), then appended as `push_experience` appends."""
        return self.trainer_core().push_experience(self.incoming.pull(payload, maker, stall_s))

    @ray.method(concurrency_group="buffer_length")
    def push_progress(self, maker: str) -> dict[str, Any]:
        """How the pushes from `maker` arrive: this node's IP, bytes done/total of each under way."""
        return self.incoming.progress(maker)

    @ray.method(concurrency_group="buffer_length")
    def buffer_length(self) -> int:
        """Samples in the replay buffer."""
        return len(self.trainer_core().buffer)

    @ray.method(concurrency_group="buffer_length")
    def buffer_stats(self) -> dict[str, Any]:
        """Size, bytes, accounting, staleness histogram, per-maker counts, reward statistics."""
        return self.trainer_core().buffer.stats()

    @ray.method(concurrency_group="buffer_length")
    def status(self) -> dict[str, Any]:
        """State, version, steps, buffer fill, samples/s, last error, process id and run id."""
        core = self.trainer_core()
        context = ray.get_runtime_context()
        return {**core.status(), "pid": os.getpid(), "trainer_run": core.run_id,
                "node_id": context.get_node_id(),
                "resources": context.get_assigned_resources(), "device": str(core.strategy.device)}

    @ray.method(concurrency_group="buffer_length")
    def metrics(self, last: int | None = None) -> list[dict[str, float]]:
        """Per-step metrics of `fit` (the last `last` steps)."""
        history = list(self.trainer_core().history)
        return history[-last:] if last else history

    @ray.method(concurrency_group="model_io")
    def export_policy(self) -> dict[str, bytes]:
        """The policy as files: the LoRA adapter (peft format) under adapter/ and a
        merged model under merged/."""
        from detached_rl.models.export import policy_files

        core = self.trainer_core()
        with core.weights_lock:
            actor = core.strategy.unwrap(core.learner.actor)
            return policy_files(actor.model, actor.tokenizer)

    @ray.method(concurrency_group="buffer_sample")
    def buffer_peek(self, count: int = 5, maker: str | None = None, min_reward: float | None = None,
                    max_reward: float | None = None) -> list[dict[str, Any]]:
        """The newest samples, decoded to text, without removing them."""
        core = self.trainer_core()
        tokenizer = core.strategy.unwrap(core.learner.actor).tokenizer
        return core.buffer.peek(count, maker=maker, min_reward=min_reward, max_reward=max_reward,
                                decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))

    @ray.method(concurrency_group="buffer_sample")
    def buffer_sample(self, count: int, timeout: float = 0.0) -> list:
        """Take `count` samples out of the buffer (for external consumers); [] if not enough in time."""
        core = self.trainer_core()
        return core.buffer.sample(count, current_version=core.policy_version, timeout=timeout)

    @ray.method(concurrency_group="model_io")
    def trainer_run(self) -> str:
        """The id of this trainer process's run (a maker follows one run's weights; see `register_maker`)."""
        return self.trainer_core().run_id

    @ray.method(concurrency_group="model_io")
    def register_maker(self, maker_name: str, base_fingerprint: str | None = None,
                       serving_dtype: str | None = None, host: str | None = None) -> WeightUpdate | None:
        """Record a maker (`host`: its node's IP, for relays); returns the weight update it should start from
        (full unless its base matches), in the dtype it serves."""
        weights = self.trainer_core().weights
        return weights.register(maker_name, base_fingerprint, self.put_chunk, serving_dtype, host)

    @ray.method(concurrency_group="model_io")
    def policy_version(self) -> int:
        """Version of the current weights (completed training steps)."""
        return self.trainer_core().policy_version

    @ray.method(concurrency_group="model_io")
    def weights_fingerprint(self) -> str:
        """Fingerprint of the weights makers mirror (for tests and audits; checksums every tensor)."""
        core = self.trainer_core()
        with core.weights_lock:
            return state_fingerprint(core.weights.synced_state())

    @ray.method(concurrency_group="model_io")
    def update_fingerprints(self) -> dict[int, str]:
        """Version -> weights fingerprint of every update sent (with `record_weights_fingerprint`)."""
        return dict(self.trainer_core().weights.fingerprints)

    @ray.method(concurrency_group="compute")
    def fit(self, total_steps: int, update_steps: int = 1, train_epochs: int | None = None,
            checkpoint_every: int = 0, checkpoint_dir: str | None = None, resume_from: str | None = None,
            push_when: Callable[[int], bool] | None = None) -> dict[str, Any]:
        """Train up to step `total_steps`; push weights every `update_steps` steps
        and at the end (or after the steps `push_when` returns True for); checkpoint."""
        core = self.trainer_core()

        # Asks a maker how its transfer goes once a push is older than the stall interval (slow or dead?).
        send = ray_push_queue(self.namespace, self.config.weight_push_timeout_s,
                              self.config.weight_stall_timeout_s,
                              locate=functools.partial(actor_host, namespace=self.namespace),
                              relay_fanout=self.config.weight_relay_fanout,
                              relay_min_bytes=self.config.weight_relay_min_bytes)

        def stop_makers(makers: list[str]) -> None:
            pending = {}
            for name in makers:
                try:
                    pending[name] = attach(name, self.namespace, timeout=5.0).stop.remote()
                except Exception as error:  # noqa: BLE001 - a vanished maker needs no stopping
                    logger.warning("could not stop maker %s: %s", name, error)
            # wait for the acknowledgement (a dropped reference is not a delivery), but not from a maker that
            # stopped answering (its host vanished): its stop is kept, and delivered if it comes back
            silent = send.stats()["silent"]
            self._stops_unacknowledged = [ref for name, ref in pending.items() if name in silent]
            for name, ref in pending.items():
                try:
                    if name not in silent:
                        ray.get(ref, timeout=30.0)
                except Exception as error:  # noqa: BLE001
                    logger.warning("maker %s did not acknowledge stop: %s", name, error)

        send.relays.learn(core.weights.makers_of_this_rank())  # where they are, before the first push
        try:
            return core.fit(total_steps, self.put_chunk, send, update_steps, train_epochs, stop_makers,
                            checkpoint_every, checkpoint_dir, resume_from, push_when)
        finally:
            send.close()

    @ray.method(concurrency_group="model_io")
    def start_fit(self, total_steps: int, update_steps: int = 1, train_epochs: int | None = None,
                  **checkpointing: Any) -> bool:
        """Run `fit` in a background thread of the actor (it outlives the caller);
        False if one runs already."""
        core = self.trainer_core()
        if core.state == "training" or self._fit_thread is not None and self._fit_thread.is_alive():
            return False
        core.state = "training"
        self._fit_thread = threading.Thread(
            target=self._fit_logged, args=(total_steps, update_steps, train_epochs), kwargs=checkpointing,
            daemon=True, name="trainer-fit",
        )
        self._fit_thread.start()
        return True

    def _fit_logged(self, total_steps: int, update_steps: int, train_epochs: int | None,
                    **checkpointing: Any) -> None:
        try:
            self.fit(total_steps, update_steps, train_epochs, **checkpointing)
        except Exception:  # noqa: BLE001 - recorded in last_error by fit, shown by status
            logger.exception("trainer %s stopped with an error", self.name)

    @ray.method(concurrency_group="buffer_length")
    def stop(self) -> None:
        """Ask a running `fit` to end after its current step."""
        self.trainer_core().stop()

    @ray.method(concurrency_group="buffer_sample")
    def buffer_export(self, start: int = 0, count: int = 256) -> list[dict[str, Any]]:
        """Samples `start`..`start+count` (arrival order) as plain dicts with decoded
        text, without removing them."""
        core = self.trainer_core()
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


class PPOTrainerShell(_TrainerShell):
    """PPO: actor and critic from the factory (`(Actor, Critic)`); makers mirror both."""

    def make_learner(self, strategy: Strategy) -> PPOLearner:
        from detached_rl.algorithms.ppo import PPOLearner

        actor, critic = self.model_factory()
        return PPOLearner(actor, critic, strategy, self.algorithm or PPOConfig(), sampling=self.sampling)


class GRPOTrainerShell(_TrainerShell):
    """The GRPO family: the policy from the factory (an `Actor`, or `(Actor, ...)`); critic-free."""

    def make_learner(self, strategy: Strategy) -> GRPOLearner:
        from detached_rl.algorithms.grpo import GRPOLearner

        built = self.model_factory()
        actor = built[0] if isinstance(built, tuple) else built
        return GRPOLearner(actor, strategy, self.algorithm or GRPOConfig(), sampling=self.sampling)


DetachedPPOTrainer = ray.remote(concurrency_groups=TRAINER_GROUPS)(PPOTrainerShell)
DetachedGRPOTrainer = ray.remote(concurrency_groups=TRAINER_GROUPS)(GRPOTrainerShell)
TRAINER_CLASSES = {"ppo": DetachedPPOTrainer, "grpo": DetachedGRPOTrainer}


def trainer_class(algorithm: str | PPOConfig | GRPOConfig | None) -> Any:
    """The trainer actor class of an algorithm, given by name ("ppo", "grpo") or by its config (None: PPO)."""
    if not isinstance(algorithm, str):
        algorithm = "grpo" if isinstance(algorithm, GRPOConfig) else "ppo"
    if algorithm not in TRAINER_CLASSES:
        raise ValueError(f"algorithm must be one of {sorted(TRAINER_CLASSES)}, got {algorithm!r}")
    return TRAINER_CLASSES[algorithm]
