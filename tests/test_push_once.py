"""A resumed trainer keeps every push it acknowledged, including one acknowledged
while its checkpoint loads."""

import threading

from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.core.replay_buffer import ReplayBuffer
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from detached_rl.trainer.resume import merge_buffer_states

from .helpers import ids, make_experience, naive_strategy, tiny_policy


def pushes(count: int, size: int = 2) -> list[list]:
    return [[make_experience(maker=f"m{i % 2}") for _ in range(size)] for i in range(count)]


def test_merged_state_keeps_restored_then_live_samples_and_counts_a_known_id_as_a_duplicate():
    restored = ReplayBuffer(max_samples=4)
    old, trained = pushes(2)
    restored.append(old + trained, current_version=0)
    restored.take(2)  # `old` trained before the checkpoint
    live = ReplayBuffer(max_samples=8)
    fresh, more = pushes(2)
    live.append(fresh + trained[:1], current_version=0)  # trained[0]: retried after the trainer came back
    live.append(more, current_version=0)
    live.take(1)  # a consumer took fresh[0] from the live buffer

    merged = ReplayBuffer(max_samples=4)
    merged.load_state_dict(merge_buffer_states(restored.state_dict(), live.state_dict()))
    # Over capacity (5 > 4), yet nothing acknowledged is dropped; the buffer refuses pushes until drained.
    assert ids(merged.experiences()) == ids(trained + fresh[1:] + more)
    stats = merged.stats()
    assert stats["accounting_ok"] and stats["duplicates"] == 1
    assert (stats["received"], stats["sampled"], stats["size"]) == (4 + 5 - 1, 2 + 1, 5)
    assert {maker: row["received"] for maker, row in stats["per_maker"].items()} == {"m0": 4, "m1": 4}
    assert merged.append(pushes(1)[0], current_version=0).full
    merged.take(5)
    # live ids, sampled ones too, are remembered
    assert merged.append(fresh, current_version=0).duplicates == 2


def new_trainer() -> TrainerCore:
    learner = GRPOLearner(tiny_policy(), naive_strategy(),
                          GRPOConfig(sampling=SamplingConfig(max_new_tokens=4)))
    return TrainerCore("t0", learner, TrainerConfig(train_batch_size=2, buffer_max_samples=4))


def test_a_push_acknowledged_while_the_learner_loads_its_checkpoint_is_kept(tmp_path):
    checkpointed = pushes(2)
    first = new_trainer()
    for push in checkpointed:
        first.push_experience(push)
    first.save_checkpoint(tmp_path)
    resumed = new_trainer()  # a successor under the same name; makers push to it before and during its resume
    before, during = pushes(2)
    resumed.push_experience(before)
    load_learner = resumed.learner.load_state_dict

    def push_while_loading(state):
        assert resumed.push_experience(during).accepted == len(during)  # acknowledged mid-load
        load_learner(state)

    resumed.learner.load_state_dict = push_while_loading
    resumed.load_checkpoint(tmp_path)
    # Over capacity (8 > 4): every acknowledged sample is kept, the restored ones first.
    assert ids(resumed.buffer.experiences()) == ids(sum(checkpointed, []) + before + during)
    assert resumed.buffer.stats()["accounting_ok"]


def test_a_push_arriving_while_the_buffer_is_swapped_waits_and_lands_in_the_restored_buffer(tmp_path):
    trainer = new_trainer()
    trainer.push_experience(pushes(1)[0])
    trainer.save_checkpoint(tmp_path)
    late = pushes(1)[0]
    answers = []
    pusher = threading.Thread(target=lambda: answers.append(trainer.push_experience(late)))
    state_dict = trainer.buffer.state_dict

    def state_while_a_push_arrives():
        pusher.start()
        pusher.join(0.3)
        assert pusher.is_alive(), "a push must wait while the buffer is being replaced"
        return state_dict()

    trainer.buffer.state_dict = state_while_a_push_arrives
    trainer.load_checkpoint(tmp_path)
    pusher.join(5)
    assert answers and answers[0].accepted == len(late)
    assert set(ids(late)) <= set(ids(trainer.buffer.experiences()))
    assert trainer.buffer.stats()["accounting_ok"]
