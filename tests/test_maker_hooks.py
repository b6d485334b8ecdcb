"""The maker's public hooks (no Ray): batch callbacks, `set_prompts`, and a `PromptBatch`'s own sampling."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from detached_rl.actors.maker import MAKER_GROUPS, ExperienceMakerHolder, MakerShell
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.prompts import CyclingPrompts, PromptBatch, PromptItem
from detached_rl.maker.config import MakerConfig as ConfigFromItsModule
from detached_rl.maker.experience_maker import BatchCallback, ExperienceMaker, MakerConfig
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore

from .helpers import ObjectStore, arithmetic_prompts, naive_strategy, tiny_actor_critic, tiny_maker_models

SAMPLING = SamplingConfig(max_new_tokens=6)


def maker(synced: bool = True) -> ExperienceMaker:
    config = MakerConfig(experience_batch_size=2, sampling=SAMPLING)
    made = ExperienceMaker("maker_0", tiny_maker_models(seed=7, reference=False),
                           CyclingPrompts(arithmetic_prompts()), config, strategy=naive_strategy())
    if synced:
        actor, critic = tiny_actor_critic(seed=0)
        learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(sampling=SAMPLING))
        trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=4))
        store = ObjectStore()
        trainer.weights.snapshot(store.put)
        made.subscriber.take_offered([trainer.weights.register("maker_0")], store.fetch)
    return made


class Recording:
    def __init__(self, log: list[Any], tag: str) -> None:
        self.log, self.tag = log, tag

    def on_batch_start(self) -> None:
        self.log.append((self.tag, "start"))

    def on_batch_end(self, experiences: list[Any]) -> None:
        self.log.append((self.tag, "end", len(experiences)))


class FixedPrompts:
    """Each batch: the same prompts, sampled with `sampling`."""

    def __init__(self, sampling: SamplingConfig | None) -> None:
        self.sampling = sampling

    def next_batch(self, count: int) -> PromptBatch:
        return PromptBatch([PromptItem("1 + 1 =")] * count, self.sampling)


def spy_sampling(made: ExperienceMaker) -> list[SamplingConfig]:
    seen: list[SamplingConfig] = []
    generate = made.backend.generate_text

    def recording(prompts: list[Any], sampling: SamplingConfig) -> Any:
        seen.append(sampling)
        return generate(prompts, sampling)

    made.backend.generate_text = recording  # type: ignore[method-assign]
    return seen


def test_callbacks_run_around_each_batch_in_order() -> None:
    made, log = maker(), []
    made.add_callbacks(Recording(log, "a"), Recording(log, "b"))
    experiences = made.make_experience()
    assert len(experiences) == 2
    assert log == [("a", "start"), ("b", "start"), ("a", "end", 2), ("b", "end", 2)]
    assert isinstance(Recording(log, "c"), BatchCallback)


def test_a_batch_that_raises_gets_no_end_callback() -> None:
    made, log = maker(synced=False), []
    made.add_callbacks(Recording(log, "a"))
    with pytest.raises(RuntimeError, match="no complete weights"):
        made.make_experience()
    assert log == [("a", "start")]


def test_add_callbacks_and_set_prompts_refuse_what_does_not_fit() -> None:
    made = maker(synced=False)
    with pytest.raises(TypeError, match="on_batch_start"):
        made.add_callbacks(object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="next_batch"):
        made.set_prompts([PromptItem("x")])  # type: ignore[arg-type]
    assert made.callbacks == []


def test_set_prompts_and_a_batchs_own_sampling() -> None:
    made = maker()
    seen = spy_sampling(made)
    short = dataclasses.replace(SAMPLING, max_new_tokens=2)
    made.set_prompts(FixedPrompts(short))
    experiences = made.make_experience()
    assert seen == [short] and made.sampling == SAMPLING  # the maker's own sampling is left alone
    assert all(e.response_length <= 2 for e in experiences)
    made.set_prompts(FixedPrompts(None))  # a batch without sampling: the maker's
    made.make_experience()
    assert seen[-1] == SAMPLING


def test_prompt_batch_is_a_list_that_keeps_its_sampling() -> None:
    import pickle

    batch = PromptBatch([PromptItem("a")], SAMPLING)
    again = pickle.loads(pickle.dumps(batch))
    assert again == [PromptItem("a")] and again.sampling == SAMPLING
    assert PromptBatch().sampling is None


def test_the_maker_actor_is_the_plain_shell_with_its_groups() -> None:
    import ray.actor

    assert isinstance(ExperienceMakerHolder, ray.actor.ActorClass) and not isinstance(MakerShell,
                                                                                       ray.actor.ActorClass)
    assert set(MAKER_GROUPS) == {"experience_io", "model_io", "compute", "progress", "evaluation", "relay"}
    assert ConfigFromItsModule is MakerConfig
    from detached_rl.compat.coati.maker import CoatiMakerHolder

    assert issubclass(CoatiMakerHolder, MakerShell)
