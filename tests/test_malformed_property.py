"""Property tests: generated malformed experiences and weight updates thrown at the real ReplayBuffer and
WeightReceiver are all refused with a message, crash nothing and change no state (no Ray)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detached_rl import Experience, ReplayBuffer
from detached_rl.core.replay_buffer import RejectedPushError
from detached_rl.models import LoraSettings, apply_lora, tiny_causal_lm
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import (
    WeightUpdate,
    WeightUpdateError,
    build_weight_update,
    state_fingerprint,
)

from .helpers import ObjectStore, lane_device, make_experience

VOCAB = 100
MAX_SEQUENCE = 64
CURRENT_VERSION = 3
EXAMPLES = 600  # per test: 1,200 malformed messages in all
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# ---------------------------------------------------------------- experiences

FLOAT_FIELDS = ("log_probs", "reward", "values", "ref_log_probs", "advantages", "returns")
ID_FIELDS = ("prompt_ids", "response_ids")
BAD_FLOATS = (math.nan, math.inf, -math.inf)


def valid_experience(data: st.DataObject, index: int) -> Experience:
    length = data.draw(st.integers(1, 6), label="response length")
    return make_experience(
        prompt=data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), label="prompt"),
        response=data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length),
                           label="response"),
        log_probs=-torch.rand(length), reward=data.draw(st.floats(-5, 5), label="reward"),
        values=torch.zeros(length), ref_log_probs=-torch.rand(length), advantages=torch.randn(length),
        returns=torch.randn(length),
        policy_version=data.draw(st.integers(0, CURRENT_VERSION), label="version"),
        maker="maker_0", id=f"sample-{index}-{data.draw(st.integers(0, 10**9), label='id')}",
    )


def corrupt(data: st.DataObject, exp: Experience) -> str:
    """Make `exp` malformed in one drawn way; returns the field the refusal must name."""
    kind = data.draw(st.sampled_from([
        "ids_dtype", "ids_shape", "ids_empty", "ids_negative", "ids_vocab", "float_nan", "float_dtype",
        "float_length", "float_2d", "positive_log_prob", "not_tensor", "version_future", "version_negative",
        "version_type", "bad_id", "maker_type", "group_type", "info_type", "unknown_field", "oversize_info",
        "oversize_sequence",
    ]), label="corruption")
    length = exp.response_length
    if kind.startswith("ids_"):
        name = data.draw(st.sampled_from(ID_FIELDS), label="field")
        ids = getattr(exp, name)
        setattr(exp, name, {
            "ids_dtype": lambda: ids.float(), "ids_shape": lambda: ids.reshape(1, -1),
            "ids_empty": lambda: ids[:0], "ids_negative": lambda: ids - VOCAB,
            "ids_vocab": lambda: ids + VOCAB,
        }[kind]())
        return name
    if kind.startswith("float_") or kind == "not_tensor":
        name = data.draw(st.sampled_from(FLOAT_FIELDS), label="field")
        value = getattr(exp, name)
        if kind == "float_nan":
            value = value.clone().reshape(-1) if value.dim() else value.clone().reshape(1)
            value[data.draw(st.integers(0, value.numel() - 1))] = data.draw(st.sampled_from(BAD_FLOATS))
            value = value.reshape(getattr(exp, name).shape)
        elif kind == "float_dtype":
            value = value.long()
        elif kind == "float_length":
            extra = data.draw(st.integers(1, 3))
            value = torch.zeros(length + extra)
        elif kind == "float_2d":
            value = torch.zeros(length, 2)
        else:
            value = data.draw(st.sampled_from([None, 1.5, [0.0] * length, "x"])) if name != "values" else "x"
            if value is None:
                value = "x"
        setattr(exp, name, value)
        return name
    if kind == "positive_log_prob":
        exp.log_probs = exp.log_probs.clone()
        exp.log_probs[0] = data.draw(st.floats(0.01, 50))
        return "log_probs"
    if kind.startswith("version_"):
        exp.policy_version = {"version_future": CURRENT_VERSION + data.draw(st.integers(1, 100)),
                              "version_negative": -data.draw(st.integers(1, 100)),
                              "version_type": data.draw(st.sampled_from([1.0, "3", True, None]))}[kind]
        return "policy_version"
    if kind == "bad_id":
        exp.id = data.draw(st.sampled_from(["", None, 7, b"id"]))
        return "id"
    if kind == "maker_type":
        exp.maker = data.draw(st.sampled_from([None, 0, ["m"]]))
        return "maker"
    if kind == "group_type":
        exp.group_id = data.draw(st.sampled_from([0, ["g"], b"g"]))
        return "group_id"
    if kind == "info_type":
        exp.info = data.draw(st.sampled_from([None, [], "text", 1]))
        return "info"
    if kind == "unknown_field":
        name = data.draw(st.sampled_from(["advantage", "prompt", "weights", "extra"]))
        object.__setattr__(exp, name, torch.zeros(length))
        return name
    if kind == "oversize_sequence":
        exp.prompt_ids = torch.ones(MAX_SEQUENCE + data.draw(st.integers(0, 50)), dtype=torch.long)
        return "response_ids"
    exp.info = {"text": "x" * data.draw(st.integers(70_000, 200_000))}
    return "info"


def buffer_state(buffer: ReplayBuffer) -> tuple:
    stats = buffer.stats()
    stats.pop("rejected_invalid", None)
    counts = {k: v for k, v in stats.items() if k != "counts"}
    return repr(counts), [e.id for e in buffer.experiences()]


@pytest.fixture(scope="module")
def buffer() -> ReplayBuffer:
    buffer = ReplayBuffer(max_samples=64, max_staleness=8, vocab_size=VOCAB, max_sequence_length=MAX_SEQUENCE)
    # With every optional field, as the generated pushes: samples of one buffer carry the same fields.
    seed = [make_experience(prompt=(1, 2), response=(3, 4), maker="maker_0", id=f"seed-{i}",
                            values=torch.zeros(2),
                            ref_log_probs=-torch.ones(2), advantages=torch.zeros(2), returns=torch.zeros(2))
            for i in range(4)]
    buffer.append(seed, current_version=CURRENT_VERSION)
    return buffer


@SETTINGS
@given(data=st.data())
def test_malformed_experience_is_refused_naming_the_field_and_changes_nothing(buffer, data):
    before = buffer_state(buffer)
    push = [valid_experience(data, i) for i in range(data.draw(st.integers(0, 3), label="valid before"))]
    bad = valid_experience(data, len(push))
    field = corrupt(data, bad)
    push.insert(data.draw(st.integers(0, len(push)), label="position"), bad)
    with pytest.raises(RejectedPushError) as refused:
        buffer.append(push, current_version=CURRENT_VERSION)
    assert refused.value.field == field and field in str(refused.value)
    assert buffer_state(buffer) == before
    assert buffer.stats()["accounting_ok"]


# ---------------------------------------------------------------- weight updates


@pytest.fixture(scope="module")
def receivers():
    """A full-weights receiver and a LoRA (peft, r=4) receiver, each at version CURRENT_VERSION, with their
    models on the test device (the updates arrive on the CPU, as from the object store)."""
    full = tiny_causal_lm("llama", seed=1)[0].to(lane_device())
    lora = apply_lora(tiny_causal_lm("llama", seed=1)[0], LoraSettings(r=4, alpha=8)).to(lane_device())
    out = {}
    for kind, model in (("full", full), ("lora", lora)):
        receiver = WeightReceiver({"actor": model}, version=CURRENT_VERSION, trainer_run="run-a")
        out[kind] = receiver
    return out


def good_update(store: ObjectStore, kind: str, version: int) -> WeightUpdate:
    if kind == "full":
        state = tiny_causal_lm("llama", seed=2)[0].state_dict()
    else:
        lora = apply_lora(tiny_causal_lm("llama", seed=2)[0], LoraSettings(r=4, alpha=8))
        state = {k: p.detach() for k, p in lora.named_parameters() if p.requires_grad}
    update, _ = build_weight_update({"actor": state}, version, store.put, chunk_bytes=60_000, kind=kind,
                                    metadata={"trainer_run": "run-a"})
    return update


def corrupt_update(data: st.DataObject, store: ObjectStore, kind: str) -> WeightUpdate:
    update = good_update(store, kind, CURRENT_VERSION + 1)
    manifest = update.manifest
    specs = list(manifest.tensors)
    refs = list(update.chunk_refs)
    what = data.draw(st.sampled_from([
        "missing_key", "unknown_key", "shape", "dtype", "checksum", "missing_chunk", "extra_chunk", "stale",
        "chunk_tensor_shape", "chunk_tensor_values", "chunk_missing_key", "bad_kind", "lora_rank", "nbytes",
        "unfetchable",
    ]), label="corruption")
    index = data.draw(st.integers(0, len(specs) - 1), label="tensor")
    spec = specs[index]
    version = manifest.version
    if what == "missing_key":
        specs.pop(index)
    elif what == "unknown_key":
        specs.append(dataclasses.replace(spec, name=f"actor/not.a.{data.draw(st.integers(0, 99))}.weight"))
    elif what == "shape":
        specs[index] = dataclasses.replace(spec, shape=(*spec.shape, 2))
    elif what == "dtype":
        specs[index] = dataclasses.replace(spec, dtype=data.draw(st.sampled_from(["torch.int64", "torch.bool",
                                                                                  "float17"])))
    elif what == "checksum":
        specs[index] = dataclasses.replace(spec, checksum=spec.checksum ^ data.draw(st.integers(1, 2**32)))
    elif what == "nbytes":
        specs[index] = dataclasses.replace(spec, nbytes=spec.nbytes + data.draw(st.integers(1, 64)))
    elif what == "missing_chunk":
        refs.pop(data.draw(st.integers(0, len(refs) - 1)))
    elif what == "extra_chunk":
        refs.append(refs[0])
    elif what == "stale":
        version = CURRENT_VERSION - data.draw(st.integers(1, CURRENT_VERSION))
    elif what == "bad_kind":
        return WeightUpdate(dataclasses.replace(manifest, kind="delta"), refs)
    elif what == "lora_rank":
        if kind != "lora":
            specs.pop(index)
        else:  # the adapter of a rank-8 model sent to a rank-4 one
            return good_lora_of_rank(store, 8)
    elif what == "unfetchable":
        refs[data.draw(st.integers(0, len(refs) - 1))] = "no-such-ref"
    else:
        chunk_index = spec.chunk
        chunk = dict(store.fetch(refs[chunk_index]))
        name = spec.name
        if what == "chunk_tensor_shape":
            chunk[name] = torch.zeros(chunk[name].numel() + 1)
        elif what == "chunk_tensor_values":
            chunk[name] = chunk[name].clone()
            chunk[name].view(-1)[0] += 1.0
        else:
            chunk.pop(name)
        refs[chunk_index] = store.put(chunk)
    return WeightUpdate(dataclasses.replace(manifest, version=version, tensors=tuple(specs), num_chunks=(
        manifest.num_chunks if what not in ("missing_chunk", "extra_chunk") else manifest.num_chunks)), refs)


def good_lora_of_rank(store: ObjectStore, rank: int) -> WeightUpdate:
    lora = apply_lora(tiny_causal_lm("llama", seed=2)[0], LoraSettings(r=rank, alpha=2 * rank))
    state = {k: p.detach() for k, p in lora.named_parameters() if p.requires_grad}
    return build_weight_update({"actor": state}, CURRENT_VERSION + 1, store.put, kind="lora",
                               metadata={"trainer_run": "run-a"})[0]


@SETTINGS
@given(data=st.data())
def test_malformed_weight_update_is_refused_whole_and_the_maker_keeps_its_version(receivers, data):
    kind = data.draw(st.sampled_from(["full", "lora"]), label="receiver")
    receiver = receivers[kind]
    store = ObjectStore()
    fingerprint = state_fingerprint({"actor": receiver.models["actor"].state_dict()})
    update = corrupt_update(data, store, kind)

    def fetch(ref):
        if ref not in store.objects:
            raise KeyError(f"chunk {ref!r} is gone")
        return store.fetch(ref)

    with pytest.raises(WeightUpdateError) as refused:
        receiver.receive(update, fetch, timeout=30)
    assert str(refused.value)
    assert receiver.version == CURRENT_VERSION and receiver.consistent
    assert state_fingerprint({"actor": receiver.models["actor"].state_dict()}) == fingerprint
