"""MakerLoop without Ray: a real ExperiencePusher whose in-process `submit` returns futures, and either a real
ExperienceMaker on a tiny model or, where only the loop's decisions are under test, a
maker that counts batches."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.core.replay_buffer import AppendResult, ReplayBuffer
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.maker.loop import MakerLoop
from detached_rl.maker.pusher import ExperiencePusher
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from detached_rl.weights.subscriber import update_to_apply
from detached_rl.weights.update import ApplyResult, build_weight_update

from .helpers import (
    ObjectStore,
    arithmetic_prompts,
    make_experience,
    naive_strategy,
    tiny_actor_critic,
    tiny_maker_models,
)

SAMPLING = SamplingConfig(max_new_tokens=6)
WAIT = 10.0  # upper bound for anything a test waits on; the loop's own waits are far shorter


@pytest.fixture
def executor():
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


class CountingMaker:
    """What the loop uses of an ExperienceMaker (config, version, synced, batches,
    state, last_error), no model."""

    def __init__(self, config: MakerConfig, version: int = 0, fail_at: int | None = None) -> None:
        self.config = config
        self.policy_version = version
        self.fail_at = fail_at  # the batch (1-based) whose generation raises
        self.versions: list[int] = []  # the policy version of each batch made
        self.last_error: str | None = None
        self.resync_reason: str | None = None

    @property
    def synced(self) -> bool:
        return self.policy_version >= 0

    @property
    def batches(self) -> int:
        return len(self.versions)

    def make_experience(self) -> list:
        if self.fail_at == self.batches + 1:
            raise RuntimeError("generation failed")
        self.versions.append(self.policy_version)
        return [make_experience(policy_version=self.policy_version, maker="m")
                for _ in range(self.config.experience_batch_size)]

    def state_dict(self) -> dict:
        return {"batches": self.batches}


class StandInTrainer:
    """A trainer's receiving side: a real ReplayBuffer judged at `version`; acks carry
    `oldest_useful` (None: none)."""

    def __init__(self, version: int = 0, max_staleness: int | None = None,
                 oldest_useful: int | None = None) -> None:
        self.buffer = ReplayBuffer(max_staleness=max_staleness)
        self.version = version
        self.oldest_useful = oldest_useful
        self.pushes = 0

    def push(self, experiences: list) -> AppendResult:
        self.pushes += 1
        result = self.buffer.append(experiences, current_version=self.version)
        return dataclasses.replace(result, oldest_useful_version=self.oldest_useful)


def pusher_to(executor, push, config: MakerConfig, stop: threading.Event) -> ExperiencePusher:
    """A real pusher to one trainer "t0" whose `push` runs on the executor (the in-process `submit`)."""
    return ExperiencePusher(lambda trainer, experiences: executor.submit(push, experiences), ["t0"],
                            max_in_flight=config.max_pushes_in_flight, push_timeout=config.push_timeout_s,
                            should_stop=stop.is_set)


def later(seconds: float, action) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def run_in_thread(loop: MakerLoop, pusher: ExperiencePusher, **kwargs) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["made"] = loop.run(pusher, **kwargs)
        except Exception as error:  # noqa: BLE001 - the test reads it
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- with a real maker and trainer


def real_pair(**maker_config) -> tuple[ExperienceMaker, TrainerCore, ObjectStore]:
    config = MakerConfig(**{"experience_batch_size": 4, "sampling": SAMPLING, **maker_config})
    maker = ExperienceMaker("maker_0", tiny_maker_models(seed=7), CyclingPrompts(arithmetic_prompts()),
                            config,
                            strategy=naive_strategy())
    actor, critic = tiny_actor_critic(seed=0)
    learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(sampling=SAMPLING, kl_coef=0.01))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    return maker, trainer, store


def test_a_real_maker_stops_after_num_batches_and_saves_its_state_after_every_batch(executor):
    maker, trainer, store = real_pair()
    maker.subscriber.take_offered([trainer.weights.register("maker_0")], store.fetch)
    saved: list[dict] = []
    stop = threading.Event()
    loop = MakerLoop(maker, stop, save_state=saved.append)
    pusher = pusher_to(executor, trainer.push_experience, maker.config, stop)
    assert loop.run(pusher, num_batches=3) == 3
    assert [state["batches"] for state in saved] == [1, 2, 3]
    assert saved[-1] == maker.state_dict() and saved[-1]["samples_made"] == 12
    stats = pusher.stats()
    assert stats["accepted"] == 12 and stats["in_flight"] == stats["waiting_retry"] == 0  # flushed at the end
    assert len(trainer.buffer) == 12 and loop.first_batch_version == 0 and maker.last_error is None


def test_a_real_maker_waits_for_its_first_weights_before_generating(executor):
    maker, trainer, store = real_pair()
    assert not maker.synced
    stop = threading.Event()
    loop = MakerLoop(maker, stop)
    timer = later(0.5, lambda: maker.subscriber.take_offered([trainer.weights.register("maker_0")],
                                                             store.fetch))
    start = time.monotonic()
    try:
        made = loop.run(pusher_to(executor, trainer.push_experience, maker.config, stop), num_batches=1)
    finally:
        timer.join()
    assert made == 1 and time.monotonic() - start >= 0.5
    assert {e.policy_version for e in trainer.buffer.experiences()} == {0} and loop.first_batch_version == 0


def test_take_offered_applies_only_an_update_worth_taking():
    maker, trainer, store = real_pair()
    assert maker.subscriber.take_offered([None, None], store.fetch) is None and not maker.synced
    update = trainer.weights.register("maker_0")
    assert maker.subscriber.take_offered([None, update], store.fetch).applied and maker.policy_version == 0
    assert maker.subscriber.take_offered([update], store.fetch) is None  # not newer, same trainer run


# ----------------------------------------------------------------------------- which offered update to take


def offered(version: int, run: str | None = "run-a"):
    metadata = {} if run is None else {"trainer_run": run}
    return build_weight_update({"actor": {"w": torch.zeros(2)}}, version, ObjectStore().put,
                               metadata=metadata)[0]


def test_update_to_apply_takes_the_newest_newer_update_or_one_of_another_trainer_run():
    older, newer = offered(1), offered(3)
    assert update_to_apply([older, None, newer], policy_version=2, trainer_run="run-a") is newer
    assert update_to_apply([older, newer], policy_version=3, trainer_run="run-a") is None
    assert update_to_apply([None], policy_version=-1, trainer_run=None) is None
    # A resumed trainer (a new run) restarts at an older version: the maker follows it anyway.
    resumed = offered(1, run="run-b")
    assert update_to_apply([resumed], policy_version=3, trainer_run="run-a") is resumed
    assert update_to_apply([offered(1, run=None)], policy_version=3, trainer_run="run-a") is None


# ----------------------------------------------------------------------------- the loop's decisions


def test_the_stop_event_ends_an_endless_run(executor):
    maker = CountingMaker(MakerConfig(experience_batch_size=2))
    trainer = StandInTrainer()
    stop = threading.Event()
    loop = MakerLoop(maker, stop)
    pusher = pusher_to(executor, trainer.push, maker.config, stop)
    thread, outcome = run_in_thread(loop, pusher)
    wait_until(lambda: trainer.pushes >= 3, "three pushes")
    stop.set()
    thread.join(WAIT)
    assert not thread.is_alive() and outcome["made"] >= 3 and outcome["made"] == maker.batches
    assert pusher.stats()["in_flight"] == 0


def test_a_run_without_num_batches_ends_at_once_when_the_trainers_finished(executor):
    maker = CountingMaker(MakerConfig())
    stop = threading.Event()
    loop = MakerLoop(maker, stop)
    connected = []
    made = loop.run(pusher_to(executor, StandInTrainer().push, maker.config, stop),
                    connect=lambda: connected.append(1),
                    trainers_finished=lambda: True)
    assert made == 0 and maker.batches == 0 and stop.is_set() and connected == [1]
    # With a number of batches asked for, finished trainers do not end the run.
    assert loop.run(pusher_to(executor, StandInTrainer().push, maker.config, stop), num_batches=2,
                    trainers_finished=lambda: True) == 2


# In these three, `wait_for_ack` makes each push acknowledged before the loop reads the trainer's bound
# (without it, the bound comes from the latest acknowledgement received, one batch later).


def test_it_waits_for_fresh_weights_when_the_trainer_needs_newer_samples(executor):
    maker = CountingMaker(MakerConfig(experience_batch_size=2, weight_timeout_s=WAIT, wait_for_ack=True))
    trainer = StandInTrainer(version=2, oldest_useful=2)
    stop = threading.Event()
    loop = MakerLoop(maker, stop)

    def deliver_version_2():
        maker.policy_version = 2

    timer = later(0.3, deliver_version_2)
    start = time.monotonic()
    made = loop.run(pusher_to(executor, trainer.push, maker.config, stop), num_batches=2)
    timer.join()
    assert made == 2 and maker.versions == [0, 2]  # the second batch waited for version 2
    assert time.monotonic() - start < WAIT


def test_the_wait_for_fresh_weights_gives_up_after_the_weight_timeout(executor):
    maker = CountingMaker(MakerConfig(experience_batch_size=2, weight_timeout_s=0.3, wait_for_ack=True))
    trainer = StandInTrainer(version=2, oldest_useful=2)
    stop = threading.Event()
    start = time.monotonic()
    made = MakerLoop(maker, stop).run(pusher_to(executor, trainer.push, maker.config, stop), num_batches=3)
    elapsed = time.monotonic() - start
    assert made == 3 and maker.versions == [0, 0, 0]  # no newer weights came: it went on with what it had
    assert 0.6 <= elapsed < WAIT  # waited the timeout before each batch after the first (none after the last)


def test_without_wait_for_fresh_weights_it_does_not_wait(executor):
    maker = CountingMaker(MakerConfig(experience_batch_size=2, weight_timeout_s=WAIT, wait_for_ack=True,
                                      wait_for_fresh_weights=False))
    trainer = StandInTrainer(version=2, oldest_useful=2)
    stop = threading.Event()
    start = time.monotonic()
    MakerLoop(maker, stop).run(pusher_to(executor, trainer.push, maker.config, stop), num_batches=2)
    assert maker.versions == [0, 0] and time.monotonic() - start < WAIT / 2


def test_wait_for_version_returns_early_on_stop():
    maker = CountingMaker(MakerConfig())
    stop = threading.Event()
    loop = MakerLoop(maker, stop)
    timer = later(0.2, stop.set)
    start = time.monotonic()
    assert not loop.wait_for_version(5, timeout=WAIT)
    timer.join()
    assert time.monotonic() - start < WAIT / 2


@pytest.mark.parametrize("wait_for_ack", [True, False])
def test_wait_for_ack_holds_the_next_batch_until_the_push_is_acknowledged(wait_for_ack):
    maker = CountingMaker(MakerConfig(experience_batch_size=2, max_pushes_in_flight=2,
                                      wait_for_ack=wait_for_ack))
    buffer = ReplayBuffer()
    pending: list[tuple[Future, list]] = []

    def submit(trainer: str, experiences: list) -> Future:  # answered when the test says so
        future: Future = Future()
        pending.append((future, experiences))
        return future

    stop = threading.Event()
    pusher = ExperiencePusher(submit, ["t0"], max_in_flight=2, push_timeout=WAIT, should_stop=stop.is_set)
    thread, outcome = run_in_thread(MakerLoop(maker, stop), pusher, num_batches=2)
    wait_until(lambda: len(pending) >= 1, "the first push")
    time.sleep(0.3)
    # Waiting for the ack, it has not made the second batch; otherwise it has (two pushes may be in flight).
    assert maker.batches == (1 if wait_for_ack else 2)
    future, experiences = pending[0]
    future.set_result(buffer.append(experiences, current_version=0))
    wait_until(lambda: len(pending) == 2, "the second push")
    future, experiences = pending[1]
    future.set_result(buffer.append(experiences, current_version=0))
    thread.join(WAIT)
    assert outcome["made"] == 2 and pusher.stats()["accepted"] == 4


def test_after_a_stale_drop_it_catches_up_with_the_trainers_version(executor):
    # The trainer is at version 3 and keeps nothing older: the maker's version-0 batch is dropped as stale
    # (acknowledged before the loop looks: `wait_for_ack`).
    maker = CountingMaker(MakerConfig(experience_batch_size=2, weight_timeout_s=WAIT, wait_for_ack=True,
                                      wait_for_fresh_weights=False))
    trainer = StandInTrainer(version=3, max_staleness=0)
    stop = threading.Event()

    def deliver_version_3():
        maker.policy_version = 3

    timer = later(0.3, deliver_version_3)
    pusher = pusher_to(executor, trainer.push, maker.config, stop)
    made = MakerLoop(maker, stop).run(pusher, num_batches=2)
    timer.join()
    assert made == 2 and maker.versions == [0, 3]  # waited for the trainer's version before the second batch
    stats = pusher.stats()
    assert stats["dropped_stale_by_trainer"] == 2 and stats["accepted"] == 2


def test_an_error_is_recorded_in_last_error_and_raised(executor):
    maker = CountingMaker(MakerConfig(experience_batch_size=2), fail_at=2)
    saved: list[dict] = []
    stop = threading.Event()
    loop = MakerLoop(maker, stop, save_state=saved.append)
    with pytest.raises(RuntimeError, match="generation failed"):
        loop.run(pusher_to(executor, StandInTrainer().push, maker.config, stop), num_batches=3)
    assert maker.last_error == "RuntimeError: generation failed"
    assert saved == [{"batches": 1}]  # the batch made before the failure was saved


def test_a_connect_failure_is_recorded_too(executor):
    maker = CountingMaker(MakerConfig())
    stop = threading.Event()

    def connect():
        raise TimeoutError("no actor named 'trainer_0'")

    with pytest.raises(TimeoutError):
        MakerLoop(maker, stop).run(pusher_to(executor, StandInTrainer().push, maker.config, stop),
                                   connect=connect)
    assert maker.last_error == "TimeoutError: no actor named 'trainer_0'" and maker.batches == 0


def test_a_run_that_registers_again_no_longer_shows_the_earlier_error(executor):
    maker = CountingMaker(MakerConfig(experience_batch_size=2))
    maker.last_error = "TimeoutError: no actor named 'trainer_0'"  # what the earlier run left
    stop = threading.Event()
    loop = MakerLoop(maker, stop)
    assert loop.run(pusher_to(executor, StandInTrainer().push, maker.config, stop), num_batches=1,
                    connect=lambda: None) == 1
    assert maker.last_error is None


def test_a_maker_registering_again_clears_the_trainers_error_about_it_and_no_other():
    _, trainer, store = real_pair()
    for name in ("maker_0", "maker_1", "maker_2"):
        trainer.weights.register(name)

    def send_update(update, makers):  # maker_1 and maker_2 died before this update reached them
        return {name: ApplyResult(True, update.manifest.version) if name == "maker_0"
                else ConnectionError(f"{name} died") for name in makers}

    trainer.weights.publish(store.put, send_update)
    assert trainer.last_error == ("weight update to maker_1: maker_1 died; "
                                  "weight update to maker_2: maker_2 died")
    trainer.weights.register("maker_1")  # its replacement registers under the same name
    assert trainer.last_error == "weight update to maker_2: maker_2 died"
    trainer.weights.register("maker_2")
    assert trainer.last_error is None and trainer.status()["last_error"] is None
    # Another error since (the trainer's own) stays, whoever registers.
    trainer.weights.publish(store.put, send_update)
    trainer.last_error = "RuntimeError: the step failed"
    trainer.weights.register("maker_1")
    assert trainer.last_error == "RuntimeError: the step failed"


def test_it_waits_while_not_synced_and_a_stop_ends_that_wait(executor):
    maker = CountingMaker(MakerConfig(experience_batch_size=2), version=-1)
    stop = threading.Event()
    trainer = StandInTrainer()
    thread, outcome = run_in_thread(MakerLoop(maker, stop),
                                    pusher_to(executor, trainer.push, maker.config, stop),
                                    num_batches=1)
    time.sleep(0.3)
    assert thread.is_alive() and maker.batches == 0 and trainer.pushes == 0
    stop.set()
    thread.join(WAIT)
    assert outcome["made"] == 0


def test_num_batches_must_not_be_negative(executor):
    maker = CountingMaker(MakerConfig())
    stop = threading.Event()
    with pytest.raises(ValueError, match="num_batches"):
        MakerLoop(maker, stop).run(pusher_to(executor, StandInTrainer().push, maker.config, stop),
                                   num_batches=-1)
