"""A maker whose weights fall off its trainer's comes back by itself (no Ray): a trainer resumed from a
checkpoint brings the makers that registered before it loaded to the checkpoint's version, and a maker pushed
a forged far-future version registers again. Real tiny maker and trainer, a real MakerLoop and
ExperiencePusher; the Ray shells are stood in for by threads (one per actor concurrency
group) and in-process calls."""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.maker.loop import MakerLoop
from detached_rl.maker.pusher import ExperiencePusher
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from detached_rl.weights.push_queue import WeightPushQueue
from detached_rl.weights.update import WeightUpdate

from .helpers import (
    ObjectStore,
    arithmetic_prompts,
    naive_strategy,
    tiny_actor_critic,
    tiny_maker_models,
    wait_for,
)

SAMPLING = SamplingConfig(max_new_tokens=6)
# the trainer gives up after this long without data: the failure the tests guard against
BATCH_TIMEOUT_S = 30.0


def new_trainer(store: ObjectStore) -> TrainerCore:
    actor, critic = tiny_actor_critic(seed=0)
    learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(sampling=SAMPLING, kl_coef=0.01))
    config = TrainerConfig(train_batch_size=8, max_staleness=1, buffer_max_samples=16,
                           overlap_weight_push=True,
                           batch_timeout_s=BATCH_TIMEOUT_S, weight_push_timeout_s=30.0)
    trainer = TrainerCore("trainer_0", learner, config)
    trainer.weights.snapshot(store.put)  # version 0 of a new run, as the actor does when it starts
    return trainer


class Wiring:
    """One maker fed into whichever trainer holds the name "trainer_0", as the Ray shells wire them."""

    def __init__(self, **maker_config) -> None:
        self.store = ObjectStore()
        config = MakerConfig(**{"experience_batch_size": 4, "sampling": SAMPLING, "max_pushes_in_flight": 1,
                                "wait_for_ack": True, "weight_timeout_s": 120.0, "resync_after_s": 3.0,
                                **maker_config})
        self.maker = ExperienceMaker("maker_0", tiny_maker_models(seed=7),
                                     CyclingPrompts(arithmetic_prompts()),
                                     config, strategy=naive_strategy())
        self.trainer = new_trainer(self.store)
        self.registered_with: TrainerCore | None = None
        self.model_io = ThreadPoolExecutor(max_workers=1)  # the maker's model_io group: one update at a time
        self.pushes = ThreadPoolExecutor(max_workers=1)
        self.stop = threading.Event()
        self.loop = MakerLoop(self.maker, self.stop, resync=lambda: self.register(force=True))
        self.thread: threading.Thread | None = None

    def register(self, force: bool = False) -> None:
        """What `ExperienceMakerHolder._attach_trainers` does: register, take the offer as a reset."""
        trainer = self.trainer
        offered = trainer.weights.register("maker_0", self.maker.base_fingerprint, self.store.put)
        self.maker.subscriber.take_offered([offered], self.store.fetch, force)
        self.registered_with = trainer

    def submit(self, name: str, experiences: list) -> Future:
        if self.registered_with is not self.trainer:  # the trainer under that name is new: register first
            self.register()
        return self.pushes.submit(self.trainer.push_experience, experiences)

    def send(self, name: str, update: WeightUpdate) -> Future:
        return self.model_io.submit(self.maker.apply_weight_update, update, self.store.fetch,
                                    swap="at_safe_point")

    def start(self) -> None:
        pusher = ExperiencePusher(self.submit, ["trainer_0"], max_in_flight=1, should_stop=self.stop.is_set)
        self.thread = threading.Thread(target=self.loop.run, args=(pusher,), daemon=True)
        self.thread.start()

    def fit(self, steps: int, **kwargs) -> dict:
        return self.trainer.fit(steps, self.store.put, WeightPushQueue(self.send, timeout=30.0), **kwargs)

    def close(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=60)
        self.model_io.shutdown(wait=True)
        self.pushes.shutdown(wait=True)


@pytest.fixture
def wiring(request):
    wired = Wiring(**getattr(request, "param", {}))
    yield wired
    wired.close()


def resume_with_maker_registered_first(wiring: Wiring, checkpoints: str) -> dict:
    """Train 3 steps with checkpoints; replace the trainer by a new one; let the maker register with it (at
    its version 0) before the checkpoint loads; then resume and train 5 more steps."""
    wiring.register()
    wiring.start()
    wiring.fit(3, checkpoint_every=1, checkpoint_dir=checkpoints)
    wait_for(lambda: wiring.maker.policy_version == 3, "the maker to serve version 3")
    wiring.trainer = new_trainer(wiring.store)  # the trainer job restarted: a new process, a new run
    # registered_with is set once the registration's answer is applied (the trainer lists the maker before)
    wait_for(lambda: wiring.registered_with is wiring.trainer, "the maker to register with the new trainer")
    # it took the new run's only weights: those of before the checkpoint
    assert wiring.maker.policy_version == 0
    return wiring.fit(8, checkpoint_every=1, checkpoint_dir=checkpoints, resume_from=checkpoints)


# The maker waits longer for fresh weights than the trainer for data: only the trainer's
# own push can save the run.
@pytest.mark.parametrize("wiring", [{"resync_after_s": 2 * BATCH_TIMEOUT_S}], indirect=True)
def test_a_resumed_trainer_brings_a_maker_that_registered_before_the_checkpoint_loaded_to_its_version(
        wiring, tmp_path):
    summary = resume_with_maker_registered_first(wiring, str(tmp_path / "ckpt"))
    assert summary["policy_version"] == 8 and summary["steps"] == 5  # trained on: 5 steps after the resume
    assert wiring.trainer.state == "done"
    # The last update is acknowledged once staged, and swapped in when the maker's batch ends.
    wait_for(lambda: wiring.maker.policy_version == 8, "the maker to serve the last version")
    assert wiring.maker.receiver.trainer_run == wiring.trainer.run_id
    # Every batch trained after the resume was generated with the checkpoint's weights or newer.
    assert all(m.get("staleness/max", 0.0) <= 1.0 for m in wiring.trainer.history)


@pytest.mark.parametrize("wiring", [{"max_version_jump": 2}], indirect=True)
def test_a_maker_that_cannot_take_the_resumed_version_by_push_registers_again_and_trains_on(wiring, tmp_path):
    # A checkpoint 3 versions ahead is beyond the maker's max_version_jump: the trainer's push is refused, and
    # the maker registers with it again, which may move it anywhere.
    summary = resume_with_maker_registered_first(wiring, str(tmp_path / "ckpt"))
    assert summary["policy_version"] == 8 and wiring.trainer.state == "done"
    assert wiring.loop.resyncs >= 1
    wait_for(lambda: wiring.maker.policy_version == 8, "the maker to serve the last version")


def test_a_maker_pushed_a_forged_far_future_version_registers_again_and_follows_its_trainer(wiring):
    wiring.register()
    wiring.start()
    wiring.fit(2)
    real = wiring.trainer.weights.latest_update
    # A well-formed update with valid checksums, 999 versions ahead (under max_version_jump): it is taken.
    forged = WeightUpdate(dataclasses.replace(real.manifest, version=2 + 999), real.chunk_refs)
    result = wiring.send("maker_0", forged).result(timeout=30)
    assert result.version == 1001 and (result.applied or result.staged)
    # The trainer's next real update is older than what the maker serves; the maker sees it is off and
    # registers again, back on the trainer's versions, and the trainer trains on.
    summary = wiring.fit(6)
    assert summary["policy_version"] == 6 and wiring.trainer.state == "done"
    assert wiring.loop.resyncs >= 1
    wait_for(lambda: wiring.maker.policy_version == 6, "the maker to serve the last version")
