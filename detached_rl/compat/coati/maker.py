"""coati's `ExperienceMakerHolder`: dataloader prompts, `workingloop`, its signature over the maker shell."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import ray

from detached_rl.actors.maker import MAKER_GROUPS, MakerShell
from detached_rl.compat.coati.callbacks import Callbacks, PerformanceEvaluator
from detached_rl.compat.coati.peers import _actor_name, _names, _namespace
from detached_rl.compat.coati.settings import (
    batch_prompts,
    build_strategy,
    maker_models,
    sampling_from_generate_kwargs,
    set_dist_env,
)
from detached_rl.compat.placement import PlacementCheckedActorClass
from detached_rl.core.experience import Experience
from detached_rl.core.prompts import PromptBatch, PromptItem
from detached_rl.core.sampling import SamplingConfig
from detached_rl.maker.experience_maker import MakerConfig
from detached_rl.strategies import Strategy


class DataloaderPrompts:
    """A maker's prompt source over coati dataloader batches: each `next_batch` is the next whole batch,
    sampled as `on_batch(prompts, padded width)` says (None, or no `on_batch`: as the maker samples)."""

    def __init__(self, batches: Iterator[Any], pad_token_id: int | None,
                 on_batch: Callable[[list[Any], int | None], SamplingConfig | None] | None = None) -> None:
        self.batches = batches
        self.pad_token_id = pad_token_id
        self.on_batch = on_batch

    def next_batch(self, count: int) -> PromptBatch:
        """The next dataloader batch as prompts (`count`: the dataloader's batch size, not this argument)."""
        try:
            batch = next(self.batches)
        except StopIteration:
            raise RuntimeError("the dataloader ran out of batches") from None
        prompts, width = batch_prompts(batch, self.pad_token_id)
        sampling = self.on_batch(prompts, width) if self.on_batch is not None else None
        return PromptBatch((PromptItem(prompt) for prompt in prompts), sampling)


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


class _CoatiBatchHooks:
    """coati's batch callbacks around each batch the maker makes (an `ExperienceMaker` batch callback)."""

    def __init__(self, callbacks: Callbacks) -> None:
        self.callbacks = callbacks

    def on_batch_start(self) -> None:
        self.callbacks.on_batch_start()
        self.callbacks.on_make_experience_start()

    def on_batch_end(self, experiences: list[Experience]) -> None:
        self.callbacks.on_make_experience_end(experiences)
        self.callbacks.on_batch_end()


class CoatiMakerHolder(MakerShell):
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
        super().__init__(_actor_name("maker"),
                         _names(detached_trainer_name_list, "detached_trainer_name_list"),
                         lambda: maker_models(model_fn, kl_coef, update_lora_weights), _NoDataloader(),
                         config, _namespace(namespace),
                         strategy_factory=lambda: strategy, resume_on_restart=False)
        self.base_sampling = self.core.sampling
        self.core.add_callbacks(_CoatiBatchHooks(self.callbacks))  # the loop's batches pass coati's callbacks

    def _fit_length(self, prompts: list[Any], width: int | None) -> SamplingConfig | None:
        """coati's max_length counts the padded prompt: the responses of this batch get the rest."""
        if self.max_length is None:
            return None
        if width is None:
            tokenizer = self.core.tokenizer
            width = max(len(p) if not isinstance(p, str) else len(tokenizer(p)["input_ids"]) for p in prompts)
        return dataclasses.replace(self.base_sampling, max_new_tokens=max(1, self.max_length - width))

    @ray.method(concurrency_group="compute")
    def workingloop(self, dataloader_fn: Callable[[], Iterable[Any]], num_epochs: int = 1, num_steps: int = 0
                    ) -> dict[str, Any]:
        """Generate from `num_steps` dataloader batches (cycling it) when > 0, else from `num_epochs` passes,
        pushing to the trainers; returns the maker's status. Ends early when the trainers end their fit."""
        batches, count = dataloader_batches(dataloader_fn, num_epochs, num_steps)
        pad = self.pad_token_id if self.pad_token_id is not None else self.core.tokenizer.pad_token_id
        self.core.set_prompts(DataloaderPrompts(batches, pad, self._fit_length))
        self.callbacks.on_loop_start()
        status = self.run(count)
        self.callbacks.on_loop_end()
        return status

    @ray.method(concurrency_group="model_io")
    def register_with_trainers(self) -> int:
        """Take the trainers' current weights (what a coati trainer's `sync_models_to_remote_makers` sent)."""
        return self.sync()  # the shell's public re-registration, run here in this method's concurrency group

    @ray.method(concurrency_group="experience_io")
    def coati_settings(self) -> dict[str, Any]:
        """What coati set on the maker only and the trainer trains with: sampling and the KL coefficient."""
        return {"sampling": dataclasses.replace(self.base_sampling, max_new_tokens=1),
                "kl_coef": self.kl_coef}


#: The Ray actor class; `.remote()` refuses at once a request the cluster can never place.
ExperienceMakerHolder = PlacementCheckedActorClass(
    ray.remote(concurrency_groups=MAKER_GROUPS)(CoatiMakerHolder),
    "coati maker")
