"""The replay buffer's door (issue 26.2): what a push must be to be stored, and that a refusal is named,
counted and stores nothing (no Ray)."""

import dataclasses

import pytest
import torch

from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.config.loading import load_config
from detached_rl.core.experience import Experience, ExperienceValidationError
from detached_rl.core.replay_buffer import RejectedPushError, ReplayBuffer
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore

from .helpers import make_experience, naive_strategy, tiny_policy

GROUP = 8


def group(name: str, size: int = GROUP, version: int = 0, **kwargs) -> list[Experience]:
    return [make_experience(id=f"{name}-{i}", group_id=name, policy_version=version, reward=float(i % 2),
                            **kwargs)
            for i in range(size)]


def refused(buffer: ReplayBuffer, push: list, field: str | None, match: str,
            version: int = 0) -> RejectedPushError:
    """Push `push`, expect a refusal naming `field` (None: no one field), and check it was
    counted and changed nothing else."""
    before = buffer.stats()
    stored = [e.id for e in buffer.experiences()]
    with pytest.raises(RejectedPushError, match=match) as info:
        buffer.append(push, current_version=version)
    assert info.value.field == field
    after = buffer.stats()
    assert after.pop("rejected_invalid") == before.pop("rejected_invalid") + 1
    assert after == before and [e.id for e in buffer.experiences()] == stored
    return info.value


# ---------------------------------------------------------------- whole groups


def test_a_sample_without_a_group_id_is_refused_by_a_grouped_buffer():
    buffer = ReplayBuffer(group_size=GROUP)
    error = refused(buffer, [make_experience(id="lone")], "group_id", r"group_id.*groups of 8")
    assert error.index == 0
    # One ungrouped sample in an otherwise whole push sinks the whole push.
    refused(buffer, [*group("a"), make_experience(id="lone")], "group_id", "group_id")
    assert buffer.append(group("a"), current_version=0).accepted == GROUP


def test_part_of_a_group_is_refused_and_nothing_of_the_push_is_stored():
    buffer = ReplayBuffer(group_size=GROUP)
    error = refused(buffer, [*group("a"), *group("b", size=3)], "group_id", r"'b'.*3 times.*8")
    assert error.index == GROUP
    refused(buffer, group("c", size=GROUP + 1), "group_id", "9 times")
    assert buffer.stats()["received"] == 0


def test_group_size_one_allows_ungrouped_samples():
    buffer = ReplayBuffer(group_size=1)
    assert buffer.append([make_experience(id="x"), make_experience(id="y")], current_version=0).accepted == 2
    refused(buffer, group("g", size=2), "group_id", "2 times")


def test_a_group_id_already_in_the_buffer_is_refused():
    buffer = ReplayBuffer(group_size=2)
    buffer.append(group("a", size=2), current_version=0)
    again = [make_experience(id=f"other-{i}", group_id="a") for i in range(2)]
    refused(buffer, again, "group_id", "already in the buffer")
    buffer.take(2)
    assert buffer.append(again, current_version=0).accepted == 2  # trained and gone: no batch can mix them


def test_a_group_that_is_partly_a_repeat_is_refused():
    buffer = ReplayBuffer(group_size=2)
    first = group("a", size=2)
    buffer.append(first, current_version=0)
    buffer.take(2)
    partly = [first[0], make_experience(id="new", group_id="a")]
    refused(buffer, partly, "group_id", "partly")
    # A whole retry is duplicates, as before.
    assert buffer.append(first, current_version=0).duplicates == 2


def test_a_group_of_mixed_policy_versions_is_refused():
    buffer = ReplayBuffer(group_size=2, max_staleness=1)
    mixed = [make_experience(id="a-0", group_id="a", policy_version=0),
             make_experience(id="a-1", group_id="a", policy_version=2)]
    refused(buffer, mixed, "group_id", "policy version", version=2)


def test_evict_oldest_evicts_whole_groups():
    buffer = ReplayBuffer(group_size=2, max_samples=5, overflow="evict_oldest")
    buffer.append(group("a", size=2) + group("b", size=2), current_version=0)
    result = buffer.append(group("c", size=2), current_version=0)
    assert (result.accepted, result.evicted) == (2, 2)
    assert [e.group_id for e in buffer.take(10)] == ["b", "b", "c", "c"]


def test_buffer_group_size_is_checked():
    with pytest.raises(ValueError, match="group_size"):
        ReplayBuffer(group_size=0)
    with pytest.raises(ValueError, match="group_size"):
        GRPOConfig(group_size=0)


def grpo_trainer(group_size: int | None, batch: int = 2 * GROUP) -> TrainerCore:
    config = GRPOConfig(sampling=SamplingConfig(max_new_tokens=4), group_size=group_size)
    learner = GRPOLearner(tiny_policy(), naive_strategy(), config)
    return TrainerCore("t0", learner, TrainerConfig(train_batch_size=batch, batch_timeout_s=5))


def test_a_training_step_never_fails_on_what_the_trainer_acknowledged():
    trainer = grpo_trainer(GROUP)
    trainer.push_experience(group("a"))
    for bad in ([make_experience(id="lone")], group("b", size=3)):
        with pytest.raises(RejectedPushError, match="group_id"):
            trainer.push_experience(bad)
    trainer.push_experience(group("c"))
    metrics = trainer.train_step()  # today: "a GRPO batch of 16 samples holds groups of sizes [1, 7, 8]"
    assert metrics["policy_version"] == 1.0
    assert trainer.buffer.stats()["rejected_invalid"] == 2


def test_a_grpo_trainer_refuses_a_batch_size_that_splits_groups():
    with pytest.raises(ValueError, match="train_batch_size"):
        grpo_trainer(GROUP, batch=GROUP + 4)


def test_the_run_config_gives_the_trainer_the_makers_group_size():
    config = load_config(None, ["algorithm=grpo", "maker.group_size=4", "trainer.train_batch_size=8"])
    assert config.algorithm_config.group_size == 4
    assert config.grpo.group_size is None  # the section is left as written
    with pytest.raises(Exception, match="group_size"):
        load_config(None, ["algorithm=grpo", "maker.group_size=4", "grpo.group_size=2"])


# ---------------------------------------------------------------- missing fields, subclasses


@pytest.mark.parametrize("name", ["response_ids", "reward", "group_id", "info", "id"])
def test_a_missing_field_is_refused_by_name_and_counted(name):
    buffer = ReplayBuffer()
    push = [make_experience(id="ok"), make_experience(id="broken")]
    delattr(push[1], name)
    error = refused(buffer, push, name, rf"Experience\.{name}: is missing")
    assert error.index == 1
    with pytest.raises(ExperienceValidationError, match="is missing"):
        push[1].validate()


def test_an_experience_subclass_is_refused_whatever_its_validate_says():
    @dataclasses.dataclass
    class Lenient(Experience):
        def validate(self, *args, **kwargs):
            return self

    nan = Lenient(**{f.name: getattr(make_experience(), f.name) for f in dataclasses.fields(Experience)})
    nan.reward = torch.tensor(float("nan"))
    buffer = ReplayBuffer()
    refused(buffer, [make_experience(), nan], None, "Lenient")
    fine = Lenient(**{f.name: getattr(make_experience(), f.name) for f in dataclasses.fields(Experience)})
    refused(buffer, [fine], None, "exactly")


# ---------------------------------------------------------------- oversized before stale


def test_an_oversized_push_is_refused_even_when_it_arrives_stale():
    buffer = ReplayBuffer(max_samples=100, max_staleness=1)
    late = [make_experience(id=f"s{i}", policy_version=0) for i in range(200)]
    refused(buffer, late, None, "can never fit", version=5)
    assert buffer.stats()["dropped"]["stale"] == 0


def test_an_oversized_push_by_bytes_is_refused_even_when_it_arrives_stale():
    buffer = ReplayBuffer(max_bytes=10_000, max_staleness=1)
    late = [make_experience(id=f"s{i}", policy_version=0, response=tuple(range(100))) for i in range(20)]
    refused(buffer, late, None, "max_bytes", version=5)


def test_an_oversized_push_of_duplicates_is_still_refused():
    buffer = ReplayBuffer(max_samples=4)
    push = [make_experience(id=f"d{i}") for i in range(4)]
    buffer.append(push, current_version=0)
    refused(buffer, push + [make_experience(id="more")], None, "can never fit")
