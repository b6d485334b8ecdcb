"""Maker and trainer logic wired together in one process (no Ray): versions, weight sync, refusals."""

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from detached_rl import Experience
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.core.replay_buffer import RejectedPushError
from detached_rl.core.staleness import oldest_useful_version
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from detached_rl.weights.push_queue import WeightPushQueue
from detached_rl.weights.update import WeightUpdateError, state_fingerprint

from .helpers import (
    ObjectStore,
    arithmetic_prompts,
    model_device,
    naive_strategy,
    tiny_actor_critic,
    tiny_maker_models,
)

SAMPLING = SamplingConfig(max_new_tokens=6)


def make_pair(batch_size=4, group_size=1, record=True, maker_seed=7, **trainer_kwargs):
    maker = ExperienceMaker(
        "maker_0", tiny_maker_models(seed=maker_seed), CyclingPrompts(arithmetic_prompts()),
        MakerConfig(experience_batch_size=batch_size, group_size=group_size, sampling=SAMPLING,
                    record_weights_fingerprint=record),
        strategy=naive_strategy(),
    )
    actor, critic = tiny_actor_critic(seed=0)
    learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(sampling=SAMPLING, kl_coef=0.01))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(**{"train_batch_size": 8, **trainer_kwargs}))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    return maker, trainer, store


def done(result=None, error=None):
    """A future already settled, as a fake transport's acknowledgement."""
    future = Future()
    future.set_result(result) if error is None else future.set_exception(error)
    return future


def deliver(maker, store, gone=()):
    """The push queue over a fake `send`: `maker` applies each update at once; makers in `gone` are no
    actors."""

    def send(name, update):
        if name in gone:
            raise LookupError(f"no maker named {name!r}")
        return done(maker.apply_weight_update(update, store.fetch))

    return WeightPushQueue(send, timeout=60)


def nowhere():
    """A push queue whose makers acknowledge without doing anything."""
    return WeightPushQueue(lambda name, update: done(), timeout=60)


def test_maker_generates_only_after_receiving_the_trainer_weights():
    maker, trainer, store = make_pair()
    assert maker.policy_version == -1 and not maker.synced
    with pytest.raises(RuntimeError, match="no complete weights"):
        maker.make_experience()
    # The maker was built from another seed: the first update makes it the trainer's policy.
    assert maker.receiver.fingerprint != state_fingerprint(trainer.weights.synced_state())
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    assert maker.synced and maker.policy_version == 0
    assert maker.receiver.fingerprint == state_fingerprint(trainer.weights.synced_state())
    experiences = maker.make_experience()
    assert len(experiences) == 4 and all(e.policy_version == 0 and e.maker == "maker_0" for e in experiences)
    for e in experiences:
        assert e.values is not None and e.ref_log_probs is not None and e.values.shape == e.log_probs.shape
        assert e.info["weights_fingerprint"] == maker.receiver.fingerprint


def test_train_sync_loop_keeps_maker_and_trainer_in_step():
    maker, trainer, store = make_pair()
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    for step in range(3):
        for _ in range(2):
            assert trainer.push_experience(maker.make_experience()).accepted == 4
        metrics = trainer.train_step()
        assert metrics["policy_version"] == step + 1 and metrics["samples"] == 8
        metrics.update(trainer.weights.publish(store.put, deliver(maker, store)))
        assert metrics["weight_sync/makers_updated"] == 1 and metrics["weight_sync/bytes"] > 0
        assert maker.policy_version == trainer.policy_version == step + 1
        assert maker.receiver.fingerprint == state_fingerprint(trainer.weights.synced_state())
    stats = trainer.buffer.stats()
    assert stats["received"] == 24 and stats["sampled"] == 24 and stats["accounting_ok"]


def test_generation_never_mixes_two_weight_versions():
    """Weights change continuously while the maker generates; each sample's weights match its version."""
    maker, trainer, store = make_pair(batch_size=2)
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    fingerprints = {0: state_fingerprint(trainer.weights.synced_state())}
    weights = {0: {k: v.clone() for k, v in trainer.learner.actor.model.state_dict().items()}}
    done = threading.Event()

    def keep_updating():
        for version in range(1, 30):
            with trainer.weights_lock:
                for p in trainer.learner.actor.parameters():
                    p.data.add_(0.001 * version)
                trainer.policy_version = version
            fingerprints[version] = state_fingerprint(trainer.weights.synced_state())
            weights[version] = {k: v.clone() for k, v in trainer.learner.actor.model.state_dict().items()}
            update, _ = trainer.weights.snapshot(store.put)
            maker.apply_weight_update(update, store.fetch)
        done.set()

    updater = threading.Thread(target=keep_updating)
    updater.start()
    experiences = []
    while not done.is_set():
        experiences += maker.make_experience()
    updater.join()
    versions = {e.policy_version for e in experiences}
    assert len(versions) > 2, "the test must see several versions"
    for e in experiences:
        assert e.info["weights_fingerprint"] == fingerprints[e.policy_version]
    # The behaviour log-probs must be those of exactly the tagged version's weights.
    scratch, _ = tiny_actor_critic(seed=0)
    for e in experiences:
        scratch.model.load_state_dict(weights[e.policy_version])
        sequence = torch.cat([e.prompt_ids, e.response_ids])[None].to(model_device(scratch))
        with torch.no_grad():
            recomputed = scratch.log_probs(sequence, torch.ones_like(sequence),
                                           torch.ones(1, e.response_length, device=sequence.device),
                                           SAMPLING)[0].cpu()
        assert torch.allclose(recomputed, e.log_probs, atol=1e-4), e.policy_version


def test_fit_runs_against_a_producing_maker_thread():
    maker, trainer, store = make_pair()
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    stop = threading.Event()

    def produce():
        while not stop.is_set():
            experiences = maker.make_experience()
            while not stop.is_set() and trainer.push_experience(experiences).full:
                stop.wait(0.01)

    producer = threading.Thread(target=produce)
    producer.start()
    stopped = []
    try:
        summary = trainer.fit(3, store.put, deliver(maker, store), update_steps=2, stop_makers=stopped.extend)
    finally:
        stop.set()
        producer.join()
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    # every 2 steps + the end
    assert [m.get("weight_sync/version") for m in trainer.history] == [None, 2.0, 3.0]
    assert maker.policy_version == 3 and stopped == ["maker_0"]
    assert trainer.status()["state"] == "done"


def test_overlapped_weight_push_is_acknowledged_by_the_end_of_fit():
    maker, trainer, store = make_pair(overlap_weight_push=True)
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    model_io = ThreadPoolExecutor(max_workers=1)  # the maker actor's model_io thread
    sent = []

    def send(name, update):
        sent.append(update.manifest.version)
        return model_io.submit(maker.apply_weight_update, update, store.fetch, swap="at_safe_point")

    for _ in range(6):  # 3 steps of 8 samples, pushes of 4
        trainer.push_experience(maker.make_experience())
    summary = trainer.fit(3, store.put, WeightPushQueue(send, timeout=60))
    model_io.shutdown()
    # Each version sent at most once, in order (one may be superseded while another is in flight); the last
    # one is acknowledged, and swapped in (the maker is idle), before fit returns and makers are stopped.
    assert sent == sorted(set(sent)) and sent[-1] == 3
    assert summary["policy_version"] == 3 and maker.policy_version == 3
    assert trainer.status()["weight_push"]["acked"] == {"maker_0": 3}


def test_malformed_push_is_refused_whole_and_changes_nothing():
    maker, trainer, store = make_pair()
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    good = maker.make_experience()
    trainer.push_experience(good[:2])
    before = trainer.buffer.stats()
    bad = maker.make_experience()
    bad[1].log_probs = bad[1].log_probs[:-1]
    with pytest.raises(RejectedPushError, match="log_probs") as info:
        trainer.push_experience(bad)
    assert info.value.field == "log_probs"
    after = trainer.buffer.stats()
    assert after["size"] == before["size"] == 2 and after["received"] == before["received"]
    future = maker.make_experience()
    future[0].policy_version = 5
    with pytest.raises(RejectedPushError, match="policy_version"):
        trainer.push_experience(future)
    too_long = Experience(torch.tensor([1]), torch.tensor([10_000]), torch.tensor([-1.0]), torch.tensor(0.0))
    with pytest.raises(RejectedPushError, match="vocab size"):
        trainer.push_experience([too_long])


def test_bad_weight_update_leaves_the_maker_serving_its_version():
    maker, trainer, store = make_pair()
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    fingerprint = maker.receiver.fingerprint
    trainer.policy_version = 1
    update, _ = trainer.weights.snapshot(store.put)
    chunk = store.objects[update.chunk_refs[0]]
    key = next(iter(chunk))
    chunk[key] = chunk[key].clone()
    chunk[key].view(-1)[0] += 1.0
    with pytest.raises(WeightUpdateError, match="checksum"):
        maker.apply_weight_update(update, store.fetch)
    assert maker.policy_version == 0 and maker.receiver.fingerprint == fingerprint
    assert "checksum" in maker.status()["last_error"]
    assert len(maker.make_experience()) == 4  # still serving version 0


def test_groups_are_tagged_and_configs_are_validated():
    maker, trainer, store = make_pair(batch_size=2, group_size=3)
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    experiences = maker.make_experience()
    assert len(experiences) == 6
    groups = [e.group_id for e in experiences]
    assert groups[0] == groups[1] == groups[2] != groups[3] == groups[4] == groups[5]
    assert torch.equal(experiences[0].prompt_ids, experiences[2].prompt_ids)
    with pytest.raises(ValueError, match="MakerConfig.push_policy"):
        MakerConfig(push_policy="random")
    with pytest.raises(ValueError, match="MakerConfig.weight_cast_dtype"):
        MakerConfig(weight_cast_dtype="float99")
    with pytest.raises(ValueError, match="TrainerConfig.train_batch_size"):
        TrainerConfig(train_batch_size=10, buffer_max_samples=5)


def test_waiting_for_a_batch_times_out_with_a_clear_error():
    _, trainer, _ = make_pair(batch_timeout_s=0.3)
    with pytest.raises(TimeoutError, match="trainer 'trainer_0'.*no full batch of 8"):
        trainer.train_step()


def test_maker_state_resumes_the_prompt_cursor(tmp_path):
    from detached_rl.core.checkpoint import load_state, save_atomic

    maker, trainer, store = make_pair()
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    maker.make_experience()
    save_atomic(maker.state_dict(), tmp_path / "maker")
    expected = [item.prompt for item in maker.prompts.next_batch(6)]
    again, _, _ = make_pair()
    again.load_state_dict(load_state(tmp_path / "maker"))
    assert [item.prompt for item in again.prompts.next_batch(6)] == expected
    assert again.batches == 1 and again.samples_made == 4


def test_stop_while_waiting_for_data_ends_the_run_cleanly_and_bad_arguments_fail_it():
    _, trainer, store = make_pair()
    stopped = []
    threading.Timer(0.3, trainer.stop).start()
    summary = trainer.fit(5, store.put, nowhere(), stop_makers=stopped.extend)
    assert trainer.state == "stopped" and summary["policy_version"] == 0 and trainer.last_error is None
    with pytest.raises(ValueError, match="update_steps"):
        trainer.fit(5, store.put, nowhere(), update_steps=0)
    assert trainer.state == "failed" and "update_steps" in trainer.last_error


def test_gone_makers_are_forgotten_and_a_resume_keeps_live_pushes(tmp_path):
    maker, trainer, store = make_pair()
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    trainer.weights.register("maker_gone")
    for _ in range(2):
        trainer.push_experience(maker.make_experience())
    trainer.train_step()
    trainer.weights.publish(store.put, deliver(maker, store, gone={"maker_gone"}))
    assert trainer.weights.makers == {"maker_0"} and "no maker named 'maker_gone'" in trainer.last_error
    trainer.save_checkpoint(tmp_path / "ckpt")
    live = maker.make_experience()
    trainer.push_experience(live)  # acknowledged after the checkpoint, before the resume
    trainer.load_checkpoint(tmp_path / "ckpt", store.put)
    assert {e.id for e in live} <= {e.id for e in trainer.buffer.experiences()}
    assert trainer.buffer.stats()["accounting_ok"]


def test_a_plain_send_update_is_wrapped_into_the_push_queue_once():
    maker, trainer, store = make_pair()
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    calls = []

    def send_update(update, makers):  # what a layer may still pass: one call per maker, through the queue
        calls.append(list(makers))
        return {name: maker.apply_weight_update(update, store.fetch) for name in makers}

    for _ in range(2):
        for _ in range(2):  # a step's 8 samples
            trainer.push_experience(maker.make_experience())
        trainer.train_step()
        metrics = trainer.weights.publish(store.put, send_update)
        assert metrics["weight_sync/makers_updated"] == 1 and maker.policy_version == trainer.policy_version
    queue = trainer.weights.queue
    assert calls == [["maker_0"], ["maker_0"]] and queue is not None and queue.sent == 2
    assert trainer.status()["weight_push"]["acked"] == {"maker_0": 2}


def test_evaluate_grades_greedy_answers_and_leaves_counters_and_cursor_alone():
    maker, trainer, store = make_pair()
    with pytest.raises(RuntimeError, match="no complete weights"):
        maker.evaluate(arithmetic_prompts(2))
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    cursor = maker.prompts.state_dict()
    problems = arithmetic_prompts(5)
    first, second = maker.evaluate(problems, batch_size=2), maker.evaluate(problems, batch_size=5)
    assert len(first) == 5 and [r["prompt"] for r in first] == [p.prompt for p in problems]
    assert {r["policy_version"] for r in first} == {0}
    # greedy: batching does not matter
    assert [r["response"] for r in first] == [r["response"] for r in second]
    assert all({"reward", "response", "response_length"} <= set(r) and 0 <= r["reward"] <= 1 for r in first)
    assert maker.samples_made == 0 and maker.prompts.state_dict() == cursor


def test_evaluate_with_min_version_grades_once_that_version_is_served():
    """A held-out point for step N waits for version N (swapped in meanwhile by another thread), and one whose
    version never comes grades with what is served after `weight_timeout_s`."""
    import threading

    maker, trainer, store = make_pair()
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    for _ in range(2):
        trainer.push_experience(maker.make_experience())
    trainer.train_step()
    update, _ = trainer.weights.snapshot(store.put)
    swap = threading.Timer(0.3, lambda: maker.apply_weight_update(update, store.fetch))
    swap.start()
    graded = maker.evaluate(arithmetic_prompts(2), min_version=1)
    swap.join()
    assert {r["policy_version"] for r in graded} == {1}
    maker.config.weight_timeout_s = 0.2
    assert {r["policy_version"] for r in maker.evaluate(arithmetic_prompts(2), min_version=5)} == {1}


def test_oldest_useful_version_counts_the_step_under_way_and_the_queue():
    # Trainer at v3 mid-step with one full batch queued: the next batch is trained at v5.
    assert oldest_useful_version(3, True, 8, 8, max_staleness=1) == 4
    assert oldest_useful_version(3, False, 8, 8, max_staleness=1) == 3
    assert oldest_useful_version(3, False, 7, 8, max_staleness=1) == 2  # a partial batch trains with ours
    assert oldest_useful_version(3, True, 8, 8, max_staleness=4) == 1
    assert oldest_useful_version(0, False, 0, 8, max_staleness=2) == 0
    # Weights go out every 2 steps: v5 is never pushed, so waiting for it would never end; v4 is.
    assert oldest_useful_version(3, True, 8, 8, max_staleness=0, update_steps=2) == 4
    assert oldest_useful_version(4, True, 8, 8, max_staleness=0, update_steps=2) == 4
    # Queued samples may go stale and be dropped, so no maker waits beyond the step under way.
    assert oldest_useful_version(3, True, 16, 8, max_staleness=0) == 4


def test_a_maker_waiting_for_the_acknowledged_version_never_generates_stale_batches():
    maker, trainer, store = make_pair(max_staleness=1, buffer_max_samples=16)
    trainer.state = "done"
    assert trainer.push_experience([]).oldest_useful_version is None  # after fit: no bound to wait for
    trainer.state = "idle"
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    train_step = trainer.learner.train_step

    # the maker outruns the trainer, so the queue fills and the bound binds
    def slow_train_step(*args, **kwargs):
        time.sleep(0.1)
        return train_step(*args, **kwargs)

    trainer.learner.train_step = slow_train_step
    stop, waits = threading.Event(), []

    def produce():
        needed = None
        while not stop.is_set():
            if needed is not None and maker.policy_version < needed:
                waits.append(needed)
                while maker.policy_version < needed and not stop.is_set():
                    stop.wait(0.005)
            experiences = maker.make_experience()
            result = trainer.push_experience(experiences)
            while not stop.is_set() and result.full:
                stop.wait(0.01)
                result = trainer.push_experience(experiences)
            needed = result.oldest_useful_version

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        trainer.fit(6, store.put, deliver(maker, store))
    finally:
        stop.set()
        producer.join()
    stats = trainer.buffer.stats()
    assert stats["dropped"].get("stale", 0) == 0 and stats["accounting_ok"]
    assert waits, "the producer never had to wait: the test did not exercise the bound"
    assert all(0.0 <= m.get("staleness/max", 0.0) <= 1.0 for m in trainer.history)


def test_with_top_k_the_reference_scores_every_sampled_token_and_trains():
    """With top-k, the maker's reference (the initial policy) scores the temperature-scaled full distribution:
    a sampled token outside its own top-k still has a finite log-prob, and the PPO
    step trains on finite numbers."""
    sampling = SamplingConfig(max_new_tokens=6, top_k=2)
    maker = ExperienceMaker("maker_0", tiny_maker_models(seed=7), CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=4, sampling=sampling),
                            strategy=naive_strategy())
    actor, critic = tiny_actor_critic(seed=0)
    learner = PPOLearner(actor, critic, naive_strategy(), PPOConfig(sampling=sampling, kl_coef=0.1))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    # the policy now differs from ref
    maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
    experiences = maker.make_experience() + maker.make_experience()
    assert all(bool(torch.isfinite(e.ref_log_probs).all()) for e in experiences)
    assert all(math.isfinite(e.info["kl"]) for e in experiences)
    assert trainer.push_experience(experiences).accepted == 8
    metrics = trainer.train_step()
    assert all(math.isfinite(value) for value in metrics.values() if isinstance(value, float))
    assert all(torch.isfinite(p).all() for p in learner.actor.parameters())


TRUNCATED = SamplingConfig(max_new_tokens=6, temperature=0.8, top_k=12, top_p=0.9, min_p=0.05)


@pytest.mark.parametrize("sampling", [SAMPLING, TRUNCATED], ids=["full", "top-k-top-p-min-p"])
def test_the_ratio_of_on_policy_samples_is_one_whatever_truncates_the_sampling(sampling):
    """Behaviour log-probs are those of the distribution sampled (renormalised over the kept tokens) and the
    trainer recomputes that same distribution: on the first pass over fresh samples the PPO ratio new / old
    (old = the behaviour log-probs: no recompute ran) is 1 at every token."""
    def ratio_metrics(trainer_sampling):
        config = MakerConfig(experience_batch_size=4, sampling=sampling)
        prompts = CyclingPrompts(arithmetic_prompts())
        maker = ExperienceMaker("maker_0", tiny_maker_models(seed=0), prompts, config,
                                strategy=naive_strategy())
        actor, critic = tiny_actor_critic(seed=0)
        ppo = PPOConfig(sampling=trainer_sampling, kl_coef=0.01)
        learner = PPOLearner(actor, critic, naive_strategy(), ppo)
        trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8))
        store = ObjectStore()
        trainer.weights.snapshot(store.put)
        maker.apply_weight_update(trainer.weights.register("maker_0"), store.fetch)
        torch.manual_seed(0)
        for _ in range(2):
            trainer.push_experience(maker.make_experience())
        metrics = trainer.train_step()
        assert not any(key.startswith("mismatch/") for key in metrics)  # old = behaviour: no recompute
        return metrics

    metrics = ratio_metrics(sampling)
    assert metrics["val/ratio"] == pytest.approx(1.0, abs=1e-6) and metrics["policy/clipfrac_avg"] == 0
    if sampling.truncates:  # scored over the full vocabulary instead, the ratio moves: the check can fail
        full = SamplingConfig(max_new_tokens=6, temperature=sampling.temperature)
        assert abs(ratio_metrics(full)["val/ratio"] - 1.0) > 1e-3
