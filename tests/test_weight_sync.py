"""Tests for detached_rl.weights.update: chunked, versioned, checksummed weight updates (no Ray)."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
import xxhash

from detached_rl.models import Critic, tiny_causal_lm
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import (
    TensorSpec,
    WeightManifest,
    WeightUpdate,
    WeightUpdateError,
    build_weight_update,
    state_fingerprint,
    tensor_checksum,
)

from .helpers import lane_device, model_device, state_snapshot, tiny_llama

CHUNK = 40_000  # bytes: the tiny llama (~0.5 MB) is cut into a dozen chunks
IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 2, 7], [3, 4, 100, 120, 8, 6, 5, 11]])
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


class Store:
    """In-process stand-in for the Ray object store: `put` snapshots a chunk, `fetch` looks it up."""

    def __init__(self) -> None:
        self.chunks: dict[str, dict[str, torch.Tensor]] = {}
        self.puts = 0
        self.fetches: Counter[str] = Counter()

    def put(self, chunk: dict[str, torch.Tensor]) -> str:
        key = f"chunk-{self.puts}"
        self.puts += 1
        self.chunks[key] = {name: tensor.clone() for name, tensor in chunk.items()}  # like ray.put
        return key

    def fetch(self, ref: str) -> dict[str, torch.Tensor]:
        self.fetches[ref] += 1
        return self.chunks[ref]


def assert_state_equal(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    current = model.state_dict()
    assert current.keys() == state.keys()
    for key, tensor in state.items():
        assert torch.equal(current[key], tensor), key


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS.to(model_device(model))).logits.cpu()


@pytest.fixture
def trainer() -> torch.nn.Module:
    return tiny_llama(seed=1)


@pytest.fixture
def maker() -> torch.nn.Module:
    return tiny_llama(seed=2)


def test_tensor_checksum_dtypes_and_one_element_change() -> None:
    for on_host in (torch.randn(5, 7), torch.randn(5, 7).to(torch.bfloat16), torch.arange(35).reshape(5, 7)):
        tensor = on_host.to(lane_device())
        assert tensor_checksum(tensor) == tensor_checksum(on_host)  # the bytes, wherever they are
        assert tensor_checksum(tensor) == tensor_checksum(tensor.clone())
        changed = tensor.clone()
        changed[3, 4] += 1
        assert tensor_checksum(changed) != tensor_checksum(tensor), tensor.dtype
        # A non-contiguous view checksums like its contiguous copy.
        assert tensor_checksum(tensor.t()) == tensor_checksum(tensor.t().contiguous())
    data = torch.randn(10)
    assert tensor_checksum(data) == xxhash.xxh3_64_intdigest(data.numpy().tobytes())
    assert tensor_checksum(torch.tensor(1.5)) == xxhash.xxh3_64_intdigest(torch.tensor(1.5).numpy().tobytes())
    assert tensor_checksum(torch.nn.Parameter(data)) == tensor_checksum(data)


def test_full_update_round_trip_over_several_chunks(trainer, maker) -> None:
    store = Store()
    update, stats = build_weight_update(
        {"actor": trainer.state_dict()}, version=1, put=store.put, chunk_bytes=CHUNK
    )
    manifest = update.manifest
    assert manifest.num_chunks > 3 and stats.chunks == manifest.num_chunks == len(update.chunk_refs)
    assert stats.bytes == manifest.total_bytes == sum(spec.nbytes for spec in manifest.tensors)
    assert manifest.tensors[0].name == "actor/model.embed_tokens.weight"
    assert not torch.equal(logits(trainer), logits(maker))

    receiver = WeightReceiver({"actor": maker})
    result = receiver.receive(update, store.fetch)
    assert result.applied and result.version == receiver.version == receiver.servable_version == 1
    assert (result.bytes, result.chunks) == (manifest.total_bytes, manifest.num_chunks)
    assert result.swap_seconds <= result.seconds and receiver.last_error is None
    assert_state_equal(maker, trainer.state_dict())
    assert torch.equal(logits(trainer), logits(maker))
    assert receiver.fingerprint == state_fingerprint({"actor": trainer.state_dict()})


def test_the_receiver_has_one_way_in_and_one_safe_point(trainer, maker) -> None:
    public = {name for name, value in vars(WeightReceiver).items()
              if callable(value) and not name.startswith("_")}
    assert public == {"receive", "serving", "expect_runs", "refresh_fingerprint"}
    store = Store()
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    receiver = WeightReceiver({"actor": maker})
    with pytest.raises(ValueError, match="swap must be one of"):
        receiver.receive(update, store.fetch, swap="later")
    assert store.fetches == {} and receiver.version == 0
    # Staged for the safe point while a batch holds the lock; `serving` swaps it in before the next batch.
    with receiver.lock:
        assert receiver.receive(update, store.fetch, swap="at_safe_point").staged
    assert receiver.version == 0 and receiver.pending_version == 1
    with receiver.serving() as version:
        assert version == 1 and receiver.pending_version is None
    assert_state_equal(maker, trainer.state_dict())


def test_each_chunk_put_once_for_three_receivers(trainer) -> None:
    store = Store()
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    assert store.puts == update.manifest.num_chunks
    makers = [tiny_llama(seed) for seed in (2, 3, 4)]
    for maker in makers:
        WeightReceiver({"actor": maker}).receive(update, store.fetch)
        assert_state_equal(maker, trainer.state_dict())
    assert store.puts == update.manifest.num_chunks
    assert store.fetches == {ref: 3 for ref in update.chunk_refs}


def test_chunk_byte_budget(trainer) -> None:
    sizes: list[tuple[int, int]] = []

    def put(chunk: dict[str, torch.Tensor]) -> int:
        sizes.append((len(chunk), sum(t.numel() * t.element_size() for t in chunk.values())))
        for tensor in chunk.values():
            assert tensor.is_contiguous() and not tensor.requires_grad
        return len(sizes) - 1

    update, _ = build_weight_update({"actor": trainer.named_parameters()}, 1, put, chunk_bytes=CHUNK)
    # The embedding and LM head (463 x 64 fp32) exceed the budget: each is a chunk of its own.
    assert (1, 463 * 64 * 4) in sizes
    for count, nbytes in sizes:
        assert nbytes <= CHUNK or count == 1
    for spec in update.manifest.tensors:
        assert sizes[spec.chunk][1] >= spec.nbytes
    # Greedy packing: two neighbouring chunks could not have been one.
    assert all(a[1] + b[1] > CHUNK for a, b in zip(sizes, sizes[1:], strict=False))


def test_tied_weights_travel_once() -> None:
    trainer, maker = (tiny_causal_lm("gpt2", seed=seed)[0].to(lane_device()) for seed in (1, 2))
    store = Store()
    update, stats = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    (alias,) = [spec for spec in update.manifest.tensors if spec.alias_of]
    assert (alias.name, alias.alias_of) == ("actor/lm_head.weight", "actor/transformer.wte.weight")
    assert stats.bytes == sum(spec.nbytes for spec in update.manifest.tensors if not spec.alias_of)
    assert all(alias.name not in chunk for chunk in store.chunks.values())
    WeightReceiver({"actor": maker}).receive(update, store.fetch)
    assert_state_equal(maker, trainer.state_dict())
    assert torch.equal(logits(trainer), logits(maker))


def test_same_version_is_noop_and_older_version_refused(trainer, maker) -> None:
    store = Store()
    receiver = WeightReceiver({"actor": maker}, version=5)
    same, _ = build_weight_update({"actor": trainer.state_dict()}, 5, store.put, chunk_bytes=CHUNK)
    before = state_snapshot(maker)
    result = receiver.receive(same, store.fetch)
    assert (result.applied, result.reason, receiver.version) == (False, "same version", 5)
    assert not store.fetches
    older, _ = build_weight_update({"actor": trainer.state_dict()}, 4, store.put, chunk_bytes=CHUNK)
    with pytest.raises(WeightUpdateError, match="stale version 4 < current 5") as error:
        receiver.receive(older, store.fetch)
    assert receiver.last_error is error.value and error.value.reason == str(error.value)
    assert isinstance(error.value, ValueError)
    assert_state_equal(maker, before)
    assert receiver.version == 5 and not store.fetches


def _state_with(trainer: torch.nn.Module, key: str, tensor: torch.Tensor | None) -> dict[str, torch.Tensor]:
    state = dict(trainer.state_dict())
    if tensor is None:
        del state[key]
    else:
        state[key] = tensor
    return state


def _corrupt(update: WeightUpdate, store: Store) -> str:
    """Change one element of a tensor in the store after it was put; return its name."""
    spec = next(spec for spec in update.manifest.tensors if spec.name.endswith(Q_PROJ))
    store.chunks[update.chunk_refs[spec.chunk]][spec.name][0, 0] += 1.0
    return f"chunk {spec.chunk} .*checksum mismatch for 'actor/{Q_PROJ}'"


def _drop_chunk(update: WeightUpdate, store: Store) -> str:
    del store.chunks[update.chunk_refs[2]]
    return "chunk 2 .*fetch failed: KeyError"


def _extra_tensor(update: WeightUpdate, store: Store) -> str:
    store.chunks[update.chunk_refs[1]]["actor/bogus"] = torch.zeros(3)
    return "chunk 1 .*unexpected tensor 'actor/bogus'"


def _missing_tensor(update: WeightUpdate, store: Store) -> str:
    chunk = store.chunks[update.chunk_refs[3]]
    name = next(iter(chunk))
    del chunk[name]
    return f"chunk 3 .*lacks tensor '{name}'"


def _wrong_tensor_shape(update: WeightUpdate, store: Store) -> str:
    chunk = store.chunks[update.chunk_refs[3]]
    name = next(iter(chunk))
    chunk[name] = chunk[name].reshape(-1)
    return f"chunk 3 .*'{name}' is"


@pytest.mark.parametrize(
    "state, message",
    [
        (lambda t: _state_with(t, "extra.weight", torch.zeros(2)), "unknown key 'actor/extra.weight'"),
        (lambda t: _state_with(t, "lm_head.weight", None), "full update lacks key 'actor/lm_head.weight'"),
        (
            lambda t: _state_with(t, Q_PROJ, torch.zeros(64, 32)),
            rf"shape mismatch for 'actor/{Q_PROJ}': update \(64, 32\) vs model \(64, 64\)",
        ),
        (
            lambda t: _state_with(t, Q_PROJ, t.state_dict()[Q_PROJ].to(torch.bfloat16)),
            f"dtype mismatch for 'actor/{Q_PROJ}': update torch.bfloat16 vs model torch.float32",
        ),
    ],
    ids=["unknown-key", "missing-key", "wrong-shape", "wrong-dtype"],
)
def test_bad_manifest_refused_before_fetching(trainer, maker, state, message) -> None:
    store = Store()
    update, _ = build_weight_update({"actor": state(trainer)}, 1, store.put, chunk_bytes=CHUNK)
    _assert_refused(maker, update, store.fetch, message)
    assert not store.fetches


def test_unknown_model_and_wrong_ref_count_refused(trainer, maker) -> None:
    store = Store()
    update, _ = build_weight_update({"critic": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    _assert_refused(maker, update, store.fetch, "unknown model 'critic'")
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    short = WeightUpdate(update.manifest, update.chunk_refs[:-1])
    n = update.manifest.num_chunks
    _assert_refused(maker, short, store.fetch, f"manifest has {n} chunks but {n - 1} chunk refs")
    assert not store.fetches


@pytest.mark.parametrize(
    "damage",
    [_corrupt, _drop_chunk, _extra_tensor, _missing_tensor, _wrong_tensor_shape],
    ids=["bad-checksum", "missing-chunk", "extra-tensor", "missing-tensor", "wrong-tensor-shape"],
)
@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_bad_chunk_refused(trainer, maker, damage, mode) -> None:
    store = Store()
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    message = damage(update, store)
    if mode == "staged":
        _assert_refused(maker, update, store.fetch, message)
    else:
        receiver = WeightReceiver({"actor": maker}, mode="in_place")
        with pytest.raises(WeightUpdateError, match=message):
            receiver.receive(update, store.fetch)
        assert receiver.version == 0


def test_fetch_timeout_refused(trainer, maker) -> None:
    store = Store()
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)

    def slow_fetch(ref: str) -> dict[str, torch.Tensor]:
        time.sleep(0.03)
        return store.fetch(ref)

    _assert_refused(maker, update, slow_fetch, r"chunk \d+ \(of \d+\): timed out", timeout=0.1)
    assert 1 <= sum(store.fetches.values()) < update.manifest.num_chunks  # stopped before the end


def _assert_refused(maker, update, fetch, message: str, timeout: float | None = None) -> None:
    """Apply must raise naming the problem, and leave weights, version and fingerprint as they were."""
    receiver = WeightReceiver({"actor": maker})
    before, fingerprint = state_snapshot(maker), receiver.fingerprint
    with pytest.raises(WeightUpdateError, match=message) as error:
        receiver.receive(update, fetch, timeout=timeout)
    assert receiver.last_error is error.value
    assert_state_equal(maker, before)
    assert (receiver.version, receiver.consistent, receiver.fingerprint) == (0, True, fingerprint)
    assert receiver.refresh_fingerprint() == fingerprint


def test_cast_dtype_float32_to_bfloat16(trainer) -> None:
    maker = tiny_llama(seed=2, dtype=torch.bfloat16)
    store = Store()
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    with pytest.raises(WeightUpdateError, match=r"dtype mismatch .*\(no cast_dtype set\)"):
        WeightReceiver({"actor": maker}).receive(update, store.fetch)
    receiver = WeightReceiver({"actor": maker}, cast_dtype=torch.bfloat16)
    assert receiver.receive(update, store.fetch).applied
    assert_state_equal(maker, {key: t.to(torch.bfloat16) for key, t in trainer.state_dict().items()})
    assert receiver.fingerprint == state_fingerprint({"actor": maker.state_dict()})


def test_multi_model_update_and_partial_lora_kind() -> None:
    def critic(seed: int) -> Critic:
        torch.manual_seed(seed)
        return Critic(tiny_llama(seed).model)

    trainer_models = {"actor": tiny_llama(1), "critic": critic(1)}
    maker_models = {"actor": tiny_llama(2), "critic": critic(2)}
    store = Store()
    states = {name: model.state_dict() for name, model in trainer_models.items()}
    update, _ = build_weight_update(states, 1, store.put, chunk_bytes=CHUNK)
    receiver = WeightReceiver(maker_models)
    receiver.receive(update, store.fetch)
    for name in states:
        assert_state_equal(maker_models[name], states[name])
    assert receiver.fingerprint == state_fingerprint(states)

    # A "lora"-kind update may carry a subset of keys; the rest stays as it is.
    with torch.no_grad():
        trainer_models["critic"].head.weight.add_(0.01)  # a step's worth (within max_weight_change)
    head = {"critic": {"head.weight": trainer_models["critic"].head.weight}}
    partial, _ = build_weight_update(head, 2, store.put, kind="lora", metadata={"r": 4})
    assert partial.manifest.metadata == {"r": 4} and partial.manifest.num_chunks == 1
    full_subset, _ = build_weight_update(head, 2, store.put, kind="full")
    with pytest.raises(WeightUpdateError, match="full update lacks key 'critic/"):
        receiver.receive(full_subset, store.fetch)
    receiver.receive(partial, store.fetch)
    assert receiver.version == 2
    assert_state_equal(maker_models["critic"], trainer_models["critic"].state_dict())
    assert receiver.fingerprint == state_fingerprint(
        {name: m.state_dict() for name, m in trainer_models.items()}
    )


def test_in_place_applies_and_failing_chunk_marks_inconsistent(trainer, maker) -> None:
    store = Store()
    lock = threading.Lock()
    receiver = WeightReceiver({"actor": maker}, mode="in_place", lock=lock)

    def fetch(ref: str) -> dict[str, torch.Tensor]:
        assert lock.locked()  # in_place: generation pauses for the whole update
        return store.fetch(ref)

    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    result = receiver.receive(update, fetch)
    assert result.applied and result.swap_seconds == result.fetch_seconds
    assert_state_equal(maker, trainer.state_dict())
    assert receiver.fingerprint == state_fingerprint({"actor": trainer.state_dict()})

    with torch.no_grad():
        for param in trainer.parameters():
            param.mul_(2.0)
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 2, store.put, chunk_bytes=CHUNK)
    lost = store.chunks.pop(update.chunk_refs[2])
    with pytest.raises(WeightUpdateError, match="chunk 2 .*KeyError"):
        receiver.receive(update, fetch)
    assert not receiver.consistent and receiver.version == 1
    with pytest.raises(WeightUpdateError, match="half-updated"):
        receiver.servable_version  # noqa: B018
    # Chunk 0 was written, chunk 3 was not: the model is a mix of versions 1 and 2.
    first = update.manifest.tensors[0].name.partition("/")[2]
    last = update.manifest.tensors[-1].name.partition("/")[2]
    assert torch.equal(maker.state_dict()[first], trainer.state_dict()[first])
    assert not torch.equal(maker.state_dict()[last], trainer.state_dict()[last])
    assert receiver.fingerprint == state_fingerprint({"actor": maker.state_dict()})

    store.chunks[update.chunk_refs[2]] = lost  # a retry of the same version goes through
    assert receiver.receive(update, fetch).applied
    assert receiver.consistent and receiver.servable_version == 2
    assert_state_equal(maker, trainer.state_dict())


def test_staged_fetch_runs_without_the_lock(trainer, maker) -> None:
    store = Store()
    lock = threading.Lock()
    receiver = WeightReceiver({"actor": maker}, lock=lock)
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    in_fetch, go_on = threading.Event(), threading.Event()
    results = []

    def blocking_fetch(ref: str) -> dict[str, torch.Tensor]:
        in_fetch.set()
        assert go_on.wait(5)
        return store.fetch(ref)

    worker = threading.Thread(target=lambda: results.append(receiver.receive(update, blocking_fetch)))
    worker.start()
    assert in_fetch.wait(5)
    # A generation batch can run while the update is being fetched.
    assert lock.acquire(timeout=2)
    lock.release()
    go_on.set()
    worker.join(5)
    assert results and results[0].applied
    assert_state_equal(maker, trainer.state_dict())


def test_generation_holding_the_lock_delays_only_the_swap(trainer, maker) -> None:
    store = Store()
    lock = threading.Lock()
    receiver = WeightReceiver({"actor": maker}, lock=lock)
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    before = state_snapshot(maker)
    results = []
    with lock:  # a generation batch in progress
        worker = threading.Thread(target=lambda: results.append(receiver.receive(update, store.fetch)))
        worker.start()
        deadline = time.monotonic() + 5
        while sum(store.fetches.values()) < update.manifest.num_chunks and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.1)
        # Everything is fetched, but the batch still sees the old weights and version.
        assert_state_equal(maker, before)
        assert receiver.version == 0
    worker.join(5)
    (result,) = results
    assert result.lock_wait_seconds >= 0.05 and result.swap_seconds < result.lock_wait_seconds
    assert receiver.version == 1
    assert_state_equal(maker, trainer.state_dict())


def test_lock_wait_counts_against_timeout(trainer, maker) -> None:
    store = Store()
    lock = threading.Lock()
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 1, store.put, chunk_bytes=CHUNK)
    receiver = WeightReceiver({"actor": maker}, lock=lock)
    before = state_snapshot(maker)
    with lock, pytest.raises(WeightUpdateError, match="v1: timed out waiting for the generation lock"):
        receiver.receive(update, store.fetch, timeout=0.2)
    assert_state_equal(maker, before)
    assert receiver.version == 0


def test_fingerprint_changes_iff_weights_change(trainer, maker) -> None:
    store = Store()
    receiver = WeightReceiver({"actor": maker})
    initial = receiver.fingerprint
    assert initial == state_fingerprint({"actor": maker.state_dict()})
    assert initial != state_fingerprint({"actor": trainer.state_dict()})
    receiver.receive(build_weight_update({"actor": trainer.state_dict()}, 1, store.put)[0], store.fetch)
    after_v1 = receiver.fingerprint
    assert after_v1 != initial
    receiver.receive(build_weight_update({"actor": trainer.state_dict()}, 2, store.put)[0], store.fetch)
    assert receiver.version == 2 and receiver.fingerprint == after_v1  # same weights, same fingerprint
    with torch.no_grad():
        trainer.state_dict()[Q_PROJ][0, 0] += 1.0
    receiver.receive(build_weight_update({"actor": trainer.state_dict()}, 3, store.put)[0], store.fetch)
    assert receiver.fingerprint not in (after_v1, initial)
    assert receiver.fingerprint == state_fingerprint({"actor": trainer.state_dict()})
    # Weights changed behind the receiver's back show up after a refresh.
    with torch.no_grad():
        maker.state_dict()[Q_PROJ][0, 0] += 1.0
    assert receiver.refresh_fingerprint() == state_fingerprint({"actor": maker.state_dict()})


def test_manifest_and_update_are_picklable(trainer) -> None:
    import pickle

    store = Store()
    update, _ = build_weight_update({"actor": trainer.state_dict()}, 7, store.put, metadata={"base": "abc"})
    copy = pickle.loads(pickle.dumps(update))
    assert copy == update and isinstance(copy.manifest, WeightManifest)
    assert isinstance(copy.manifest.tensors[0], TensorSpec) and copy.version == 7
    with pytest.raises(ValueError, match="kind"):
        build_weight_update({"actor": trainer.state_dict()}, 1, store.put, kind="sparse")


def test_after_swap_hook_runs_under_the_lock_with_the_written_names():
    from detached_rl.models import tiny_causal_lm as _tiny

    trainer_model, maker_model = (_tiny("llama", seed=seed)[0].to(lane_device()) for seed in (1, 2))
    calls = []
    receiver = WeightReceiver({"actor": maker_model})
    receiver.after_swap = lambda names: calls.append((receiver.lock.locked(), names))
    store = {}

    def put(chunk):
        store[len(store)] = chunk
        return len(store) - 1

    update, _ = build_weight_update({"actor": trainer_model.state_dict()}, 1, put, chunk_bytes=20_000)
    receiver.receive(update, store.__getitem__)
    assert len(calls) == 1 and calls[0][0] is True
    assert calls[0][1] == {f"actor/{k}" for k in trainer_model.state_dict()}


def test_a_resumed_trainer_run_may_roll_makers_back_with_a_full_update_as_a_reset_only():
    store, maker = Store(), tiny_llama(seed=1)
    receiver = WeightReceiver({"actor": maker})
    first_run = tiny_llama(seed=2)
    update, _ = build_weight_update({"actor": first_run.state_dict()}, 5, store.put,
                                    metadata={"trainer_run": "a"})
    receiver.receive(update, store.fetch)
    assert (receiver.version, receiver.trainer_run) == (5, "a")

    stale, _ = build_weight_update({"actor": first_run.state_dict()}, 3, store.put,
                                   metadata={"trainer_run": "a"})
    with pytest.raises(WeightUpdateError, match="stale version 3 < current 5"):
        receiver.receive(stale, store.fetch)
    resumed = tiny_llama(seed=3)  # resumed from its step-3 checkpoint in a new process
    lora_like, _ = build_weight_update({"actor": {Q_PROJ: resumed.state_dict()[Q_PROJ]}}, 3, store.put,
                                       kind="lora",
                                       metadata={"trainer_run": "b"})
    with pytest.raises(WeightUpdateError, match="trainer_run 'b' is not the trainer run"):
        # A push: only a reset (registering again) may change the run.
        receiver.receive(lora_like, store.fetch)
    with pytest.raises(WeightUpdateError, match="lora update cannot start.*no verified base provides"):
        receiver.receive(lora_like, store.fetch, reset=True)
    assert (receiver.version, receiver.trainer_run) == (5, "a")
    assert_state_equal(maker, first_run.state_dict())

    rollback, _ = build_weight_update({"actor": resumed.state_dict()}, 3, store.put,
                                      metadata={"trainer_run": "b"})
    assert receiver.receive(rollback, store.fetch, reset=True).applied
    assert (receiver.version, receiver.trainer_run) == (3, "b")
    assert_state_equal(maker, resumed.state_dict())


def test_state_fingerprint_takes_a_lazy_stream_of_tensors() -> None:
    state = tiny_causal_lm("llama", seed=2)[0].state_dict()
    produced = []

    def stream():
        for key, tensor in state.items():
            produced.append(key)
            yield key, tensor.to(torch.bfloat16)

    expected = state_fingerprint({"actor": {k: t.to(torch.bfloat16) for k, t in state.items()}})
    assert state_fingerprint({"actor": stream()}) == expected and produced == list(state)
    assert expected != state_fingerprint({"actor": state})
