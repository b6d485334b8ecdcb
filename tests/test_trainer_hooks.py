"""The trainer's public hooks (issue 27), without Ray: `step`, `register_makers`, batch sources, callbacks,
`push_when`, the shell's `build`/`make_learner`/`trainer_core`, ratio observers, `update_reference`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from detached_rl import Experience
from detached_rl.actors.trainer import GRPOTrainerShell, PPOTrainerShell
from detached_rl.algorithms.grpo import LOG_RATIO_CLAMP, GRPOConfig, GRPOLearner
from detached_rl.algorithms.ppo import PPOLearner
from detached_rl.models import Actor, SamplingConfig, tiny_causal_lm
from detached_rl.strategies import Strategy
from detached_rl.trainer.batches import BatchSource
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCallback, TrainerCore
from detached_rl.weights.update import ApplyResult

from .helpers import ObjectStore, make_experience, naive_strategy, tiny_actor_critic

SAMPLING = SamplingConfig(max_new_tokens=6)


def ppo_core(batch_size: int = 2, **kwargs: Any) -> TrainerCore:
    actor, critic = tiny_actor_critic(seed=0)
    return TrainerCore("t", PPOLearner(actor, critic, naive_strategy()),
                       TrainerConfig(train_batch_size=batch_size), **kwargs)


def samples(count: int) -> list[Experience]:
    return [make_experience(reward=float(i), values=torch.zeros(2)) for i in range(count)]


class Recorder(TrainerCallback):
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def on_step_start(self, step: int) -> None:
        self.calls.append(("start", step))

    def on_step_end(self, step: int, metrics: dict[str, float], batch: list[Any]) -> None:
        metrics["hooked"] = 1.0
        self.calls.append(("end", step, len(batch)))

    def on_push_start(self, step: int) -> None:
        self.calls.append(("push_start", step))

    def on_push_end(self, step: int, metrics: dict[str, float]) -> None:
        self.calls.append(("push_end", step, "weight_sync/version" in metrics))


def test_step_records_history_counters_and_callbacks_without_a_push() -> None:
    core = ppo_core()
    recorder = Recorder()
    core.add_callbacks(recorder)
    core.push_experience(samples(4))
    metrics = core.step()
    assert core.state == "training" and core.policy_version == 1 and core.samples_trained == 2
    assert list(core.history) == [metrics] and metrics["hooked"] == 1.0
    assert recorder.calls == [("start", 0), ("end", 1, 2)]
    assert core.weights.latest_update is None  # no weight push


def test_step_failure_sets_state_and_last_error() -> None:
    class Broken:
        def next_batch(self, core: TrainerCore) -> tuple[list[Any], dict[str, float]]:
            raise ValueError("no data")

    core = ppo_core(batch_source=Broken())
    with pytest.raises(ValueError):
        core.step()
    assert core.state == "failed" and core.last_error == "ValueError: no data" and not core.history


def test_batch_source_replaces_the_buffer_and_can_be_unset() -> None:
    batch = samples(2)

    class Fixed:
        def __init__(self) -> None:
            self.calls = 0

        def next_batch(self, core: TrainerCore) -> tuple[list[Any], dict[str, float]]:
            self.calls += 1
            return batch, {"source/fixed": 1.0}

    source = Fixed()
    assert isinstance(source, BatchSource)
    core = ppo_core()
    core.set_batch_source(source)
    metrics = core.step()
    assert source.calls == 1 and core.last_batch is batch and metrics["source/fixed"] == 1.0
    core.set_batch_source(None)
    core.push_experience(samples(2))
    core.step()
    assert source.calls == 1 and len(core.buffer) == 0


def test_fit_push_when_and_push_callbacks() -> None:
    core = ppo_core()
    recorder = Recorder()
    core.add_callbacks(recorder)
    core.push_experience(samples(8))
    pushed: list[int] = []
    core.fit(4, put=lambda chunk: chunk, send_update=lambda update, makers: pushed.append(1) or {},
             update_steps=1, push_when=lambda step: step == 3)
    pushes = [call for call in recorder.calls if call[0].startswith("push")]
    assert pushes == [("push_start", 3), ("push_end", 3, True)]
    rows = list(core.history)
    assert len(rows) == 4 and all(row["hooked"] == 1.0 for row in rows)
    assert [row.get("weight_sync/version") for row in rows] == [None, None, 3.0, None]
    assert core.state == "done"


def test_register_makers_adds_names() -> None:
    core = ppo_core()
    core.weights.add_makers(["m0", "m1"])
    core.weights.add_makers(iter(["m1", "m2"]))
    assert core.weights.makers == {"m0", "m1", "m2"}
    assert core.weights.makers_of_this_rank() == ["m0", "m1", "m2"]


def grpo_learner(**config: Any) -> GRPOLearner:
    return GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy(),
                       GRPOConfig(sampling=SAMPLING, **config))


def grpo_batch() -> list[Experience]:
    return [Experience(torch.tensor([5, 6]), torch.arange(10, 13), torch.full((3,), -1.0),
                       torch.tensor(float(i % 2)), policy_version=0, group_id=f"g{i // 2}") for i in range(4)]


def test_ratio_observer_sees_every_policy_loss_input() -> None:
    learner = grpo_learner()
    seen: list[tuple[torch.Size, torch.Size, torch.Size]] = []
    learner.add_ratio_observer(lambda new, old, mask: seen.append((new.shape, old.shape, mask.shape)))
    learner.train_step(grpo_batch(), policy_version=0)
    assert seen and all(new == old == mask for new, old, mask in seen)
    assert LOG_RATIO_CLAMP > 0


def test_update_reference_and_with_learner() -> None:
    learner = grpo_learner(kl_coef=0.1)
    core = TrainerCore("t", learner, TrainerConfig(train_batch_size=4))
    assert learner.reference is not None
    with torch.no_grad():
        for param in learner.policy.model.parameters():
            param.add_(1.0)
    before = {name: p.detach().clone() for name, p in learner.reference.model.named_parameters()}
    assert not core.update_reference(0.0)
    assert core.update_reference(0.5)
    changed = any(not torch.equal(p, before[n]) for n, p in learner.reference.model.named_parameters())
    assert changed
    assert core.with_learner(lambda inner: inner is learner)
    no_reference = TrainerCore("t", grpo_learner(), TrainerConfig(train_batch_size=4))
    assert not no_reference.update_reference(0.5)


def test_shell_hooks_build_make_learner_trainer_core(monkeypatch: pytest.MonkeyPatch) -> None:
    import detached_rl.actors.trainer as trainer_actor

    # The shell stores version 0's chunks with `ray.put`, which would start a Ray cluster in this process.
    store = ObjectStore()
    monkeypatch.setattr(trainer_actor, "chunk_store", lambda *settings: store.put)
    built: list[Strategy] = []

    class Shell(GRPOTrainerShell):
        def make_learner(self, strategy: Strategy) -> GRPOLearner:
            built.append(strategy)
            return super().make_learner(strategy)

    shell = Shell("s", lambda: Actor(*tiny_causal_lm("llama", seed=0)), TrainerConfig(train_batch_size=4),
                  GRPOConfig(sampling=SAMPLING), namespace="test")
    core = shell.trainer_core(timeout=1.0)
    assert len(built) == 1 and core.learner.strategy is built[0]
    rebuilt = shell.build(naive_strategy())
    assert shell.trainer_core() is rebuilt is not core and len(built) == 2

    deferred = PPOTrainerShell("d", lambda: tiny_actor_critic(seed=0), TrainerConfig(), namespace="test",
                               world_size=2, strategy="ddp")
    with pytest.raises(RuntimeError, match="not set up"):
        deferred.trainer_core(timeout=0.01)


def test_a_step_row_appears_in_the_history_with_its_push_metrics_never_before() -> None:
    """`run`'s driver polls `metrics` while `fit` pushes: a step's row is added once its push's metrics are in
    it, so no reader ever sees it without them (it did, whenever a push took longer than a poll)."""
    core = ppo_core()
    core.push_experience(samples(8))
    core.weights.add_makers(["m"])
    seen_during_push: list[int] = []

    def send_update(update, makers):
        seen_during_push.append(len(core.history))  # the row of the step being pushed is not there yet
        return {maker: ApplyResult(applied=True, version=update.manifest.version) for maker in makers}

    core.fit(3, put=lambda chunk: chunk, send_update=send_update, update_steps=1)
    assert seen_during_push[-3:] == [0, 1, 2]
    assert [row.get("weight_sync/version") for row in core.history] == [1.0, 2.0, 3.0]
