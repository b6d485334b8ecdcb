"""Coming from ColossalChat's `coati/ray`: `DetachedPPOTrainer` and `ExperienceMakerHolder` with coati's keyword
signatures and methods, thin over this project's trainer and maker actors (docs/coming-from-coati.md).

The factories return this project's objects: `strategy_fn() -> Strategy` (`detached_rl.strategies`, or
`get_strategy_from_args(name)` here, which reads the `env_info` coati sets), the trainer's `model_fn() ->
(Actor, Critic)` and the maker's `model_fn() -> (Actor, Critic, reward model or reward function, initial
model)`. Create them the coati way: `DetachedPPOTrainer.options(name=..., num_gpus=..., max_concurrency=...)
.remote(...)`. Training, generation, pushes and weight updates are the real `TrainerCore`, `ExperienceMaker` and
`MakerLoop`; this module only translates arguments, batches and the meaning of `fit`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from detached_rl.actors.maker import ExperienceMakerHolder as _MakerActor
from detached_rl.actors.trainer import TRAINER_GROUPS, PPOTrainerShell
from detached_rl.actors.transport import attach, dispatch_weight_update, put_chunk
from detached_rl.algorithms.metrics import LOSS_POLICY, LOSS_VALUE
from detached_rl.algorithms.ppo import PPOConfig
from detached_rl.core.prompts import PromptItem, as_prompt_item
from detached_rl.core.sampling import SamplingConfig
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig, MakerModels
from detached_rl.models.export import save_merged
from detached_rl.models.lora import lora_backend, merged_model
from detached_rl.models.reward import FunctionReward
from detached_rl.strategies import STRATEGIES, NaiveStrategy, Strategy
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore

logger = logging.getLogger(__name__)

# Where a coati `training_step` reports its two losses in this project's metrics.
COATI_METRICS = {"actor_loss": LOSS_POLICY, "critic_loss": LOSS_VALUE}
# Hugging Face `generate` arguments coati makers passed through, and what they become in a `SamplingConfig`.
SAMPLING_KWARGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p")
# Accepted and without effect here: the generation backend sets these itself.
IGNORED_GENERATE_KWARGS = ("use_cache", "prepare_inputs_fn", "update_model_kwargs_fn", "pad_token_id",
                           "early_stopping", "num_beams")
STATE_DICT_SUFFIXES = (".pt", ".pth", ".bin")
COATI_ENV = {"rank": "RANK", "local_rank": "LOCAL_RANK", "world_size": "WORLD_SIZE", "master_port": "MASTER_PORT",
             "master_addr": "MASTER_ADDR"}


# ---------------------------------------------------------------- argument translation (no Ray)
def set_dist_env(env_info: Mapping[str, str]) -> None:
    """Export coati's `env_info` (rank, local_rank, world_size, master_port, master_addr) as torch's variables."""
    missing = [key for key in COATI_ENV if key not in env_info]
    if missing:
        raise ValueError(f"env_info lacks field(s) {missing}")
    for key, variable in COATI_ENV.items():
        os.environ[variable] = str(env_info[key])


def get_strategy_from_args(strategy: str, **options: Any) -> Strategy:
    """coati's `get_strategy_from_args`: a strategy by name; distributed ones take rank and address from the
    environment `env_info` set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Naive and gloo ranks stay on the
    device Ray gave the actor."""
    from detached_rl.actors.placement import actor_device

    name = {"colossalai_gemini_cpu": "colossalai_gemini", "colossalai_zero2_cpu": "colossalai_zero2"}.get(
        strategy, strategy)
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    if name == "naive":
        return NaiveStrategy(device=options.pop("device", actor_device()), **options)
    try:
        place = dict(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                     master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]))
    except KeyError as missing:
        raise ValueError(f"strategy {strategy!r} needs env_info (environment variable {missing} is unset)") from None
    if actor_device() == "cpu" and options.get("backend", "gloo") == "gloo":
        options = {"backend": "gloo", "device": "cpu", **options}
    return STRATEGIES[name](**place, **options)


def get_receivers_per_sender(sender_idx: int, num_senders: int, num_receivers: int, allow_idle_sender: bool
                             ) -> list[int]:
    """coati's pairing of senders and receivers: each receiver has one sender, or each sender one receiver."""
    if num_senders <= num_receivers or allow_idle_sender:
        return [i for i in range(num_receivers) if i % num_senders == sender_idx]
    return [sender_idx % num_receivers]


def build_strategy(strategy_fn: Callable[[], Strategy]) -> Strategy:
    """Call coati's `strategy_fn`; refuses (naming the argument) anything that does not give a `Strategy`."""
    if not callable(strategy_fn):
        raise TypeError(f"strategy_fn must be a function returning a Strategy, got {type(strategy_fn).__name__}")
    strategy = strategy_fn()
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy_fn must return a detached_rl.strategies.Strategy, got {type(strategy).__name__}")
    return strategy


def trainer_settings(train_batch_size: int = 8, buffer_limit: int = 0, eps_clip: float = 0.2,
                     value_clip: float = 0.4, update_lora_weights: bool = False,
                     algorithm: PPOConfig | None = None) -> tuple[TrainerConfig, PPOConfig]:
    """coati trainer arguments as a `TrainerConfig` and a `PPOConfig` (over `algorithm`, if given).

    `buffer_limit` counts batches, as coati's queue did (0: unlimited, here the default bound); makers stop at
    the end of `fit`, as a coati run ended.
    """
    if buffer_limit < 0:
        raise ValueError(f"buffer_limit must be >= 0 (0: unlimited), got {buffer_limit}")
    buffer = {"buffer_max_samples": buffer_limit * train_batch_size} if buffer_limit else {}
    config = TrainerConfig(train_batch_size=train_batch_size, weight_sync="lora" if update_lora_weights else "full",
                           **buffer)
    ppo = dataclasses.replace(algorithm or PPOConfig(), clip_low=eps_clip, clip_high=None, value_clip=value_clip)
    return config, ppo


def sampling_from_generate_kwargs(generate_kwargs: Mapping[str, Any]) -> tuple[SamplingConfig, int | None]:
    """A maker's `**generate_kwargs` as a `SamplingConfig`, and coati's `max_length` (prompt + response) if given.

    Unknown arguments are refused by name; `IGNORED_GENERATE_KWARGS` are accepted and have no effect.
    """
    unknown = sorted(set(generate_kwargs) - set(SAMPLING_KWARGS) - set(IGNORED_GENERATE_KWARGS)
                     - {"max_length", "eos_token_id"})
    if unknown:
        raise ValueError(f"unsupported generate argument(s) {unknown}; supported: {sorted(SAMPLING_KWARGS)}, "
                         f"max_length, eos_token_id (ignored: {sorted(IGNORED_GENERATE_KWARGS)})")
    if generate_kwargs.get("num_beams", 1) != 1:
        raise ValueError(f"num_beams must be 1 (makers sample), got {generate_kwargs['num_beams']}")
    values = {key: generate_kwargs[key] for key in SAMPLING_KWARGS if key in generate_kwargs}
    if values.get("top_k") is None:
        values.pop("top_k", None)
    eos = generate_kwargs.get("eos_token_id")
    if eos is not None:
        values["stop_token_ids"] = tuple(eos) if isinstance(eos, Sequence) else (int(eos),)
    max_length = generate_kwargs.get("max_length")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
        raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
    return SamplingConfig(**values), max_length


def batch_prompts(batch: Any, pad_token_id: int | None) -> tuple[list[Any], int | None]:
    """One dataloader batch as prompts (token-id lists or texts) and its padded width (None for texts).

    A batch is a dict of `input_ids` (and `attention_mask`), an id tensor [B, L] or [L] (padding is where the ids
    equal `pad_token_id`, as coati's generate took it), a str, or a sequence of strs or prompt items.
    """
    if isinstance(batch, str):
        return [batch], None
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise ValueError(f"a dict batch needs 'input_ids', got keys {sorted(batch)}")
        ids, mask = torch.as_tensor(batch["input_ids"]), batch.get("attention_mask")
    elif isinstance(batch, torch.Tensor):
        ids, mask = batch, None
    elif isinstance(batch, Sequence):
        return [item if isinstance(item, str) else as_prompt_item(item).prompt for item in batch], None
    else:
        raise TypeError(f"unsupported batch type {type(batch).__name__} (a dict of input_ids, a tensor or strs)")
    if ids.is_floating_point() or ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must be integer ids [B, L] or [L], got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.cpu().reshape(-1, ids.shape[-1])
    if mask is None:
        if pad_token_id is None:
            raise ValueError("an id tensor without attention_mask needs a pad_token_id to find its padding")
        keep = ids != pad_token_id
    else:
        keep = torch.as_tensor(mask).cpu().reshape(ids.shape) != 0
    prompts = []
    for row in range(ids.shape[0]):
        tokens = ids[row][keep[row]].tolist()
        if not tokens:
            raise ValueError(f"batch row {row} has no tokens (all padding)")
        prompts.append(tokens)
    return prompts, int(ids.shape[1])


def coati_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """This project's step metrics with coati's names added ("actor_loss", "critic_loss")."""
    return {**metrics, **{alias: metrics[name] for alias, name in COATI_METRICS.items() if name in metrics}}


def maker_models(model_fn: Callable[[], tuple], kl_coef: float, lora: bool = False) -> MakerModels:
    """coati's maker `model_fn() -> (actor, critic, reward model or reward function, initial model)` as
    `MakerModels` (no reference model when `kl_coef` is 0); with `lora` the actor must carry a LoRA adapter."""
    built = model_fn()
    if not isinstance(built, tuple | list) or len(built) != 4:
        raise ValueError("model_fn must return (actor, critic, reward_model, initial_model)")
    actor, critic, reward, initial = built
    if lora and lora_backend(actor.model) is None:
        raise ValueError("update_lora_weights=True: model_fn's actor must carry the trainers' LoRA adapter "
                         "(detached_rl.models.apply_lora with the same settings) to take LoRA-only updates")
    if not hasattr(reward, "score") and not hasattr(reward, "score_detailed"):
        if not callable(reward):
            raise TypeError(f"model_fn's reward_model must be a reward model or function, got {type(reward).__name__}")
        reward = FunctionReward(reward, actor.tokenizer)
    return MakerModels(actor=actor, critic=critic, reward=reward, reference=initial if kl_coef > 0 else None)


def save_model(model: torch.nn.Module, tokenizer: Any, path: str | os.PathLike) -> Path:
    """`model` (LoRA merged) as a `from_pretrained` directory, or for a `.pt`/`.pth`/`.bin` path a state dict."""
    path = Path(path)
    if path.suffix in STATE_DICT_SUFFIXES:
        plain = merged_model(model) if lora_backend(model) is not None else model
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({key: value.detach().cpu() for key, value in plain.state_dict().items()}, path)
        return path
    return save_merged(model, tokenizer, path)


VALUE_HEAD_FILE = "value_head.pt"


def save_critic(critic: torch.nn.Module, path: str | os.PathLike) -> Path:
    """A critic as a state dict (`.pt` path), or as its backbone's `from_pretrained` directory plus
    `value_head.pt` (the head's state dict)."""
    path = Path(path)
    if path.suffix in STATE_DICT_SUFFIXES:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({key: value.detach().cpu() for key, value in critic.state_dict().items()}, path)
        return path
    save_merged(critic.backbone, None, path)
    torch.save({key: value.detach().cpu() for key, value in critic.head.state_dict().items()}, path / VALUE_HEAD_FILE)
    return path


class Callbacks:
    """Calls coati's callback hooks on every callback that has them (a missing hook is a no-op)."""

    def __init__(self, callbacks: Iterable[Any]) -> None:
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str) -> Callable[..., None]:
        if not hook.startswith("on_"):
            raise AttributeError(hook)

        def call(*args: Any) -> None:
            for callback in self.callbacks:
                method = getattr(callback, hook, None)
                if method is not None:
                    method(*args)
        return call


class PerformanceEvaluator:
    """`eval_performance=True`: times batches and logs their count and mean duration when the loop or fit ends."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.batches = 0
        self.seconds = 0.0
        self._start: float | None = None

    def on_batch_start(self) -> None:
        """Start timing a batch."""
        self._start = time.perf_counter()

    def on_batch_end(self, *args: Any) -> None:
        """Stop timing a batch."""
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.batches += 1
            self._start = None

    def summary(self) -> dict[str, float]:
        """Batches timed and their mean duration."""
        return {"batches": float(self.batches), "seconds_per_batch": self.seconds / max(self.batches, 1)}

    def _log(self) -> None:
        logger.info("%s performance: %s", self.role, self.summary())

    on_fit_end = on_loop_end = _log


class CoatiRounds:
    """coati's `fit`: rounds of `update_steps` fresh batches, then `train_epochs - 1` shuffled re-runs over them."""

    def __init__(self, update_steps: int, train_epochs: int, seed: int = 0) -> None:
        if update_steps < 1 or train_epochs < 1:
            raise ValueError(f"update_steps and train_epochs must be >= 1, got {update_steps}, {train_epochs}")
        self.update_steps, self.train_epochs = update_steps, train_epochs
        self.step = 0
        self.recorded: list[Any] = []
        self._order: list[int] = []
        self._rng = random.Random(seed)

    @property
    def steps_per_round(self) -> int:
        """Training steps between two weight pushes."""
        return self.update_steps * self.train_epochs

    def position(self) -> tuple[int, int, int]:
        """(round, epoch, batch) of the next step."""
        within = self.step % self.steps_per_round
        return self.step // self.steps_per_round, within // self.update_steps, within % self.update_steps

    def next_batch(self, fresh: Callable[[], Any]) -> Any:
        """The next step's batch: fresh (and kept) in a round's first epoch, else a kept one in shuffled order."""
        _, epoch, index = self.position()
        if epoch == 0:
            if index == 0:
                self.recorded = []
            self.recorded.append(fresh())
            return self.recorded[-1]
        if index == 0:
            self._order = list(range(len(self.recorded)))
            self._rng.shuffle(self._order)
        return self.recorded[self._order[index]]

    def advance(self) -> None:
        """The step was trained."""
        self.step += 1

    def at_round_end(self) -> bool:
        """True right after a round's last step (time to push weights)."""
        return self.step > 0 and self.step % self.steps_per_round == 0


class CoatiTrainerCore(TrainerCore):
    """`TrainerCore` whose batches follow `CoatiRounds` during a coati `fit` (or one given to `training_step`),
    pushing weights only at round ends and calling coati's callbacks."""

    def __init__(self, *args: Any, callbacks: Callbacks | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.callbacks = callbacks or Callbacks([])
        self.rounds: CoatiRounds | None = None
        self.injected: list[Any] | None = None
        self.last_batch: list[Any] | None = None

    def next_batch(self) -> tuple[list[Any], dict[str, float]]:
        """The injected batch, the rounds' next batch, or the buffer's."""
        if self.injected is not None:
            batch, self.injected = self.injected, None
        elif self.rounds is not None:
            fresh = super().next_batch
            batch = self.rounds.next_batch(lambda: fresh()[0])
        else:
            return super().next_batch()
        self.last_batch = batch
        return batch, {}

    def train_step(self) -> dict[str, float]:
        """One coati training step, with coati's episode, epoch and batch callbacks."""
        if self.rounds is None:
            return coati_metrics(super().train_step())
        episode, epoch, index = self.rounds.position()
        if epoch == 0 and index == 0:
            self.callbacks.on_episode_start(episode)
        if index == 0:
            self.callbacks.on_epoch_start(epoch)
        self.callbacks.on_batch_start()
        metrics = coati_metrics(super().train_step())
        self.callbacks.on_batch_end(metrics, self.last_batch)
        self.rounds.advance()
        if index == self.rounds.update_steps - 1:
            self.callbacks.on_epoch_end(epoch)
        return metrics

    def sync_weights(self, put: Any, send_update: Any) -> dict[str, float]:
        """Push weights at the end of a round only (coati's `_update_remote_makers` after each round)."""
        if self.rounds is None:
            return super().sync_weights(put, send_update)
        if not self.rounds.at_round_end():
            return {}
        self.callbacks.on_update_start()
        metrics = super().sync_weights(put, send_update)
        self.callbacks.on_update_end()
        self.callbacks.on_episode_end(self.rounds.step // self.rounds.steps_per_round - 1)
        return metrics


def _actor_name(role: str) -> str:
    name = ray.get_runtime_context().get_actor_name()
    if not name:
        raise ValueError(f"a coati {role} finds its peers by name: create it with .options(name=...).remote(...)")
    return name


def _namespace(namespace: str | None) -> str:
    """The given namespace, else coati's RAY_NAMESPACE, else the namespace this actor runs in (its driver's)."""
    return namespace or os.environ.get("RAY_NAMESPACE") or ray.get_runtime_context().namespace


def _names(value: Any, field: str) -> list[str]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{field} must be a list of actor names, got {value!r}")
    return list(value)


# ---------------------------------------------------------------- the trainer
class CoatiPPOTrainer(PPOTrainerShell):
    """coati's `DetachedPPOTrainer` signature and methods over this project's PPO trainer shell."""

    def __init__(
        self,
        experience_maker_holder_name_list: list[str],
        strategy_fn: Callable[[], Strategy],
        model_fn: Callable[[], tuple[Any, Any]],
        env_info: dict[str, str] | None = None,
        train_batch_size: int = 8,
        buffer_limit: int = 0,
        eps_clip: float = 0.2,
        value_clip: float = 0.4,
        dataloader_pin_memory: bool = True,
        callbacks: Sequence[Any] = (),
        eval_performance: bool = False,
        debug: bool = False,
        update_lora_weights: bool = False,
        *,
        algorithm: PPOConfig | None = None,
        sampling: SamplingConfig | None = None,
        namespace: str | None = None,
    ) -> None:
        if env_info:
            set_dist_env(env_info)
        if debug:
            logging.getLogger("detached_rl").setLevel(logging.DEBUG)
        self.maker_names = _names(experience_maker_holder_name_list, "experience_maker_holder_name_list")
        self._strategy = build_strategy(strategy_fn)
        self.performance = PerformanceEvaluator("trainer") if eval_performance else None
        self._callbacks = Callbacks([*callbacks, *([self.performance] if self.performance else [])])
        # Explicit settings win over what the makers use (`_adopt_maker_settings`).
        self._explicit = {"sampling": sampling is not None,
                          "kl_coef": algorithm is not None and algorithm.kl_coef != PPOConfig().kl_coef}
        config, ppo = trainer_settings(train_batch_size, buffer_limit, eps_clip, value_clip, update_lora_weights,
                                       algorithm)
        super().__init__(_actor_name("trainer"), model_fn, config, ppo, _namespace(namespace),
                         rank=self._strategy.rank, world_size=self._strategy.world_size,
                         strategy=self._strategy.name, sampling=sampling)
        if self.core is None:  # a distributed strategy: the shell leaves the build to us
            self._strategy.setup()
            self._build(self._strategy)

    def _build(self, strategy: Strategy) -> None:
        # The shell offers its own naive strategy; the one `strategy_fn` made wins.
        self.core = CoatiTrainerCore(self.name, self._make_learner(self._strategy), self.config,
                                     callbacks=self._callbacks)
        self.core.build_update(put_chunk)
        self._ready.set()

    def _adopt_maker_settings(self) -> None:
        """Train under the makers' sampling and KL coefficient (coati set both on the maker only)."""
        settings = []
        for name in self.maker_names:
            try:
                settings.append(ray.get(attach(name, self.namespace, 60.0).coati_settings.remote(), timeout=60.0))
            except AttributeError:  # not a coati maker: it states nothing
                continue
        learner = self._core().learner
        for key in ("sampling", "kl_coef"):
            values = {repr(s[key]): s[key] for s in settings}
            if len(values) > 1:
                raise ValueError(f"makers {self.maker_names} disagree on {key}: {sorted(values)}")
            if values and not self._explicit[key]:
                value = next(iter(values.values()))
                if key == "sampling":
                    learner.sampling = value
                else:
                    learner.config = dataclasses.replace(learner.config, kl_coef=value)

    def sync_models_to_remote_makers(self, **config: Any) -> None:
        """Make every named maker take its trainers' current weights now (it registers with them)."""
        handles = [attach(name, self.namespace, 60.0) for name in self.maker_names]
        ray.get([handle.register_with_trainers.remote() for handle in handles])

    def _update_remote_makers(self, fully_update: bool = False, **config: Any) -> None:
        """Push the current weights to the named makers: LoRA-only with `update_lora_weights`, unless
        `fully_update`."""
        if fully_update:
            self.sync_models_to_remote_makers()
            return
        core = self._core()
        update, _ = core.build_update(put_chunk)
        results = dispatch_weight_update(update, self.maker_names, self.namespace, self.config.weight_push_timeout_s)()
        failed = {name: str(result) for name, result in results.items() if isinstance(result, BaseException)}
        if failed:
            raise RuntimeError(f"weight update v{update.manifest.version} failed on makers {failed}")

    @ray.method(concurrency_group="compute")
    def training_step(self, experience: Any) -> dict[str, float]:
        """Train on one batch (a list of `Experience`, or one); returns {"actor_loss", "critic_loss"}."""
        core = self._core()
        core.injected = list(experience) if isinstance(experience, list | tuple) else [experience]
        metrics = core.train_step()
        return {alias: metrics[alias] for alias in COATI_METRICS}

    @ray.method(concurrency_group="compute")
    def fit(self, total_steps: int, update_steps: int, train_epochs: int = 1) -> dict[str, Any]:
        """coati's fit: `total_steps // update_steps` rounds of `update_steps` buffer batches, each round re-run
        `train_epochs - 1` more times in shuffled order, then the weights pushed to the makers."""
        core = self._core()
        rounds = CoatiRounds(update_steps, train_epochs, seed=core.policy_version)
        count = (total_steps // update_steps) * rounds.steps_per_round
        self._adopt_maker_settings()
        self._callbacks.on_fit_start()
        result: dict[str, Any] = {"steps": 0, "policy_version": core.policy_version}
        if count:
            core.rounds = rounds
            try:
                # Every step asks to push; the core pushes at round ends only.
                result = super().fit(core.policy_version + count, 1, None)
            finally:
                core.rounds = None
        self._callbacks.on_fit_end()
        return result

    def _save(self, only_rank0: bool, write: Callable[[Any], Any]) -> None:
        core = self._core()
        if only_rank0 and not core.strategy.is_rank_zero:
            return
        with core.weights_lock:
            write(core.learner)

    def strategy_save_actor(self, path: str, only_rank0: bool = False) -> None:
        """The policy (LoRA merged) as a `from_pretrained` directory, or a state dict for a `.pt` path."""
        def write(learner: Any) -> None:
            actor = learner.strategy.unwrap(learner.actor)
            save_model(actor.model, actor.tokenizer, path)
        self._save(only_rank0, write)

    def strategy_save_critic(self, path: str, only_rank0: bool = False) -> None:
        """The critic: a state dict for a `.pt` path, else its backbone directory plus `value_head.pt`."""
        self._save(only_rank0, lambda learner: save_critic(learner.strategy.unwrap(learner.critic), path))

    def strategy_save_actor_optim(self, path: str, only_rank0: bool = False) -> None:
        """The actor's optimizer state dict (`torch.load` reads it)."""
        self._save(only_rank0, lambda learner: torch.save(learner.actor_optimizer.state_dict(), path))

    def strategy_save_critic_optim(self, path: str, only_rank0: bool = False) -> None:
        """The critic's optimizer state dict (`torch.load` reads it)."""
        self._save(only_rank0, lambda learner: torch.save(learner.critic_optimizer.state_dict(), path))

    @ray.method(concurrency_group="buffer_length")
    def buffer_get_length(self) -> int:
        """Full training batches in the replay buffer (coati counted batches)."""
        return len(self._core().buffer) // self.config.train_batch_size

    @ray.method(concurrency_group="buffer_append")
    def buffer_append(self, experience: Any) -> Any:
        """Append experience (one `Experience` or a list); returns the buffer's acknowledgement."""
        items = list(experience) if isinstance(experience, list | tuple) else [experience]
        return self._core().push_experience(items)

    @ray.method(concurrency_group="buffer_append")
    def buffer_extend(self, items: Sequence[Any]) -> Any:
        """Append a list of `Experience`; returns the buffer's acknowledgement."""
        return self._core().push_experience(list(items))


# ---------------------------------------------------------------- the maker
class DataloaderPrompts:
    """A maker's prompt source over coati dataloader batches: each `next_batch` is the next whole batch."""

    def __init__(self, batches: Iterator[Any], pad_token_id: int | None,
                 on_batch: Callable[[list[Any], int | None], None] | None = None) -> None:
        self.batches = batches
        self.pad_token_id = pad_token_id
        self.on_batch = on_batch

    def next_batch(self, count: int) -> list[PromptItem]:
        """The next dataloader batch as prompts (`count` is the dataloader's batch size, not this argument)."""
        try:
            batch = next(self.batches)
        except StopIteration:
            raise RuntimeError("the dataloader ran out of batches") from None
        prompts, width = batch_prompts(batch, self.pad_token_id)
        if self.on_batch is not None:
            self.on_batch(prompts, width)
        return [PromptItem(prompt) for prompt in prompts]


class _NoDataloader:
    def next_batch(self, count: int) -> list[PromptItem]:
        raise RuntimeError("a coati maker generates from workingloop(dataloader_fn): call that")


def dataloader_batches(dataloader_fn: Callable[[], Iterable[Any]], num_epochs: int = 1, num_steps: int = 0
                       ) -> tuple[Iterator[Any], int]:
    """coati's workingloop iteration: `num_steps` batches cycling the dataloader when > 0, else `num_epochs`
    passes over it; returns the batches and their count."""
    dataloader = dataloader_fn()
    if num_steps > 0:
        def cycle() -> Iterator[Any]:
            while True:
                empty = True
                for batch in dataloader:
                    empty = False
                    yield batch
                if empty:
                    raise RuntimeError("the dataloader yields no batches")
        return cycle(), num_steps
    if num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 when num_steps is 0, got {num_epochs}")
    try:
        count = len(dataloader)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError("a dataloader without len() needs num_steps > 0") from None
    return (batch for _ in range(num_epochs) for batch in dataloader), num_epochs * count


_MakerShell = _MakerActor.__ray_actor_class__


class CoatiMakerHolder(_MakerShell):
    """coati's `ExperienceMakerHolder` signature and `workingloop` over this project's maker shell."""

    def __init__(
        self,
        detached_trainer_name_list: list[str],
        strategy_fn: Callable[[], Strategy],
        model_fn: Callable[[], tuple[Any, Any, Any, Any]],
        env_info: dict[str, str] | None = None,
        sync_models_from_trainers: bool = False,
        buffer_cpu_offload: bool = True,
        kl_coef: float = 0.1,
        callbacks: Sequence[Any] = (),
        eval_performance: bool = False,
        debug: bool = False,
        update_lora_weights: bool = False,
        *,
        namespace: str | None = None,
        maker_config: MakerConfig | None = None,
        **generate_kwargs: Any,
    ) -> None:
        if env_info:
            set_dist_env(env_info)
        if debug:
            logging.getLogger("detached_rl").setLevel(logging.DEBUG)
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        strategy = build_strategy(strategy_fn)
        sampling, self.max_length = sampling_from_generate_kwargs(generate_kwargs)
        self.kl_coef = kl_coef
        self.pad_token_id = generate_kwargs.get("pad_token_id")
        self.performance = PerformanceEvaluator("maker") if eval_performance else None
        self.callbacks = Callbacks([*callbacks, *([self.performance] if self.performance else [])])
        config = dataclasses.replace(maker_config or MakerConfig(), sampling=sampling)
        super().__init__(_actor_name("maker"), _names(detached_trainer_name_list, "detached_trainer_name_list"),
                         lambda: maker_models(model_fn, kl_coef, update_lora_weights), _NoDataloader(), config, _namespace(namespace),
                         strategy_factory=lambda: strategy, resume_on_restart=False)
        self.base_sampling = self.core.sampling
        self.core.make_experience = self._make_experience  # the loop's batches pass coati's callbacks

    def _make_experience(self) -> list[Any]:
        self.callbacks.on_batch_start()
        self.callbacks.on_make_experience_start()
        experiences = ExperienceMaker.make_experience(self.core)
        self.callbacks.on_make_experience_end(experiences)
        self.callbacks.on_batch_end()
        return experiences

    def _fit_length(self, prompts: list[Any], width: int | None) -> None:
        """coati's max_length counts the padded prompt: the responses of this batch get the rest."""
        if self.max_length is None:
            return
        if width is None:
            tokenizer = self.core.tokenizer
            width = max(len(p) if not isinstance(p, str) else len(tokenizer(p)["input_ids"]) for p in prompts)
        self.core.sampling = dataclasses.replace(self.base_sampling, max_new_tokens=max(1, self.max_length - width))

    @ray.method(concurrency_group="compute")
    def workingloop(self, dataloader_fn: Callable[[], Iterable[Any]], num_epochs: int = 1, num_steps: int = 0
                    ) -> dict[str, Any]:
        """Generate from `num_steps` dataloader batches (cycling it) when > 0, else from `num_epochs` passes,
        pushing to the trainers; returns the maker's status. Ends early when the trainers end their fit."""
        batches, count = dataloader_batches(dataloader_fn, num_epochs, num_steps)
        pad = self.pad_token_id if self.pad_token_id is not None else self.core.tokenizer.pad_token_id
        self.core.prompts = DataloaderPrompts(batches, pad, self._fit_length)
        self.callbacks.on_loop_start()
        status = self.run(count)
        self.callbacks.on_loop_end()
        return status

    @ray.method(concurrency_group="model_io")
    def register_with_trainers(self) -> int:
        """Take the trainers' current weights (what a coati trainer's `sync_models_to_remote_makers` sent)."""
        self._attach_trainers()
        return self.core.policy_version

    @ray.method(concurrency_group="experience_io")
    def coati_settings(self) -> dict[str, Any]:
        """What coati set on the maker only and the trainer trains with: sampling and the KL coefficient."""
        return {"sampling": dataclasses.replace(self.base_sampling, max_new_tokens=1), "kl_coef": self.kl_coef}


DetachedPPOTrainer = ray.remote(concurrency_groups=TRAINER_GROUPS)(CoatiPPOTrainer)
ExperienceMakerHolder = ray.remote(concurrency_groups={"experience_io": 1, "model_io": 1, "compute": 1})(
    CoatiMakerHolder)

__all__ = [
    "DetachedPPOTrainer", "ExperienceMakerHolder", "get_receivers_per_sender", "get_strategy_from_args",
    "set_dist_env",
]
