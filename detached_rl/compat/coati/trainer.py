"""coati's `DetachedPPOTrainer`: its signature and methods over the PPO trainer shell."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from detached_rl.actors.trainer import TRAINER_GROUPS, PPOTrainerShell
from detached_rl.actors.transport import attach
from detached_rl.algorithms.ppo import PPOConfig
from detached_rl.compat.coati.callbacks import Callbacks, PerformanceEvaluator
from detached_rl.compat.coati.peers import _actor_name, _names, _namespace
from detached_rl.compat.coati.rounds import CoatiRounds, CoatiSession, training_batch
from detached_rl.compat.coati.saving import save_critic, save_model
from detached_rl.compat.coati.settings import (
    COATI_METRICS,
    build_strategy,
    coati_metrics,
    set_dist_env,
    trainer_settings,
)
from detached_rl.compat.placement import PlacementCheckedActorClass
from detached_rl.core.sampling import SamplingConfig
from detached_rl.strategies import Strategy
from detached_rl.weights.ray_wire import ray_send_update


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
        config, ppo = trainer_settings(train_batch_size, buffer_limit, eps_clip, value_clip,
                                       update_lora_weights, algorithm)
        super().__init__(_actor_name("trainer"), model_fn, config, ppo, _namespace(namespace),
                         rank=self._strategy.rank, world_size=self._strategy.world_size,
                         strategy=self._strategy.name, sampling=sampling)
        if self.core is None:  # a distributed strategy: the shell leaves the build to us
            self._strategy.setup()
            self.build(self._strategy)
        self.session = CoatiSession(self._callbacks)
        self.session.install(self.trainer_core())

    def make_learner(self, strategy: Strategy) -> Any:
        """The shell's PPO learner under the strategy `strategy_fn` made (not the one the shell offers)."""
        return super().make_learner(self._strategy)

    def _adopt_maker_settings(self) -> None:
        """Train under the makers' sampling and KL coefficient (coati set both on the maker only)."""
        settings = []
        for name in self.maker_names:
            try:
                settings.append(ray.get(attach(name, self.namespace, 60.0).coati_settings.remote(),
                                        timeout=60.0))
            except AttributeError:  # not a coati maker: it states nothing
                continue
        learner = self.trainer_core().learner
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
        weights = self.trainer_core().weights
        weights.add_makers(self.maker_names)  # coati pushes to the makers it was given, registered or not
        send = ray_send_update(self.namespace, self.config.weight_push_timeout_s)
        metrics = weights.publish(self.put_chunk, send)
        failed = {name: weights.lost[name] for name in self.maker_names if name in weights.lost}
        if failed:
            version = int(metrics["weight_sync/version"])
            raise RuntimeError(f"weight update v{version} failed on makers {failed}")

    @ray.method(concurrency_group="compute")
    def training_step(self, experience: Any) -> dict[str, float]:
        """Train on one batch (a list of `Experience`, or one); returns {"actor_loss", "critic_loss"}.

        Anything else (coati's own batched `Experience` included) is refused naming the element and field.
        """
        core = self.trainer_core()
        self.session.inject(training_batch(experience, core))
        metrics = coati_metrics(core.train_step())
        return {alias: metrics[alias] for alias in COATI_METRICS}

    @ray.method(concurrency_group="compute")
    def fit(self, total_steps: int, update_steps: int, train_epochs: int = 1) -> dict[str, Any]:
        """coati's fit: `total_steps // update_steps` rounds of `update_steps` buffer batches, each round
        re-run `train_epochs - 1` more times in shuffled order, then the weights pushed to the makers."""
        core = self.trainer_core()
        rounds = CoatiRounds(update_steps, train_epochs, seed=core.policy_version)
        count = (total_steps // update_steps) * rounds.steps_per_round
        self._adopt_maker_settings()
        self._callbacks.on_fit_start()
        result: dict[str, Any] = {"steps": 0, "policy_version": core.policy_version}
        if count:
            self.session.rounds = rounds
            try:
                # The core pushes at round ends only.
                result = super().fit(core.policy_version + count, 1, None, push_when=self.session.push_when)
            finally:
                self.session.rounds = None
        self._callbacks.on_fit_end()
        return result

    def _save(self, only_rank0: bool, write: Callable[[Any], Any]) -> None:
        core = self.trainer_core()
        if only_rank0 and not core.strategy.is_rank_zero:
            return
        core.with_learner(write)

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
        return len(self.trainer_core().buffer) // self.config.train_batch_size

    @ray.method(concurrency_group="buffer_append")
    def buffer_append(self, experience: Any) -> Any:
        """Append experience (one `Experience` or a list); returns the buffer's acknowledgement."""
        items = list(experience) if isinstance(experience, list | tuple) else [experience]
        return self.trainer_core().push_experience(items)

    @ray.method(concurrency_group="buffer_append")
    def buffer_extend(self, items: Sequence[Any]) -> Any:
        """Append a list of `Experience`; returns the buffer's acknowledgement."""
        return self.trainer_core().push_experience(list(items))


#: The Ray actor class; `.remote()` refuses at once a request the cluster can never place.
DetachedPPOTrainer = PlacementCheckedActorClass(
    ray.remote(concurrency_groups=TRAINER_GROUPS)(CoatiPPOTrainer), "coati trainer")
