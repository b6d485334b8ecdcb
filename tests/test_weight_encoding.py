"""Compact encodings (`weights.encoding`): updates in a maker's serving dtype and sparse deltas are exact:
the weights a maker stores after them equal, bit for bit, those it stores after the plain fp32 full update."""

import dataclasses

import pytest
import torch

from detached_rl.weights.encoding import INDICES, MASK, VALUES, Snapshot, build_variants, encode_sparse
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import (
    NonFiniteWeightsError,
    OffTrainerError,
    WeightUpdate,
    WeightUpdateError,
    tensor_checksum,
)

from .helpers import tiny_llama
from .test_weight_sync import Q_PROJ, Store

CHUNK = 40_000
BF16 = torch.bfloat16


def adamw_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on a next-token loss over random ids (moves every trainable weight a little)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (2, 12), generator=generator).to(next(model.parameters()).device)
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


class Trainer:
    """A tiny fp32 llama and the updates built from it, version by version, as a trainer builds them."""

    def __init__(self, lr: float) -> None:
        self.model = tiny_llama(seed=1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.store = Store()
        self.version = 0
        self.snapshot: Snapshot | None = None

    def build(self) -> tuple[WeightUpdate, WeightUpdate, WeightUpdate | None]:
        """This version's fp32 full update, its bf16 one and (from the second on) its bf16 delta."""
        variants = build_variants({"actor": self.model.state_dict()}, self.version, self.store.put, CHUNK,
                                  "full", {"trainer_run": "run"}, ["bfloat16"],
                                  {} if self.snapshot is None else {"bfloat16": self.snapshot}, snapshot=True)
        self.snapshot = variants.snapshots["bfloat16"]
        delta = variants.deltas.get("bfloat16")
        return variants.native[0], variants.cast["bfloat16"][0], None if delta is None else delta[0]

    def step(self, seed: int) -> None:
        adamw_step(self.model, self.optimizer, seed)
        self.version += 1


def bf16_receiver(mode: str = "staged") -> WeightReceiver:
    """A maker's receiver over a bf16 model that casts incoming weights (`maker.weight_cast_dtype`)."""
    return WeightReceiver({"actor": tiny_llama(seed=2, dtype=BF16)}, cast_dtype=BF16, mode=mode, version=-1)


def assert_same_weights(a: WeightReceiver, b: WeightReceiver) -> None:
    state_a, state_b = a.sinks["actor"].state(), b.sinks["actor"].state()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert state_a[key].dtype == state_b[key].dtype and torch.equal(
            state_a[key].view(torch.int16) if state_a[key].dtype == BF16 else state_a[key],
            state_b[key].view(torch.int16) if state_b[key].dtype == BF16 else state_b[key]), key
    assert a.fingerprint == b.fingerprint == a.refresh_fingerprint() == b.refresh_fingerprint()


def test_an_update_in_the_serving_dtype_gives_the_weights_of_the_fp32_update() -> None:
    trainer = Trainer(lr=5e-4)
    plain, cast = bf16_receiver(), bf16_receiver()
    for step in range(2):
        native, bf16, _ = trainer.build()
        assert bf16.manifest.metadata["wire_dtype"] == "bfloat16"
        assert {spec.dtype for spec in bf16.manifest.tensors} == {"torch.bfloat16"}
        assert bf16.manifest.total_bytes * 2 == native.manifest.total_bytes
        plain.receive(native, trainer.store.fetch, reset=step == 0)
        result = cast.receive(bf16, trainer.store.fetch, reset=step == 0)
        assert result.bytes == bf16.manifest.total_bytes
        assert_same_weights(plain, cast)
        trainer.step(seed=step)
    # A maker that stores fp32 (but casts, e.g. a bf16 critic next to it) must not take bf16 for its fp32
    # tensors: it would not hold what the full update gives it.
    wide = WeightReceiver({"actor": tiny_llama(seed=2)}, cast_dtype=BF16, version=-1)
    assert wide.serving_dtype == "float32" and cast.serving_dtype == "bfloat16"
    with pytest.raises(WeightUpdateError, match=r"'actor/.*' is stored here as torch.float32: an update sent "
                                                r"in torch.bfloat16 \(wire_dtype bfloat16\)"):
        wide.receive(trainer.build()[1], trainer.store.fetch, reset=True)


@pytest.mark.parametrize("mode", ["staged", "in_place"])
@pytest.mark.parametrize("lr", [5e-4, 1e-6])
def test_sparse_deltas_give_the_weights_of_the_fp32_updates(mode: str, lr: float) -> None:
    trainer = Trainer(lr=lr)
    plain, delta = bf16_receiver(mode), bf16_receiver(mode)
    native, bf16, none = trainer.build()
    assert none is None  # no base yet
    plain.receive(native, trainer.store.fetch, reset=True)
    delta.receive(bf16, trainer.store.fetch, reset=True)
    sparse = 0
    for step in range(3):
        trainer.step(seed=step)
        native, bf16, update = trainer.build()
        assert update.manifest.kind == "delta" and update.manifest.metadata["delta_base"]["version"] == step
        sparse += sum(spec.encoding != "dense" for spec in update.manifest.tensors)
        assert update.manifest.total_bytes <= bf16.manifest.total_bytes
        plain.receive(native, trainer.store.fetch)
        result = delta.receive(update, trainer.store.fetch)
        assert result.applied and delta.version == step + 1 and delta.last_full_version == step + 1
        assert_same_weights(plain, delta)
    assert sparse > 0
    if lr == 1e-6:  # a tiny step changes few bf16 values: the delta is a fraction of the bf16 update
        assert update.manifest.total_bytes < bf16.manifest.total_bytes / 4


def test_a_delta_on_another_base_is_refused_before_anything_is_fetched() -> None:
    trainer = Trainer(lr=1e-6)
    receiver = bf16_receiver()
    receiver.receive(trainer.build()[1], trainer.store.fetch, reset=True)  # holds v0
    trainer.step(seed=0)
    trainer.build()  # v1: this maker never got it
    trainer.step(seed=1)
    update = trainer.build()[2]  # v2 against v1
    before = {key: tensor.clone() for key, tensor in receiver.sinks["actor"].state().items()}
    trainer.store.fetches.clear()
    with pytest.raises(OffTrainerError, match=r"v2: a delta against v1 \(model 'actor' base fingerprint "
                                              r"[0-9a-f]{16}\) does not apply: this maker holds v0"):
        receiver.receive(update, trainer.store.fetch)
    assert not trainer.store.fetches and receiver.version == 0
    for key, tensor in receiver.sinks["actor"].state().items():
        assert torch.equal(tensor, before[key])


def test_a_delta_behind_a_waiting_update_is_built_on_it() -> None:
    trainer = Trainer(lr=1e-6)
    plain, receiver = bf16_receiver(), bf16_receiver()
    for target in (plain, receiver):
        target.receive(trainer.build()[1], trainer.store.fetch, reset=True)  # v0
    trainer.step(seed=0)
    native1, bf16_1, _ = trainer.build()
    trainer.step(seed=1)
    native2, _, delta2 = trainer.build()  # v2 against v1
    plain.receive(native1, trainer.store.fetch)
    plain.receive(native2, trainer.store.fetch)
    with receiver.lock:  # a batch is being generated: v1 waits for its end
        assert receiver.receive(bf16_1, trainer.store.fetch, swap="at_safe_point").staged
        assert receiver.pending_version == 1 and receiver.version == 0
        result = receiver.receive(delta2, trainer.store.fetch, swap="at_safe_point")
        assert result.staged and receiver.pending_version == 2 and receiver.superseded == 1
    with receiver.serving() as version:
        assert version == 2
    assert_same_weights(plain, receiver)


def test_a_delta_on_the_served_base_is_refused_while_another_update_waits() -> None:
    trainer = Trainer(lr=1e-6)
    receiver = bf16_receiver()
    receiver.receive(trainer.build()[1], trainer.store.fetch, reset=True)  # v0
    served = trainer.snapshot
    trainer.step(seed=0)
    bf16_1 = trainer.build()[1]
    trainer.step(seed=1)
    trainer.snapshot = served
    delta2 = trainer.build()[2]  # v2 against v0, which is served while v1 waits
    with receiver.lock:
        receiver.receive(bf16_1, trainer.store.fetch, swap="at_safe_point")
        with pytest.raises(OffTrainerError, match="a delta against v0 .* this maker holds v1"):
            receiver.receive(delta2, trainer.store.fetch, swap="at_safe_point")
        assert receiver.pending_version == 1  # the waiting update is kept
    with receiver.serving() as version:
        assert version == 1


def _tampered(update: WeightUpdate, store: Store, name: str, part: str, value: object,
              checksum: int | None = None) -> WeightUpdate:
    """`update` with one part of a sparse tensor replaced in its (copied) chunk, and maybe its checksum."""
    spec = next(spec for spec in update.manifest.tensors if spec.name == name)
    ref = update.chunk_refs[spec.chunk]
    chunk = dict(store.chunks[ref])
    chunk[name + part] = value
    store.chunks[ref + "-tampered"] = chunk
    refs = list(update.chunk_refs)
    refs[spec.chunk] = ref + "-tampered"
    specs = tuple(dataclasses.replace(s, checksum=checksum) if s.name == name and checksum is not None else s
                  for s in update.manifest.tensors)
    return WeightUpdate(dataclasses.replace(update.manifest, tensors=specs), refs)


def _delta_v1(encoding: str) -> tuple[WeightReceiver, Trainer, WeightUpdate, str, dict]:
    """A receiver at v0, its trainer, the v1 delta, one of its tensors in `encoding` and that one's chunk."""
    trainer = Trainer(lr=1e-6)
    receiver = bf16_receiver()
    receiver.receive(trainer.build()[1], trainer.store.fetch, reset=True)
    trainer.step(seed=0)
    update = trainer.build()[2]
    spec = next(spec for spec in update.manifest.tensors if spec.encoding == encoding)
    return receiver, trainer, update, spec.name, trainer.store.chunks[update.chunk_refs[spec.chunk]]


@pytest.mark.parametrize("encoding, part, value, message", [
    ("sparse", INDICES, lambda i, v: torch.cat([i[:1], i[:-1]]), "field 'indices': not strictly ascending"),
    ("sparse", INDICES, lambda i, v: torch.cat([i[:-1], i.new_tensor([10**6])]),
     "field 'indices': index 1000000 out of range"),
    ("sparse", INDICES, lambda i, v: i.float(),
     "field 'indices': must be a 1-D int32/int64 tensor, got torch.float32"),
    ("sparse", VALUES, lambda i, v: v.float(),
     "field 'values': must be a 1-D torch.bfloat16 tensor, got torch.float32"),
    ("sparse", VALUES, lambda i, v: v[:-1], r"field 'values': \d+ values for \d+ indices"),
    ("mask", MASK, lambda m, v: m[:-1], r"field 'mask': must be a 1-D uint8 tensor of \d+ bytes"),
    ("mask", MASK, lambda m, v: m.to(torch.int16), r"field 'mask': must be a 1-D uint8 tensor"),
    ("mask", VALUES, lambda m, v: torch.cat([v, v[:1]]), r"field 'values': \d+ values for \d+ indices"),
])
def test_a_malformed_delta_is_refused_naming_the_tensor_and_field(encoding, part, value, message) -> None:
    receiver, trainer, update, name, chunk = _delta_v1(encoding)
    where = name + (INDICES if encoding == "sparse" else MASK)
    bad = _tampered(update, trainer.store, name, part, value(chunk[where], chunk[name + VALUES]))
    before = receiver.fingerprint
    with pytest.raises(WeightUpdateError, match=rf"v1: chunk \d+ .*'{name}' {message}"):
        receiver.receive(bad, trainer.store.fetch)
    assert receiver.version == 0 and receiver.refresh_fingerprint() == before
    assert receiver.receive(update, trainer.store.fetch).applied  # the real one still applies


def test_nothing_non_finite_reaches_the_weights() -> None:
    receiver, trainer, update, name, chunk = _delta_v1("sparse")
    values = chunk[name + VALUES].clone()
    values[0] = float("nan")
    # Even with a checksum that agrees (a trainer's NaN weights checksum fine), NaN is refused.
    rebuilt = receiver.sinks["actor"].state()[name.partition("/")[2]].detach().cpu().clone()
    rebuilt.reshape(-1)[chunk[name + INDICES].long()] = values
    bad = _tampered(update, trainer.store, name, VALUES, values, checksum=tensor_checksum(rebuilt))
    with pytest.raises(WeightUpdateError, match=f"tensor '{name}' holds NaN or Inf"):
        receiver.receive(bad, trainer.store.fetch)
    assert receiver.version == 0
    # And the trainer builds no update of NaN weights, in any encoding.
    with torch.no_grad():
        trainer.model.state_dict()[Q_PROJ][0, 0] = float("inf")
    with pytest.raises(NonFiniteWeightsError, match=Q_PROJ):
        trainer.build()


def test_encode_sparse_goes_dense_where_the_delta_is_not_smaller() -> None:
    old = torch.randn(1000).to(BF16)
    new = old.clone()
    new[::50] += 1.0  # 20 of 1000 change: 20 * (4 + 2) bytes beat a 125-byte mask + values, and 2000
    parts = encode_sparse(new, old)
    assert parts is not None and parts[INDICES].dtype == torch.int32 and parts[INDICES].numel() == 20
    new[::2] += 1.0  # 500 change: a bit mask (125 bytes) + values beats indices + values, and the tensor
    parts = encode_sparse(new, old)
    assert parts is not None and INDICES not in parts and parts[MASK].numel() == 125
    assert parts[VALUES].numel() == 500
    new += 1.0  # all change: nothing beats the tensor itself
    assert encode_sparse(new, old) is None
    zero = torch.zeros(100, dtype=BF16)
    flipped = zero.clone()
    flipped[3] = -0.0
    assert encode_sparse(flipped, zero)[INDICES].tolist() == [3]  # -0.0 differs from 0.0 in bits

