"""ReplayBuffer: budgets and backpressure, dedupe, validation, staleness, reuse,
threads, inspection, state."""

import functools
import io
import json
import threading
import time

import pytest
import torch

from detached_rl.algorithms.mismatch import masked_kl
from detached_rl.core.experience import Experience
from detached_rl.core.replay_buffer import AppendResult, RejectedPushError, ReplayBuffer

from .helpers import ids
from .helpers import make_experience as make

# make(): 3 + 2 int64 ids, 2 float32 log-probs, 1 float32 reward; a 2-byte id ("a0") and info as JSON ("{}")
SAMPLE_BYTES = 5 * 8 + 2 * 4 + 4 + 2 + 2


def makes(count: int, prefix: str = "e", **kwargs) -> list[Experience]:
    return [make(id=f"{prefix}{i}", **kwargs) for i in range(count)]


def assert_accounting(buffer: ReplayBuffer) -> dict:
    stats = buffer.stats()
    json.dumps(stats)
    assert stats["accounting_ok"]
    assert stats["received"] == stats["sampled"] + stats["in_buffer"] + sum(stats["dropped"].values())
    assert stats["size"] == stats["in_buffer"] == sum(stats["staleness"].values())
    return stats


def _checked(method):
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            assert_accounting(self)

    return wrapper


class CheckedBuffer(ReplayBuffer):
    """A ReplayBuffer that checks the accounting identity after every operation, even a failed one."""

    append = _checked(ReplayBuffer.append)
    sample = _checked(ReplayBuffer.sample)
    take = _checked(ReplayBuffer.take)
    clear = _checked(ReplayBuffer.clear)
    peek = _checked(ReplayBuffer.peek)
    load_state_dict = _checked(ReplayBuffer.load_state_dict)


def test_fifo_order():
    buffer = CheckedBuffer()
    buffer.append(makes(3, prefix="a"), current_version=0)
    buffer.append(makes(2, prefix="b"), current_version=0)
    assert len(buffer) == 5 and buffer.nbytes == 5 * SAMPLE_BYTES
    assert ids(buffer.sample(2)) == ["a0", "a1"]
    assert ids(buffer.sample(3)) == ["a2", "b0", "b1"]
    assert len(buffer) == 0 and buffer.nbytes == 0
    stats = buffer.stats()
    assert stats["received"] == stats["sampled"] == stats["times_handed_out"] == 5


def test_a_late_push_of_older_weights_is_handed_out_first_while_it_can_still_be_trained():
    # A slow maker's batch made with v0 lands behind a batch of v1 at version 1 (max_staleness 1). Handed out
    # in arrival order, the v1 batch would be trained at version 1 and the v0 one dropped as stale at 2.
    buffer = CheckedBuffer(max_staleness=1)
    buffer.append(makes(2, prefix="new", policy_version=1), current_version=1)
    buffer.append(makes(2, prefix="late", policy_version=0), current_version=1)
    buffer.append(makes(1, prefix="newer", policy_version=1), current_version=1)
    assert buffer.sampling_versions() == [0, 0, 1, 1, 1]
    assert ids(buffer.experiences()) == ["new0", "new1", "late0", "late1", "newer0"]  # arrival order
    assert ids(buffer.sample(2, current_version=1)) == ["late0", "late1"]
    assert ids(buffer.sample(3, current_version=2)) == ["new0", "new1", "newer0"]  # ties: arrival order
    assert buffer.stats()["dropped"]["stale"] == 0


def test_reused_samples_wait_behind_those_not_handed_out_yet_whatever_their_version():
    buffer = CheckedBuffer(max_reuse=2)
    buffer.append(makes(2, prefix="old", policy_version=0), current_version=1)
    assert ids(buffer.sample(1, current_version=1)) == ["old0"]
    buffer.append(makes(1, prefix="new", policy_version=1), current_version=1)
    assert ids(buffer.sample(3, current_version=1)) == ["old1", "new0", "old0"]


def test_sample_count_budget_refuses_whole_push_then_accepts_retry():
    buffer = CheckedBuffer(max_samples=4)
    assert buffer.append(makes(3, prefix="a"), 0).accepted == 3
    before = buffer.stats()
    retry = makes(2, prefix="b")
    result = buffer.append(retry, 0)
    assert result == AppendResult(accepted=0, duplicates=0, dropped_stale=0, evicted=0, full=True, size=3,
                                  nbytes=3 * SAMPLE_BYTES, current_version=0)
    after = buffer.stats()
    assert after.pop("refused_full") == before.pop("refused_full") + 1
    assert after == before
    assert ids(buffer.sample(1)) == ["a0"]
    # The same push again: its ids were not remembered, so it is accepted, not a duplicate.
    result = buffer.append(retry, 0)
    assert (result.accepted, result.duplicates, result.full, result.size) == (2, 0, False, 4)
    assert ids(buffer.take(10)) == ["a1", "a2", "b0", "b1"]


def test_byte_budget_refuses_then_accepts_after_sampling():
    buffer = CheckedBuffer(max_bytes=3 * SAMPLE_BYTES)
    buffer.append(makes(2, prefix="a"), 0)
    assert buffer.append(makes(2, prefix="b"), 0).full
    assert buffer.stats()["refused_full"] == 1 and len(buffer) == 2
    buffer.sample(1)
    assert buffer.append(makes(2, prefix="b"), 0).accepted == 2
    assert buffer.nbytes == 3 * SAMPLE_BYTES


@pytest.mark.parametrize("overflow", ["refuse", "evict_oldest"])
def test_push_that_can_never_fit_raises(overflow):
    buffer = CheckedBuffer(max_samples=2, max_bytes=10 * SAMPLE_BYTES, overflow=overflow)
    with pytest.raises(RejectedPushError, match="can never fit"):
        buffer.append(makes(3), 0)
    tight = CheckedBuffer(max_bytes=SAMPLE_BYTES - 1, overflow=overflow)
    with pytest.raises(ValueError, match="max_bytes"):
        tight.append(makes(1), 0)
    assert len(buffer) == 0 and buffer.stats()["received"] == 0


def test_evict_oldest_by_count_and_bytes():
    buffer = CheckedBuffer(max_samples=3, overflow="evict_oldest")
    buffer.append(makes(2, prefix="a"), 0)
    result = buffer.append(makes(2, prefix="b"), 0)
    assert (result.accepted, result.evicted, result.full, result.size) == (2, 1, False, 3)
    assert buffer.stats()["dropped"]["evicted"] == 1
    assert ids(buffer.take(5)) == ["a1", "b0", "b1"]

    by_bytes = CheckedBuffer(max_bytes=2 * SAMPLE_BYTES + 1, overflow="evict_oldest")
    by_bytes.append(makes(2, prefix="a"), 0)
    assert by_bytes.append(makes(2, prefix="b"), 0).evicted == 2
    assert ids(by_bytes.take(5)) == ["b0", "b1"]


def test_duplicates_are_skipped_and_counted():
    buffer = CheckedBuffer()
    a, b, c = make(id="a"), make(id="b"), make(id="c")
    buffer.append([a, b], 0)
    result = buffer.append([b, c], 0)
    assert (result.accepted, result.duplicates, result.received) == (1, 1, 1)
    assert ids(buffer.take(10)) == ["a", "b", "c"]
    # Already sampled, still remembered: a retried push is never trained on twice.
    result = buffer.append([make(id="a"), make(id="b")], 0)
    assert (result.accepted, result.duplicates) == (0, 2)
    stats = buffer.stats()
    assert (stats["received"], stats["duplicates"], stats["sampled"]) == (3, 3, 3)


def test_dedupe_window_is_an_lru_of_ids():
    buffer = CheckedBuffer(dedupe_window=2)
    buffer.append([make(id="a"), make(id="b"), make(id="c")], 0)
    # "a" left the window but is still in the buffer: still a duplicate.
    assert buffer.append([make(id="a")], 0).duplicates == 1
    buffer.take(10)
    # After that hit, the window holds c and a; b was forgotten.
    assert buffer.append([make(id="c"), make(id="a")], 0).duplicates == 2
    assert buffer.append([make(id="b")], 0).accepted == 1


def test_malformed_push_is_refused_whole():
    buffer = CheckedBuffer()
    buffer.append(makes(2, prefix="old"), 0)
    before = buffer.stats()
    push = makes(4, maker="m7")
    push[2].log_probs = torch.tensor([-0.1, float("nan")])
    with pytest.raises(RejectedPushError, match="Experience.log_probs: has non-finite") as info:
        buffer.append(push, 0)
    assert info.value.index == 2 and info.value.field == "log_probs"
    assert "index 2 of 4" in str(info.value) and "'e2'" in str(info.value) and "'m7'" in str(info.value)
    assert isinstance(info.value, ValueError)
    after = buffer.stats()
    assert after.pop("rejected_invalid") == before.pop("rejected_invalid") + 1
    assert after == before
    # None of the push's ids were remembered.
    assert buffer.append([push[0], push[1], push[3]], 0).accepted == 3


def test_vocab_size_is_checked():
    buffer = CheckedBuffer(vocab_size=9)
    with pytest.raises(RejectedPushError,
                       match="index 0 of 1.*response_ids: has token ids >= vocab size 9") as info:
        buffer.append([make(response=(8, 9))], 0)
    assert info.value.field == "response_ids"
    assert buffer.append([make(response=(7, 8))], 0).accepted == 1


def test_future_version_and_repeated_id_in_push_are_refused():
    buffer = CheckedBuffer()
    with pytest.raises(RejectedPushError, match="policy_version: 4 is newer .* current version 3") as info:
        buffer.append([make(policy_version=3), make(policy_version=4)], current_version=3)
    assert (info.value.index, info.value.field) == (1, "policy_version")
    with pytest.raises(RejectedPushError, match="Experience.id: appears twice") as info:
        buffer.append([make(id="x"), make(id="y"), make(id="x")], current_version=3)
    assert (info.value.index, info.value.field) == (2, "id")
    stats = buffer.stats()
    assert (stats["size"], stats["received"], stats["rejected_invalid"]) == (0, 0, 2)


def test_staleness_on_arrival():
    strict = CheckedBuffer(max_staleness=0)
    result = strict.append([make(id="old", policy_version=2), make(id="new", policy_version=3)], 3)
    assert (result.accepted, result.dropped_stale, result.received) == (1, 1, 2)
    assert strict.stats()["dropped"]["stale"] == 1 and strict.stats()["received"] == 2
    # A dropped stale sample is remembered: retrying it is a duplicate, not a second drop.
    assert strict.append([make(id="old", policy_version=2)], 3).duplicates == 1

    lenient = CheckedBuffer(max_staleness=1)
    result = lenient.append([make(policy_version=v) for v in (1, 2, 3)], 3)
    assert (result.accepted, result.dropped_stale) == (2, 1)

    unlimited = CheckedBuffer()
    assert unlimited.append([make(policy_version=0)], 1000).accepted == 1


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_staleness_at_sample_time(max_staleness):
    buffer = CheckedBuffer(max_staleness=max_staleness)
    buffer.append([make(id="v3a", policy_version=3), make(id="v3b", policy_version=3)], 3)
    assert ids(buffer.sample(1, current_version=3 + max_staleness)) == ["v3a"]
    assert buffer.sample(1, current_version=4 + max_staleness) == []
    stats = buffer.stats()
    assert stats["dropped"]["stale"] == 1 and stats["sampled"] == 1 and len(buffer) == 0
    # Without a current version nothing is judged stale.
    buffer.append([make(id="v5", policy_version=5)], 5)
    assert ids(buffer.sample(1)) == ["v5"]


def test_stale_samples_make_room_on_append():
    buffer = CheckedBuffer(max_samples=2, max_staleness=0)
    buffer.append(makes(2, policy_version=1), 1)
    result = buffer.append([make(id="fresh", policy_version=2)], 2)
    assert (result.accepted, result.full, result.size) == (1, False, 1)
    assert buffer.stats()["dropped"]["stale"] == 2


def test_max_reuse_hands_each_sample_out_twice():
    buffer = CheckedBuffer(max_reuse=2)
    buffer.append([make(id="a"), make(id="b"), make(id="c")], 0)
    assert ids(buffer.sample(2)) == ["a", "b"]
    assert len(buffer) == 3
    # Reused samples went to the back, so c gets its turn first.
    assert ids(buffer.sample(2)) == ["c", "a"]
    assert len(buffer) == 2
    assert ids(buffer.sample(2)) == ["b", "c"]
    assert len(buffer) == 0
    stats = buffer.stats()
    assert (stats["sampled"], stats["times_handed_out"]) == (3, 6)


def test_sample_times_out_with_empty_list():
    buffer = CheckedBuffer()
    buffer.append(makes(1), 0)
    start = time.monotonic()
    assert buffer.sample(2, timeout=0.2) == []
    elapsed = time.monotonic() - start
    assert 0.19 <= elapsed < 1.0
    start = time.monotonic()
    assert buffer.sample(2) == []
    assert time.monotonic() - start < 0.05
    assert len(buffer) == 1 and buffer.stats()["times_handed_out"] == 0


def test_append_wakes_a_waiting_sample():
    buffer = CheckedBuffer()
    result: list = []

    def consume():
        start = time.monotonic()
        result.append(buffer.sample(2, timeout=10.0))
        result.append(time.monotonic() - start)

    thread = threading.Thread(target=consume)
    thread.start()
    time.sleep(0.05)
    buffer.append([make(id="a")], 0)  # not enough yet: it keeps waiting
    time.sleep(0.05)
    buffer.append([make(id="b")], 0)
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert ids(result[0]) == ["a", "b"]
    assert 0.05 <= result[1] < 2.0  # woken by the append, long before the 10 s timeout


def test_concurrent_producers_and_consumers():
    buffer = CheckedBuffer(max_samples=32, max_staleness=None)
    producers, pushes, per_push = 4, 200, 2
    expected = {f"p{p}-{i}-{k}" for p in range(producers) for i in range(pushes) for k in range(per_push)}
    consumed: list[list[str]] = [[], []]
    refused = [0] * producers
    done = threading.Event()
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            for i in range(pushes):
                push = [make(id=f"p{p}-{i}-{k}", maker=f"m{p}") for k in range(per_push)]
                while buffer.append(push, 0).full:  # backpressure: back off and retry
                    refused[p] += 1
                    time.sleep(0.0005)
                if i % 50 == 0:  # a retried push after an ack is recognised
                    assert buffer.append(push, 0).duplicates == per_push
        except BaseException as err:
            errors.append(err)

    def consume(c: int) -> None:
        try:
            while not (done.is_set() and len(buffer) == 0):
                consumed[c].extend(ids(buffer.sample(3, timeout=0.01)))
                if done.is_set():
                    consumed[c].extend(ids(buffer.take(100)))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    consumers = [threading.Thread(target=consume, args=(c,)) for c in range(2)]
    for thread in threads + consumers:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    done.set()
    for thread in consumers:
        thread.join(timeout=30)
    assert not errors, errors
    all_consumed = consumed[0] + consumed[1]
    assert len(all_consumed) == len(expected) and set(all_consumed) == expected
    stats = assert_accounting(buffer)
    assert stats["received"] == stats["sampled"] == len(expected)
    assert stats["duplicates"] == producers * (pushes // 50) * per_push
    assert stats["refused_full"] == sum(refused)
    assert stats["per_maker"] == {f"m{p}": {"received": pushes * per_push, "in_buffer": 0}
                                  for p in range(producers)}


def test_stats_fields():
    buffer = CheckedBuffer(max_samples=10, max_staleness=2)
    empty = buffer.stats()
    assert empty["reward"] == {"mean": None, "std": None, "min": None, "max": None}
    assert empty["dropped"] == {"stale": 0, "evicted": 0, "cleared": 0, "quarantined": 0}
    buffer.append([make(maker="m0", policy_version=3, reward=1.0),
                   make(maker="m0", policy_version=4, reward=3.0)], 4)
    buffer.append([make(maker="m1", policy_version=4, reward=[0.5, 1.5]), make(maker="m1", policy_version=1)],
                  4)
    stats = buffer.stats()
    assert stats["size"] == stats["in_buffer"] == 3 and stats["bytes"] == buffer.nbytes
    assert (stats["max_samples"], stats["max_bytes"]) == (10, 1 << 30)
    assert stats["staleness"] == {"3": 1, "4": 2}
    assert stats["per_maker"] == {"m0": {"received": 2, "in_buffer": 2},
                                  "m1": {"received": 2, "in_buffer": 1}}
    assert stats["reward"]["mean"] == pytest.approx(2.0)
    assert stats["reward"]["std"] == pytest.approx((2 / 3) ** 0.5)
    assert (stats["reward"]["min"], stats["reward"]["max"]) == (1.0, 3.0)
    assert stats["dropped"]["stale"] == 1 and stats["received"] == 4
    assert json.loads(json.dumps(stats)) == stats
    buffer.clear()
    stats = buffer.stats()
    assert (stats["size"], stats["bytes"], stats["dropped"]["cleared"]) == (0, 0, 3)
    assert stats["per_maker"]["m0"] == {"received": 2, "in_buffer": 0}


def test_peek_filters_decodes_and_changes_nothing():
    buffer = CheckedBuffer()
    buffer.append([make(id="a", maker="m0", reward=0.0), make(id="b", maker="m1", reward=1.0)], 0)
    buffer.append([make(id="c", maker="m0", reward=1.0, info={"k": 1}, group_id="g", prompt=(1, 2))], 0)
    before = buffer.stats()
    assert [row["id"] for row in buffer.peek()] == ["c", "b", "a"]
    assert [row["id"] for row in buffer.peek(count=2)] == ["c", "b"]
    assert [row["id"] for row in buffer.peek(maker="m0")] == ["c", "a"]
    assert [row["id"] for row in buffer.peek(min_reward=0.5)] == ["c", "b"]
    assert [row["id"] for row in buffer.peek(max_reward=0.5)] == ["a"]
    assert buffer.peek(maker="nobody") == []
    (row,) = buffer.peek(count=1, decode=lambda tokens: " ".join(map(str, tokens)))
    assert row == {
        "id": "c", "maker": "m0", "policy_version": 0, "group_id": "g", "score": 1.0,
        "prompt_length": 2, "response_length": 2, "info": {"k": 1}, "uses": 0,
        "prompt_text": "1 2", "response_text": "8 9",
    }
    assert "prompt_text" not in buffer.peek(count=1)[0]
    assert buffer.stats() == before
    assert ids(buffer.take(3)) == ["a", "b", "c"]


def test_a_state_saved_in_arrival_order_is_restored_in_sampling_order():
    buffer = CheckedBuffer(max_staleness=1)
    buffer.append(makes(2, prefix="new", policy_version=1), current_version=1)
    buffer.append(makes(2, prefix="late", policy_version=0), current_version=1)
    state = buffer.state_dict()
    state["queue"] = ["new0", "new1", "late0", "late1"]  # as a first-in-first-out buffer saved it
    restored = CheckedBuffer(max_staleness=1)
    restored.load_state_dict(state)
    assert restored.sampling_versions() == [0, 0, 1, 1]
    assert ids(restored.sample(2, current_version=1)) == ["late0", "late1"]


def test_state_dict_round_trip():
    buffer = CheckedBuffer(max_reuse=2, max_staleness=5)
    half = make(id="bf16", maker="m1", policy_version=1)
    half.log_probs = half.log_probs.to(torch.bfloat16)
    ab = [make(id="a", maker="m0", policy_version=1, info={"text": "x"}),
          make(id="b", maker="m0", policy_version=1)]
    buffer.append([*ab, half], 1)
    buffer.append([make(id="s", policy_version=0)], 6)  # dropped as stale on arrival
    buffer.sample(1)  # "a" handed out once, now at the back
    buffer.append([make(id="a")], 6)  # a duplicate

    state = buffer.state_dict()
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    restored = CheckedBuffer(max_reuse=2, max_staleness=5)
    restored.load_state_dict(torch.load(saved, weights_only=False))

    assert restored.stats() == buffer.stats()
    assert [row["id"] for row in restored.peek(10)] == [row["id"] for row in buffer.peek(10)]
    # Queue order and use counts survived: "a" leaves after its second use, the others stay.
    taken = restored.take(10)
    assert ids(taken) == ids(buffer.take(10)) == ["b", "bf16", "a"]
    assert taken[1].log_probs.dtype == torch.bfloat16 and taken[2].info == {"text": "x"}
    assert restored.stats() == buffer.stats()
    assert restored.stats()["sampled"] == 1 and len(restored) == 2
    # Dedupe memory survived: "s" (dropped on arrival) and "a" (sampled) are recognised.
    result = restored.append([make(id="s", policy_version=6), make(id="a", policy_version=6),
                              make(id="new", policy_version=6)], 6)
    assert (result.duplicates, result.accepted) == (2, 1)
    with pytest.raises(ValueError, match="inconsistent"):
        CheckedBuffer().load_state_dict({**state, "queue": []})
    with pytest.raises(ValueError, match="format"):
        CheckedBuffer().load_state_dict({**state, "format": 99})


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(max_samples=0), "max_samples"),
        (dict(max_samples=2.5), "max_samples"),
        (dict(max_bytes=0), "max_bytes"),
        (dict(max_staleness=-1), "max_staleness"),
        (dict(max_staleness=True), "max_staleness"),
        (dict(max_reuse=0), "max_reuse"),
        (dict(overflow="drop"), "overflow"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(dedupe_window=-1), "dedupe_window"),
    ],
)
def test_constructor_validation_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ReplayBuffer(**kwargs)


def test_call_argument_validation():
    buffer = CheckedBuffer(max_samples=4)
    with pytest.raises(ValueError, match="count"):
        buffer.sample(0)
    with pytest.raises(ValueError, match="exceeds max_samples"):
        buffer.sample(5, timeout=1.0)
    with pytest.raises(ValueError, match="timeout"):
        buffer.sample(1, timeout=-1)
    with pytest.raises(ValueError, match="current_version"):
        buffer.append([make()], current_version=-1)
    with pytest.raises(RejectedPushError, match="expected an Experience"):
        buffer.append([make(), {"id": "x"}], 0)
    assert buffer.append([], 0) == AppendResult(0, 0, 0, 0, full=False, size=0, nbytes=0, current_version=0)


def test_wait_for_counts_available_after_dropping_stale():
    import threading

    buffer = ReplayBuffer(max_staleness=0)
    buffer.append([make(policy_version=0)], current_version=0)
    assert buffer.wait_for(1, current_version=0) == 1
    assert buffer.wait_for(1, current_version=1) == 0  # the version-0 sample is now stale
    assert buffer.stats()["dropped"]["stale"] == 1
    threading.Timer(0.05, lambda: buffer.append([make(policy_version=1)], current_version=1)).start()
    assert buffer.wait_for(1, current_version=1, timeout=5.0) == 1


def test_a_push_whose_optional_fields_differ_from_the_buffer_is_refused_naming_the_field():
    reference = torch.tensor([-0.5, -0.5])
    buffer = ReplayBuffer(max_samples=10)
    buffer.append([make(id="r0", ref_log_probs=reference)], current_version=0)
    with pytest.raises(RejectedPushError,
                       match="ref_log_probs: absent here but present on the buffer's samples") as info:
        buffer.append([make(id="r1")], current_version=0)
    assert info.value.field == "ref_log_probs" and len(buffer) == 1
    with pytest.raises(RejectedPushError, match="push's first"):
        ReplayBuffer(max_samples=10).append([make(id="r2"), make(id="r3", ref_log_probs=reference)],
                                            current_version=0)
    buffer.sample(1, current_version=0)  # drained: samples of another shape may start
    buffer.append([make(id="r4")], current_version=0)


def test_a_replay_buffer_checkpointed_with_minus_inf_reference_log_probs_still_loads():
    """Before the convention a reference could send -inf; such samples are refused now, but a checkpointed
    buffer holding them loads (restoring does not re-validate) and the trainers leave
    those tokens out of the KL."""
    buffer = ReplayBuffer()
    buffer.append([make(ref_log_probs=torch.tensor([-0.5, -1.0]))], 0)
    state = buffer.state_dict()
    state["samples"][0]["experience"]["ref_log_probs"] = torch.tensor([-0.5, float("-inf")])
    restored = ReplayBuffer()
    restored.load_state_dict(state)
    (sample,) = restored.sample(1, current_version=0)
    kl = masked_kl(sample.log_probs[None], sample.ref_log_probs[None], torch.ones(1, 2), "k3")
    assert bool(torch.isfinite(kl).all()) and float(kl[0, 1]) == 0.0
