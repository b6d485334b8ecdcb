"""The named detached actors on a real local Ray cluster (tiny random models; with `--device cuda` trainers
and makers ask Ray for shares of a GPU, see `helpers.gpu_options`)."""

import threading
import time

import pytest
import torch

from detached_rl import Experience
from detached_rl.actors.maker import ExperienceMakerHolder
from detached_rl.actors.trainer import DetachedPPOTrainer
from detached_rl.actors.trainer_group import start_trainer_group, stop_trainer_group
from detached_rl.actors.transport import attach
from detached_rl.algorithms.ppo import PPOConfig
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.core.replay_buffer import RejectedPushError
from detached_rl.maker.experience_maker import MakerConfig
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig, TrainerGroupConfig
from detached_rl.weights.ray_wire import put_chunk
from detached_rl.weights.update import WeightUpdateError, build_weight_update

from .helpers import (
    arithmetic_prompts,
    gpu_options,
    group_gpus_per_rank,
    tiny_actor_critic,
    tiny_maker_models,
)

pytestmark = pytest.mark.ray

NAMESPACE = "detached_rl_tests"
SAMPLING = SamplingConfig(max_new_tokens=6)
TIMEOUT = 180


def in_namespace(namespace):
    """Actor options and arguments placing it in `namespace`; None: neither (it
    follows the driver's namespace)."""
    return {} if namespace is None else {"namespace": namespace}


def new_maker(name, trainers, namespace=NAMESPACE, **config):
    config = {"experience_batch_size": 4, "sampling": SAMPLING, **config}
    return ExperienceMakerHolder.options(name=name, **in_namespace(namespace), **gpu_options("maker")).remote(
        name, trainers, tiny_maker_models, CyclingPrompts(arithmetic_prompts()), MakerConfig(**config),
        **in_namespace(namespace),
    )


def new_trainer(name, namespace=NAMESPACE, **config):
    config = {"train_batch_size": 8, **config}
    return DetachedPPOTrainer.options(name=name, **in_namespace(namespace), **gpu_options("trainer")).remote(
        name, tiny_actor_critic, TrainerConfig(**config), PPOConfig(sampling=SAMPLING, kl_coef=0.01),
        **in_namespace(namespace),
    )


def wait_until_registered(trainers, makers, timeout=TIMEOUT):
    """Block until every trainer knows every maker (makers register when their `run` starts)."""
    import ray

    deadline = time.monotonic() + timeout
    while not all(makers <= set(ray.get(t.status.remote())["makers"]) for t in trainers):
        assert time.monotonic() < deadline, "makers did not register with the trainers in time"
        time.sleep(0.2)


def kill(*handles):
    import ray

    for handle in handles:
        ray.kill(handle)


def test_two_makers_feed_a_two_rank_ddp_trainer(ray_cluster):
    ray = ray_cluster
    trainers = start_trainer_group(
        "trainer", 2, tiny_actor_critic,
        TrainerConfig(train_batch_size=8, record_weights_fingerprint=True),
        PPOConfig(sampling=SAMPLING, kl_coef=0.01), namespace=NAMESPACE, strategy="ddp",
        group=TrainerGroupConfig(strategy="ddp", world_size=2, num_gpus_per_rank=group_gpus_per_rank(2)),
    )
    names = ["trainer_0", "trainer_1"]
    makers = [new_maker(f"maker_{i}", names, record_weights_fingerprint=True) for i in range(2)]
    try:
        runs = [m.run.remote() for m in makers]
        wait_until_registered(trainers, {"maker_0", "maker_1"})  # actors start one by one on 2 cores
        summaries = ray.get([t.fit.remote(3, update_steps=1) for t in trainers], timeout=TIMEOUT)
        maker_status = ray.get(runs, timeout=TIMEOUT)  # the trainers stop their makers at the end
        assert [s["policy_version"] for s in summaries] == [3, 3]
        # Both ranks hold identical weights after every step (recorded at each sync).
        fingerprints = ray.get([t.update_fingerprints.remote() for t in trainers])
        assert sorted(fingerprints[0]) == [0, 1, 2, 3] and fingerprints[0] == fingerprints[1]
        assert len(set(fingerprints[0].values())) == 4  # and the weights did change each step
        # Every maker ends on the last version, with exactly the trainers' weights.
        assert [s["policy_version"] for s in maker_status] == [3, 3]
        # Each rank pushed weights to its share of the makers.
        syncs = [ray.get(t.metrics.remote())[-1] for t in trainers]
        assert [m["weight_sync/makers_updated"] for m in syncs] == [1.0, 1.0]
        # Each acknowledged the last version on receipt; nothing was left in flight, waiting, or behind.
        pushes = [ray.get(t.status.remote()) for t in trainers]
        assert [p["weight_push"]["acked"] for p in pushes] == [{"maker_0": 3}, {"maker_1": 3}]
        assert all(not p["weight_push"]["in_flight"] and not p["weight_push"]["waiting"]
                   and not p["makers_behind"]
                   for p in pushes)
        assert all(s["weight_updates"]["pending_version"] is None for s in maker_status)
        # Experience from both makers reached both trainers, and the counts add up.
        stats = ray.get([t.buffer_stats.remote() for t in trainers])
        for s in stats:
            assert s["accounting_ok"] and set(s["per_maker"]) == {"maker_0", "maker_1"}
        received = sum(s["received"] + s["duplicates"] for s in stats)
        pushed = sum(m["push"]["accepted"] + m["push"]["duplicates"] + m["push"]["dropped_stale_by_trainer"]
                     for m in maker_status)
        assert received == pushed == sum(m["samples_made"] for m in maker_status)
        assert sum(s["sampled"] for s in stats) == 2 * 3 * 8
        # No sample was generated on mixed weights: its fingerprint is that of its version.
        for trainer, s in zip(trainers, stats, strict=True):
            for sample in ray.get(trainer.buffer_peek.remote(count=s["size"])):
                assert sample["info"]["weights_fingerprint"] == fingerprints[0][sample["policy_version"]]
    finally:
        kill(*makers)
        stop_trainer_group("trainer", 2, NAMESPACE)


def test_a_long_compute_call_does_not_delay_buffer_calls(ray_cluster):
    ray = ray_cluster
    # Nothing to train on: `fit` waits for a full batch of 8 inside the compute group (up to batch_timeout_s).
    trainer = new_trainer("busy_trainer", batch_timeout_s=60)
    try:
        ray.get(trainer.buffer_length.remote(), timeout=TIMEOUT)  # constructed
        busy = trainer.fit.remote(1)
        deadline = time.monotonic() + TIMEOUT
        while ray.get(trainer.status.remote(), timeout=10)["state"] != "training":
            assert time.monotonic() < deadline, "fit did not start"
            time.sleep(0.1)
        time.sleep(0.5)
        experience = Experience(torch.tensor([5, 6]), torch.tensor([7, 8]), torch.tensor([-0.5, -0.5]),
                                torch.tensor(1.0), values=torch.zeros(2),
                                ref_log_probs=torch.tensor([-0.4, -0.6]))
        start = time.perf_counter()
        result = ray.get(trainer.push_experience.remote([experience]), timeout=10)
        length = ray.get(trainer.buffer_length.remote(), timeout=10)
        status = ray.get(trainer.status.remote(), timeout=10)
        elapsed = time.perf_counter() - start
        assert result.accepted == 1 and length == 1 and status["buffer_size"] == 1
        assert elapsed < 2.0, f"buffer calls waited {elapsed:.1f} s behind a compute call"
        assert not ray.wait([busy], timeout=0)[0] and status["state"] == "training"  # fit was still waiting
        ray.get(trainer.stop.remote(), timeout=10)
        assert ray.get(busy, timeout=TIMEOUT)["policy_version"] == 0  # stopped while it waited for a batch
    finally:
        kill(trainer)


def test_malformed_experience_and_weights_are_refused_remotely(ray_cluster):
    ray = ray_cluster
    trainer = new_trainer("strict_trainer")
    maker = new_maker("strict_maker", ["strict_trainer"])
    try:
        bad = Experience(torch.tensor([5, 6]), torch.tensor([7, 8]), torch.tensor([-0.5, float("nan")]),
                         torch.tensor(1.0))
        with pytest.raises(RejectedPushError, match="log_probs"):
            ray.get(trainer.push_experience.remote([bad]), timeout=TIMEOUT)
        assert ray.get(trainer.buffer_stats.remote())["received"] == 0
        ray.get(maker.run.remote(num_batches=1), timeout=TIMEOUT)
        before = ray.get(maker.status.remote())
        assert before["policy_version"] == 0 and before["synced"]
        # this driver sends host tensors, as trainers do
        actor, critic = tiny_actor_critic(seed=0, device="cpu")
        state = {"actor": actor.model.state_dict(), "critic": critic.state_dict()}
        state["actor"] = {k: (v + 1 if k.endswith("q_proj.weight") else v) for k, v in state["actor"].items()}
        del state["critic"]["head.bias"]
        update, _ = build_weight_update(state, 5, put_chunk, chunk_bytes=50_000,
                                        # from the run it follows
                                        metadata={"trainer_run": before["trainer_run"]})
        with pytest.raises(WeightUpdateError, match="head.bias"):
            ray.get(maker.apply_weight_update.remote(update), timeout=TIMEOUT)
        after = ray.get(maker.status.remote())
        assert after["policy_version"] == 0 and "head.bias" in after["last_error"]
    finally:
        kill(trainer, maker)


def test_attach_waits_for_a_late_actor_and_times_out_with_its_name(ray_cluster):
    with pytest.raises(TimeoutError, match="'nobody'.*detached_rl_tests"):
        attach("nobody", NAMESPACE, timeout=0.5)
    created = []
    timer = threading.Timer(1.0, lambda: created.append(new_trainer("late_trainer")))
    timer.start()
    try:
        handle = attach("late_trainer", NAMESPACE, timeout=60)
        assert ray_cluster.get(handle.buffer_length.remote(), timeout=TIMEOUT) == 0
    finally:
        timer.join()
        kill(*created)


def test_maker_first_then_trainer_and_a_late_maker_starts_from_current_weights(ray_cluster):
    """Given no namespace, the actors meet in the driver's (`ray.init(namespace=NAMESPACE)`), not in
    `detached_rl`:
    the makers find the trainer, it pushes to and stops them there, and the driver's `attach` finds it too."""
    ray = ray_cluster
    assert ray.get_runtime_context().namespace == NAMESPACE
    maker = new_maker("early_maker", ["solo_trainer"], namespace=None)
    run = maker.run.remote()  # waits for the trainer by name
    time.sleep(1.0)
    trainer = new_trainer("solo_trainer", namespace=None)
    late = None
    try:
        assert ray.get(attach("solo_trainer", timeout=60).buffer_length.remote(), timeout=TIMEOUT) >= 0
        ray.get(trainer.fit.remote(2), timeout=TIMEOUT)
        ray.get(run, timeout=TIMEOUT)
        late = new_maker("late_maker", ["solo_trainer"], namespace=None)
        status = ray.get(late.run.remote(num_batches=1), timeout=TIMEOUT)
        assert status["policy_version"] == 2  # received the trainer's current weights before generating
        samples = ray.get(trainer.buffer_peek.remote(count=50, maker="late_maker"))
        assert len(samples) == 4 and {s["policy_version"] for s in samples} == {2}
        assert all(s["response_text"] is not None for s in samples)
    finally:
        kill(maker, trainer, *([late] if late else []))


def test_lora_trainer_sends_lora_only_updates_to_a_merging_maker(ray_cluster):
    import functools

    from .helpers import lora_actor_critic, lora_maker_models

    ray = ray_cluster
    trainer = DetachedPPOTrainer.options(name="lora_trainer", namespace=NAMESPACE,
                                         **gpu_options("trainer")).remote(
        "lora_trainer", functools.partial(lora_actor_critic, "peft", 0),
        TrainerConfig(train_batch_size=8, weight_sync="lora"), PPOConfig(sampling=SAMPLING),
        namespace=NAMESPACE,
    )
    maker = ExperienceMakerHolder.options(name="merging_maker", namespace=NAMESPACE,
                                          **gpu_options("maker")).remote(
        "merging_maker", ["lora_trainer"], functools.partial(lora_maker_models, "peft", 5),
        CyclingPrompts(arithmetic_prompts()),
        MakerConfig(experience_batch_size=4, sampling=SAMPLING, lora_mode="merge"),
        namespace=NAMESPACE,
    )
    try:
        run = maker.run.remote()
        ray.get(trainer.fit.remote(2), timeout=TIMEOUT)
        status = ray.get(run, timeout=TIMEOUT)
        assert status["policy_version"] == 2 and status["last_error"] is None
        syncs = ray.get(trainer.metrics.remote())
        actor, critic = lora_actor_critic(device="cpu")
        trainable = sum(p.numel() * p.element_size() for m in (actor, critic) for p in m.parameters()
                        if p.requires_grad)
        # Adapters and the (fully trainable) critic: not the policy's frozen base.
        assert [m["weight_sync/bytes"] for m in syncs] == [trainable, trainable]
    finally:
        kill(trainer, maker)


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_grpo_trainer_respects_the_staleness_bound(ray_cluster, max_staleness):
    from detached_rl.actors.trainer import DetachedGRPOTrainer
    from detached_rl.algorithms.grpo import GRPOConfig

    from .helpers import grpo_maker_models, tiny_policy

    ray = ray_cluster
    name = f"grpo_trainer_{max_staleness}"
    trainer = DetachedGRPOTrainer.options(name=name, namespace=NAMESPACE, **gpu_options("trainer")).remote(
        name, tiny_policy, TrainerConfig(train_batch_size=8, max_staleness=max_staleness),
        GRPOConfig(sampling=SAMPLING), namespace=NAMESPACE,
    )
    makers = [ExperienceMakerHolder.options(name=f"grpo_maker_{max_staleness}_{i}", namespace=NAMESPACE,
                                            **gpu_options("maker")).remote(
        f"grpo_maker_{max_staleness}_{i}", [name], grpo_maker_models, CyclingPrompts(arithmetic_prompts()),
        MakerConfig(experience_batch_size=2, group_size=4, sampling=SAMPLING), namespace=NAMESPACE)
        for i in range(2)]
    try:
        runs = [m.run.remote() for m in makers]
        ray.get(trainer.fit.remote(4), timeout=TIMEOUT)
        ray.get(runs, timeout=TIMEOUT)
        history = ray.get(trainer.metrics.remote())
        assert len(history) == 4
        for step in history:
            assert step["staleness/max"] <= max_staleness
            assert all(int(k.rsplit("_", 1)[1]) <= max_staleness for k in step
                       if k.startswith("staleness/hist_"))
            assert step["samples"] == 8
        stats = ray.get(trainer.buffer_stats.remote())
        assert stats["accounting_ok"]
    finally:
        kill(trainer, *makers)


def test_makers_are_admitted_before_their_first_batch_to_what_the_trainer_can_train(ray_cluster):
    """Three makers of 4-sample batches, two pushes in flight each, at a trainer of 8 a step with staleness 1
    that has not started training: v0 weights feed its steps at v0 and v1, 16 samples, and no more are made
    (unpaced, each maker's 2 first batches alone made 24). Whichever makers came first make them; the
    others wait for v1. Then the trainer trains and nothing goes stale but, on a slow machine, the waiting
    maker's first two batches: it makes them cold (its first generation) once v1 comes, and where the others
    fed the step at v2 before they landed, they arrive at v3 (CI saw 4 of them once)."""
    ray = ray_cluster
    trainer = new_trainer("admit_trainer", max_staleness=1, buffer_max_samples=64)
    makers = [new_maker(f"admit_maker_{i}", ["admit_trainer"]) for i in range(3)]
    try:
        runs = [maker.run.remote() for maker in makers]
        wait_until_registered([trainer], {f"admit_maker_{i}" for i in range(3)})

        def pushed() -> list[int]:
            statuses = ray.get([maker.status.remote() for maker in makers], timeout=TIMEOUT)
            return sorted((s["push"] or {}).get("samples_pushed", 0) for s in statuses)

        deadline = time.monotonic() + TIMEOUT
        while sum(pushed()) < 16 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)  # a maker let through would push within this (a tiny batch takes ~0.1 s)
        assert sum(pushed()) == 16 and pushed()[0] == 0 and ray.get(trainer.buffer_length.remote()) == 16
        ray.get(trainer.fit.remote(4), timeout=TIMEOUT)
        ray.get(runs, timeout=TIMEOUT)
        stats = ray.get(trainer.buffer_stats.remote())
        refused = sum(s["push"]["dropped_stale_by_trainer"]
                      for s in ray.get([maker.status.remote() for maker in makers], timeout=TIMEOUT))
        assert stats["dropped"].get("stale", 0) + refused <= 8 and stats["accounting_ok"], (stats, refused)
        assert min(pushed()) > 0  # the third maker fed the trainer once its weights came
    finally:
        kill(trainer, *makers)


def test_a_push_whose_answer_was_lost_is_stored_once_across_two_trainers(ray_cluster):
    """The first attempt reaches trainer a and is stored, but its answer is lost:
    the retry goes to a, not b."""
    from concurrent.futures import Future

    from detached_rl.actors.trainer import DetachedGRPOTrainer
    from detached_rl.algorithms.grpo import GRPOConfig
    from detached_rl.maker.pusher import ExperiencePusher

    from .helpers import tiny_policy

    ray = ray_cluster
    handles = {name: DetachedGRPOTrainer.options(name=name, namespace=NAMESPACE,
                                                 **gpu_options("trainer")).remote(
        name, tiny_policy, TrainerConfig(train_batch_size=8), GRPOConfig(sampling=SAMPLING), NAMESPACE)
        for name in ("once_a", "once_b")}
    calls = []

    def submit(trainer, experiences):
        calls.append(trainer)
        answer = handles[trainer].push_experience.remote(experiences).future()
        if len(calls) > 1:
            return answer
        lost = Future()  # fails once the trainer has stored the push
        answer.add_done_callback(lambda _: lost.set_exception(ConnectionError("connection reset")))
        return lost

    try:
        pusher = ExperiencePusher(submit, list(handles), backoff_initial=0.01)
        push = [Experience(torch.tensor([5, 6]), torch.tensor([7, 8]), torch.tensor([-0.5, -0.5]),
                           torch.tensor(1.0))
                for _ in range(3)]
        pusher.push(push)
        assert pusher.flush(timeout=TIMEOUT)
        assert calls == ["once_a", "once_a"]
        stats = ray.get([handle.buffer_stats.remote() for handle in handles.values()], timeout=TIMEOUT)
        assert [(s["received"], s["duplicates"]) for s in stats] == [(3, 3), (0, 0)]
        assert pusher.stats()["duplicates"] == 3
    finally:
        kill(*handles.values())
