"""open-instruct's `PolicyTrainerRayProcess`: one learner rank over this project's GRPO trainer shell."""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from detached_rl.actors.placement import actor_device
from detached_rl.actors.trainer import TRAINER_GROUPS, GRPOTrainerShell
from detached_rl.compat.open_instruct.config import (
    ModelConfig,
    _args,
    _field,
    grpo_config_from,
    load_policy,
    strategy_from,
    trainer_config_from,
)
from detached_rl.compat.open_instruct.keys import (
    NUM_PARAMS,
    PEAK_FLOPS,
    PROMPT_LENGTHS,
    RESPONSE_LENGTHS,
    SEQUENCE_TOKENS,
    TOKEN_COUNT,
)
from detached_rl.compat.open_instruct.learner import (
    ObservedGRPOLearner,
    matmul_dtype,
    open_instruct_step_metrics,
)
from detached_rl.compat.open_instruct.namespaces import (
    LearnerActorClass,
    misplaced_maker,
    no_batch_advice,
)
from detached_rl.core.checkpoint import has_checkpoint, load_state, save_atomic
from detached_rl.models.export import save_merged
from detached_rl.strategies import NaiveStrategy, Strategy
from detached_rl.strategies.hardware import device_peak
from detached_rl.trainer.config import TrainerConfig
from detached_rl.weights.ray_wire import ray_send_update

logger = logging.getLogger(__name__)

#: Written last by `save_model`; a directory holding it is complete and is not saved again (open-instruct's).
CHECKPOINT_COMPLETE_MARKER = ".checkpoint_complete"


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _current_actor_name() -> str | None:
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    return context.get_actor_name() if context.get_actor_id() is not None else None


class StepsDone(int):
    """`from_pretrained`'s result: the steps done, an int as open-instruct's, with `checkpoint_state`."""

    checkpoint_state: dict[str, Any] | None

    def __new__(cls, steps: int, checkpoint_state: dict[str, Any] | None = None) -> StepsDone:
        value = super().__new__(cls, steps)
        value.checkpoint_state = checkpoint_state
        return value

    def __getitem__(self, key: str) -> Any:
        """The former dict view: "optimization_steps_done" (this int) and "checkpoint_state"."""
        if key == "optimization_steps_done":
            return int(self)
        if key == "checkpoint_state":
            return self.checkpoint_state
        raise KeyError(key)

    def __reduce__(self) -> tuple[Any, ...]:
        return StepsDone, (int(self), self.checkpoint_state)

    def __repr__(self) -> str:
        return f"StepsDone({int(self)}, checkpoint_state={self.checkpoint_state!r})"


def _maker_name(engine: Any, timeout: float) -> str:
    """A maker's name: `engine` itself when a string, else what its `status()` says."""
    return engine if isinstance(engine, str) else ray.get(engine.status.remote(), timeout=timeout)["name"]


class PolicyTrainerProcess(GRPOTrainerShell):
    """open-instruct's `PolicyTrainerRayProcess` over this project's GRPO trainer (the Ray class: below).

    Built by `from_pretrained`, not by the constructor (as open-instruct's), whose arguments come in
    open-instruct's order. `data_prep_actor_name` is kept and not looked up: the makers push to this rank's
    replay buffer. `name` is the name makers push to (default: the actor's Ray name); `namespace` where they
    meet (default: the driver's named namespace, else `detached_rl`); `strategy` overrides the one
    `deepspeed_stage` picks; `master`, rank 0's handle, stands in for `master_addr`/`master_port` (asked in
    `from_pretrained`, so that all ranks start at once).
    """

    def __init__(self, world_size: int, rank: int, local_rank: int = 0, master_addr: str | None = None,
                 master_port: int | None = None, args: Any = None, streaming_config: Any = None,
                 vllm_config: Any = None, data_prep_actor_name: str | None = None, tokenizer: Any = None, *,
                 name: str | None = None, namespace: str | None = None, strategy: str | None = None,
                 master: Any = None) -> None:
        if data_prep_actor_name is not None and not isinstance(data_prep_actor_name, str):
            raise TypeError(f"data_prep_actor_name must be a str or None, got "
                            f"{type(data_prep_actor_name).__name__} (open-instruct's order: ..., "
                            "vllm_config, data_prep_actor_name, tokenizer)")
        # "ddp" defers building to from_pretrained (a "naive" shell builds in its constructor); a namespace
        # left out resolves as every actor's does (`resolve_namespace`), never to an anonymous driver's.
        super().__init__(name or _current_actor_name() or f"policy_trainer_{rank}", _not_loaded,
                         TrainerConfig(), None, namespace, rank, world_size, "ddp")
        self.data_prep_actor_name = data_prep_actor_name
        self.strategy_name = strategy or strategy_from(args, world_size)
        self.local_rank = local_rank
        self.args, self.streaming_config, self.vllm_config, self.tokenizer = (args, streaming_config,
                                                                              vllm_config, tokenizer)
        self._master: tuple[str, int] | None = None
        self._master_actor = master
        self._misplaced: dict[str, str] = {}  # maker -> why its registration was refused
        if master_addr is not None and master_port is not None:
            self._master = (master_addr, int(master_port))
        elif rank == 0 and world_size > 1:
            self._master = self.master_address()

    def get_master_addr_port(self) -> tuple[str, int]:
        """The process group's address and port: rank 0 picks them; the other ranks take them from their
        constructor or ask rank 0 (`master`)."""
        if self._master is None and self._master_actor is not None:
            self._master = tuple(ray.get(self._master_actor.get_master_addr_port.remote()))
        if self._master is None:
            raise ValueError(f"learner rank {self.rank}: no master_addr/master_port (only rank 0 picks them)")
        return self._master

    def make_learner(self, strategy: Strategy) -> ObservedGRPOLearner:
        return ObservedGRPOLearner(self.model_factory(), strategy, self.algorithm, sampling=self.sampling)

    @ray.method(concurrency_group="compute")
    def from_pretrained(self, args: Any, model_config: Any, beaker_config: Any = None,
                        wandb_url: str | None = None, tokenizer: Any = None) -> StepsDone:
        """Load the policy, build optimizer and reference, join ranks, resume from `checkpoint_state_dir`.

        Returns the optimization steps of the restored checkpoint (0 without one) as an int, as
        open-instruct's; its `checkpoint_state` is the `client_state` saved with it (None without one).
        """
        self.args = args
        self.tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        _seed_everything(int(_args(args, "seed")) + self.rank)
        self.config = trainer_config_from(args, self.streaming_config, self.world_size)
        self.algorithm = grpo_config_from(args, self.streaming_config, self.world_size)
        self.sampling = self.algorithm.sampling
        self.model_factory = functools.partial(
            load_policy, str(_field(model_config, "model_name_or_path", ModelConfig)),
            str(_args(args, "model_dtype")), int(_args(args, "seed")), self.tokenizer,
            _field(model_config, "model_revision", ModelConfig))
        if self.strategy_name == "naive":
            if self.world_size != 1:
                raise ValueError(f"learner {self.name!r}: strategy 'naive' trains one rank, not "
                                 f"{self.world_size}")
            self.build(NaiveStrategy(device=actor_device()))
        else:
            address, port = self.get_master_addr_port()
            self.join_process_group(address, port,
                                    {"timeout_s": 60.0 * float(_args(args, "backend_timeout"))})
        return self._resume(_args(args, "checkpoint_state_dir"))

    def _resume(self, directory: str | None) -> StepsDone:
        core = self.trainer_core()
        found = directory is not None and has_checkpoint(Path(directory) / f"rank_{self.rank}")
        every = core.strategy.all_gather_object(found)
        if not any(every):
            if directory is not None:
                logger.info("learner %s: no checkpoint state in %s, starting at step 0", self.name, directory)
            return StepsDone(0)
        if not all(every):
            raise ValueError(f"{directory}: only ranks {[r for r, f in enumerate(every) if f]} have "
                             f"checkpoint state; every one of the {len(every)} ranks needs its rank_<r> "
                             "folder")
        core.load_checkpoint(directory, self.put_chunk)
        return StepsDone(core.policy_version, self._client_state(Path(directory), core.policy_version))

    def _client_state(self, directory: Path, version: int) -> dict[str, Any] | None:
        path = directory / f"client_state_rank_{self.rank}"
        if not has_checkpoint(path):
            return None
        saved = load_state(path)
        if saved["policy_version"] != version:
            logger.warning("learner %s: client state in %s is of step %s, the checkpoint of step %s; "
                           "not returned", self.name, path, saved["policy_version"], version)
            return None
        return saved["client_state"]

    @ray.method(concurrency_group="model_io")
    def setup_model_update_group(self, vllm_engines: Sequence[Any]) -> None:
        """Have `broadcast_to_vllm` send weights to these named makers, in this learner's namespace."""
        core = self.trainer_core()
        names = [_maker_name(engine, self.config.weight_push_timeout_s) for engine in vllm_engines]
        for maker in names:
            if (advice := misplaced_maker(maker, self.name, self.namespace)) is not None:
                raise ValueError(advice)
        core.weights.add_makers(names)

    @ray.method(concurrency_group="model_io")
    def register_maker(self, maker_name: str, *args: Any, **kwargs: Any) -> Any:
        """The shell's `register_maker`, refusing a maker that weights could not reach (another namespace)."""
        if (advice := misplaced_maker(maker_name, self.name, self.namespace)) is not None:
            self._misplaced[maker_name] = advice
            raise ValueError(advice)
        self._misplaced.pop(maker_name, None)
        return super().register_maker(maker_name, *args, **kwargs)

    @ray.method(concurrency_group="compute")
    def step(self) -> tuple[dict[str, float], dict[str, list[int]]]:
        """One training step on what the makers pushed; returns (scalar metrics, array metrics) of this rank.

        The scalars are already token-weighted over all ranks (the strategy reduces them in the step);
        `_token_count` and the other "_" keys are this rank's, for the driver.
        """
        core = self.trainer_core()
        try:
            metrics = core.step()
        except TimeoutError as error:  # no batch: say where makers must be to push here
            advice = no_batch_advice(self.name, self.namespace, list(self._misplaced.values()))
            raise TimeoutError(f"{error} {advice}") from error
        learner: ObservedGRPOLearner = core.learner  # type: ignore[assignment]
        out = open_instruct_step_metrics(metrics, self.algorithm.kl_coef, self.algorithm.kl_kind)
        prompts, responses = learner.last_prompt_lengths, learner.last_response_lengths
        out.update({TOKEN_COUNT: float(sum(responses)), SEQUENCE_TOKENS: float(learner.last_sequence_tokens),
                    NUM_PARAMS: float(learner.num_parameters),
                    PEAK_FLOPS: device_peak(core.strategy.device, matmul_dtype(learner)).value})
        return out, {PROMPT_LENGTHS: list(prompts), RESPONSE_LENGTHS: list(responses)}

    @ray.method(concurrency_group="compute")
    def broadcast_to_vllm(self, model_step: int | None = None) -> dict[str, float]:
        """Push the current weights to this rank's share of the makers (every rank); returns sync metrics.

        `model_step` is accepted for open-instruct's signature: the update carries the policy version.
        """
        send = ray_send_update(self.namespace, self.config.weight_push_timeout_s)
        return self.trainer_core().weights.publish(self.put_chunk, send)

    @ray.method(concurrency_group="compute")
    def update_ref_policy(self) -> None:
        """Polyak update of the reference: ref <- alpha * policy + (1 - alpha) * ref (none: nothing)."""
        self.trainer_core().update_reference(float(_args(self.args, "alpha")))

    @ray.method(concurrency_group="compute")
    def save_checkpoint_state(self, checkpoint_state_dir: str,
                              client_state: Mapping[str, Any] | int | None = None,
                              training_step: int | None = None) -> None:
        """Save every state to resume from, and `client_state`: a dict, or the training step (every rank)."""
        # open-instruct's code passes a `client_state` dict, its reference page the `training_step`: an int
        # here is saved as {"training_step": n}.
        if isinstance(client_state, int) and not isinstance(client_state, bool):
            client_state, training_step = None, client_state
        if client_state is not None and not isinstance(client_state, Mapping):
            raise TypeError(f"client_state must be a dict or the training step (an int), got "
                            f"{type(client_state).__name__}")
        saved = dict(client_state or {})
        if training_step is not None:
            saved.setdefault("training_step", int(training_step))
        core = self.trainer_core()
        core.save_checkpoint(checkpoint_state_dir)
        state = {"policy_version": core.policy_version, "client_state": {**saved, "rank": self.rank}}
        save_atomic(state, Path(checkpoint_state_dir) / f"client_state_rank_{self.rank}")

    @ray.method(concurrency_group="compute")
    def save_model(self, output_dir: str, chat_template_name: str | None = None,
                   tokenizer: Any = None) -> None:
        """Write the policy (LoRA merged) and tokenizer as a Hugging Face directory (call on every rank; rank
        0 writes); a directory already marked complete is left as it is."""
        path = Path(output_dir)
        if (path / CHECKPOINT_COMPLETE_MARKER).exists():
            logger.info("model already saved completely at %s, skipping", path)
            return
        core = self.trainer_core()
        if not core.with_learner(functools.partial(_write_model, path=path, tokenizer=tokenizer)):
            return
        (path / CHECKPOINT_COMPLETE_MARKER).touch()


def _write_model(learner: Any, path: Path, tokenizer: Any) -> bool:
    """Write the policy (LoRA merged) and tokenizer to `path` on rank 0; whether this rank wrote it."""
    strategy = learner.strategy
    policy = strategy.unwrap(learner.actor)
    gathered = dict(strategy.named_tensors(learner.actor, "model.")) if strategy.shards_weights else None
    if not strategy.is_rank_zero:
        return False
    tokenizer = tokenizer if tokenizer is not None else policy.tokenizer
    if gathered is None:
        save_merged(policy.model, tokenizer, path)
    else:
        policy.model.save_pretrained(path, state_dict=gathered, safe_serialization=True)
        tokenizer.save_pretrained(path)
    return True


def _not_loaded() -> Any:
    raise RuntimeError("the learner's model is loaded by from_pretrained")


#: The learner rank as a Ray actor class (`.options(...)` as usual; `ModelGroup` creates the ranks);
#: `.remote()` refuses at once a request the cluster can never place, and creates a named rank in the
#: namespace it looks in (`LearnerActorClass`).
PolicyTrainerRayProcess = LearnerActorClass(
    ray.remote(concurrency_groups=TRAINER_GROUPS)(PolicyTrainerProcess), "learner")
