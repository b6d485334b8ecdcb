"""Sample provenance: on-version samples are checked against the trainer's recompute; dishonest makers are
quarantined (no Ray: a maker and a trainer in one process, as in test_maker_trainer.py)."""

import dataclasses
from concurrent.futures import Future

import pytest
import torch

from detached_rl import Experience
from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.algorithms.provenance import check_samples, sample_gaps
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.core.replay_buffer import RejectedPushError
from detached_rl.core.sample_checks import ProvenanceConfig
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.models import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from detached_rl.trainer.quarantine import ProvenanceWatch
from detached_rl.weights.push_queue import WeightPushQueue
from detached_rl.weights.served_probe import PROBE_KEY

from .helpers import (
    ObjectStore,
    arithmetic_prompts,
    naive_strategy,
    tiny_actor_critic,
    tiny_maker_models,
    tiny_policy,
)

SAMPLING = SamplingConfig(max_new_tokens=6)


def test_sample_gaps_are_per_sample_means_over_valid_finite_tokens():
    behaviour = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, float("-inf"), 0.0], [-1.0, -1.0, -1.0]])
    recomputed = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, -1.0, 0.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    # row 0: |0.5|, |0| -> 0.25 (the third token is padding); row 1: the -inf token is left out -> 0.5;
    # row 2: no valid token -> 0
    assert sample_gaps(behaviour, recomputed, mask).tolist() == [0.25, 0.5, 0.0]
    verdicts = check_samples(behaviour, recomputed, mask, [True, True, False], [0.3, 0.3, 0.3])
    assert verdicts.rows == [0, 1] and verdicts.outside == [False, True]
    assert verdicts.metrics() == {"provenance/checked": 2.0, "provenance/outside": 1.0,
                                  "provenance/gap_mean": 0.375, "provenance/gap_max": 0.5}


def test_bounds_follow_the_narrower_engine_and_bad_settings_are_refused():
    config = ProvenanceConfig(bounds={"float32": 0.02, "bfloat16": 0.25})
    assert config.bound_for("hf:float32", "hf:float32") == 0.02
    assert config.bound_for("vllm:bfloat16", "hf:float32") == 0.25
    assert config.bound_for("hf:float32", "hf:autocast-bfloat16") == 0.25
    assert config.bound_for("hf:<unknown>", "hf:float32") == 0.25  # unknown: the largest
    for kwargs, field in ((dict(bounds={"float32": 0.0}), "bounds"), (dict(bounds={}), "bounds"),
                          (dict(quarantine_after=0), "quarantine_after"), (dict(window=2, quarantine_after=3),
                                                                           "quarantine_after")):
        with pytest.raises(ValueError, match=field):
            ProvenanceConfig(**kwargs)


def test_the_watch_quarantines_after_enough_outside_samples_and_refuses_counting():
    from detached_rl.algorithms.provenance import ProvenanceVerdicts

    watch = ProvenanceWatch(ProvenanceConfig(quarantine_after=3, window=8))
    honest = ProvenanceVerdicts([0, 1], [0.001, 0.002], [0.02, 0.02], ["a", "a"])
    assert watch.observe(honest, 1) == [] and watch.refusal({"a"}, 4) is None
    forged = ProvenanceVerdicts([0, 1, 2], [5.0, 0.001, 6.0], [0.02] * 3, ["b", "a", "b"])
    assert watch.observe(forged, 2) == []  # b: 2 outside of 2
    assert watch.observe(ProvenanceVerdicts([0], [4.0], [0.02], ["b"]), 3) == ["b"]
    reason = watch.refusal({"b", "a"}, 4)
    assert "maker 'b' is quarantined at v3" in reason and "3 of its last 3" in reason
    assert watch.status()["makers"]["b"] == {"checked": 3, "outside": 3, "refused_pushes": 1,
                                             "refused_samples": 4}
    assert watch.status()["makers"]["a"]["outside"] == 0 and list(watch.status()["quarantined"]) == ["b"]


def ppo_trainer(lr=1e-5, **provenance):
    actor, critic = tiny_actor_critic(seed=0)
    config = PPOConfig(sampling=SAMPLING, kl_coef=0.01, actor_optimizer=OptimizerConfig(lr=lr))
    learner = PPOLearner(actor, critic, naive_strategy(), config)
    config = TrainerConfig(train_batch_size=8, max_staleness=0, batch_timeout_s=10,
                           provenance=ProvenanceConfig(**provenance))
    trainer = TrainerCore("trainer", learner, config)
    store = ObjectStore()
    trainer.weights.snapshot(store.put)
    return trainer, store


def synced_maker(name, trainer, store, seed=0):
    config = MakerConfig(experience_batch_size=4, sampling=SAMPLING)
    maker = ExperienceMaker(name, tiny_maker_models(seed=seed), CyclingPrompts(arithmetic_prompts()), config,
                            strategy=naive_strategy())
    maker.apply_weight_update(trainer.weights.register(name), store.fetch)
    return maker


def sync(trainer, store, *makers):
    """Publish the trainer's current weights to `makers` (each applies them at once)."""
    by_name = {maker.name: maker for maker in makers}

    def send(name, update):
        future = Future()
        future.set_result(by_name[name].apply_weight_update(update, store.fetch))
        return future

    if trainer.policy_version > 0:
        trainer.weights.publish(store.put, WeightPushQueue(send, timeout=60))
    assert all(maker.policy_version == trainer.policy_version for maker in makers)


def forge_log_probs(experiences):
    """The hostile push of the issue: log-probs claimed at -0.01 a token (the tokens made honestly)."""
    return [dataclasses.replace(e, log_probs=torch.full_like(e.log_probs, -0.01)) for e in experiences]


def train_until_quarantined(trainer, store, honest, dishonest, dishonest_batch, steps=4):
    """Steps of one honest and one dishonest push each (two honest ones once the dishonest maker is refused):
    the dishonest pushes refused, and each step's metrics."""
    refused, metrics = 0, []
    for _ in range(steps):
        sync(trainer, store, honest, dishonest)
        trainer.push_experience(honest.make_experience())
        try:
            trainer.push_experience(dishonest_batch())
        except RejectedPushError as error:
            assert error.field == "maker" and "quarantined" in str(error)
            refused += 1
            trainer.push_experience(honest.make_experience())
        metrics.append(trainer.train_step())
    return refused, metrics


@pytest.mark.parametrize("dishonesty", ["forged log-probs", "another policy", "replayed under new ids"])
def test_a_dishonest_maker_is_caught_within_one_push_and_the_honest_one_never(dishonesty):
    torch.manual_seed(0)
    trainer, store = ppo_trainer(lr=1e-3)
    honest, dishonest = synced_maker("honest", trainer, store), synced_maker("dishonest", trainer, store)
    if dishonesty == "forged log-probs":
        def dishonest_batch():
            return forge_log_probs(dishonest.make_experience())
    elif dishonesty == "another policy":  # another run's weights serve, the current version is claimed
        other, _ = tiny_actor_critic(seed=5)

        def dishonest_batch():
            dishonest.backend.weight_sink.write(dishonest.backend.weight_sink.stage(other.model.state_dict()))
            batch = dishonest.make_experience()
            # A dishonest maker sends no proof of what it serves (the one its engine gives is refused:
            # test_an_engine_that_keeps_its_previous_weights_is_caught_...), or a forged one.
            batch[0].info.pop(PROBE_KEY)
            return batch
    else:  # samples of v0, replayed at every later version under new ids
        old = dishonest.make_experience()
        for _ in range(3):  # the policy moves on (honest samples)
            sync(trainer, store, honest, dishonest)
            for _ in range(2):
                trainer.push_experience(honest.make_experience())
            trainer.train_step()

        def dishonest_batch():
            return [dataclasses.replace(e, id=f"{e.id}-again-{trainer.policy_version}",
                                        policy_version=trainer.policy_version) for e in old]
    refused, steps = train_until_quarantined(trainer, store, honest, dishonest, dishonest_batch)
    status = trainer.status()["provenance"]
    # Caught on its first push (4 samples, all outside): quarantined, the 3 pushes after it refused.
    assert list(status["quarantined"]) == ["dishonest"] and refused == 3
    assert status["makers"]["dishonest"] == {"checked": 4, "outside": 4, "refused_pushes": 3,
                                             "refused_samples": 12}
    assert status["makers"]["honest"]["outside"] == 0 and status["makers"]["honest"]["checked"] > 0
    # the steps after it: only the honest maker's samples, none outside
    assert [row["provenance/outside"] for row in steps] == [4, 0, 0, 0]
    assert trainer.buffer.stats()["accounting_ok"]


def test_the_check_off_lets_the_forged_push_train_as_before():
    """The same forged push with `provenance.check` off: trained, nobody quarantined (the tests above fail
    without the check)."""
    torch.manual_seed(0)
    trainer, store = ppo_trainer(check=False)
    honest, dishonest = synced_maker("honest", trainer, store), synced_maker("dishonest", trainer, store)
    refused, _ = train_until_quarantined(trainer, store, honest, dishonest,
                                         lambda: forge_log_probs(dishonest.make_experience()), steps=2)
    assert refused == 0 and trainer.status()["provenance"]["quarantined"] == {}


def test_grpo_random_token_groups_claimed_likely_are_taken_out_of_the_step_that_meets_them():
    """The issue's hostile push: well-formed GRPO groups of random tokens claimed at -0.01 a token, rewards
    split 1/0, tagged with the current version: none of them counts in the step, and their maker is named."""
    torch.manual_seed(0)
    policy = tiny_policy()
    learner = GRPOLearner(policy, naive_strategy(), GRPOConfig(sampling=SAMPLING, group_size=4))
    trainer = TrainerCore("trainer", learner, TrainerConfig(train_batch_size=16))
    vocab = policy.model.config.vocab_size
    hostile = [Experience(torch.tensor([5, 6, 7]), torch.randint(3, vocab, (6,)), torch.full((6,), -0.01),
                          torch.tensor(float(i % 2)), maker="hostile", group_id=f"g{i // 4}")
               for i in range(8)]
    honest = [Experience(torch.tensor([5, 6, 7]), torch.tensor([9]), torch.zeros(1),
                         torch.tensor(float(i % 2)), maker="honest", group_id=f"h{i // 4}") for i in range(8)]
    with torch.no_grad():  # the honest ones carry the policy's own log-probs
        for e in honest:
            ids = torch.cat([e.prompt_ids, e.response_ids])[None]
            logits = policy.model(ids).logits[0, -2] / SAMPLING.temperature
            e.log_probs = logits.log_softmax(-1)[e.response_ids]
    trainer.push_experience(honest)
    trainer.push_experience(hostile)
    metrics = trainer.train_step()
    assert metrics["provenance/checked"] == 16 and metrics["provenance/outside"] == 8
    assert list(trainer.status()["provenance"]["quarantined"]) == ["hostile"]
    with pytest.raises(RejectedPushError, match="hostile"):
        trainer.push_experience([dataclasses.replace(e, id=e.id + "-2") for e in hostile])


def test_a_short_sample_gets_a_wider_bound():
    # 2 valid tokens, gap 0.5 each: beyond 0.25, within 0.25 * sqrt(8 / 2) = 0.5; 8 tokens: the bound itself
    behaviour = torch.zeros(2, 8)
    recomputed = torch.full((2, 8), -0.5)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0, 0], [1] * 8])
    verdicts = check_samples(behaviour, recomputed, mask, [True, True], [0.25, 0.25], min_tokens=8)
    assert verdicts.bounds == [0.5, 0.25] and verdicts.outside == [False, True]


@pytest.mark.parametrize("fault", ["keeps its previous weights", "serves the base model"])
def test_an_engine_that_does_not_serve_the_version_it_names_is_caught_within_one_version(fault):
    """The HF engine's sink takes no more writes (keeps the weights it served) or goes back to the initial
    weights, while the maker reports the new version: the push made with it is refused naming the maker and
    the version, `status` shows it, and the maker is told to register again."""
    torch.manual_seed(0)
    trainer, store = ppo_trainer(lr=1e-2)
    honest, faulty = synced_maker("honest", trainer, store), synced_maker("faulty", trainer, store)
    sink = faulty.backend.weight_sink
    base = {key: value.clone() for key, value in sink.state().items()}
    for _ in range(2):  # the policy moves away from the base
        sync(trainer, store, honest, faulty)
        trainer.push_experience(faulty.make_experience())
        trainer.push_experience(honest.make_experience())
        trainer.train_step()
    if fault == "keeps its previous weights":
        sink.write = lambda tensors: None
    sync(trainer, store, honest, faulty)
    if fault == "serves the base model":
        sink.write(sink.stage(base))
    assert faulty.policy_version == trainer.policy_version == 2  # it reports the version it was sent
    named = "'faulty' serves another policy than the v2 it names"
    with pytest.raises(RejectedPushError, match=named) as error:
        trainer.push_experience(faulty.make_experience())
    assert error.value.field == f"info.{PROBE_KEY}"
    trainer.push_experience(honest.make_experience())  # the honest engine proves its version
    mismatch = trainer.status()["provenance"]["served_mismatch"]
    assert list(mismatch) == ["faulty"] and mismatch["faulty"]["version"] == 2
    entry = mismatch["faulty"]
    assert entry["refused_pushes"] == 1 and entry["gap"] > entry["bound"]
    faulty.note_rejection(error.value)
    assert faulty.resync_reason is not None and "serves another policy" in faulty.resync_reason
