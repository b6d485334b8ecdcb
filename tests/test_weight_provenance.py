"""Where a maker's weights may come from (no Ray): only the trainer run it registered with, no big jumps, no
rollbacks, except through an explicit reset (registering again); and never NaN or Inf,
whatever the checksums say."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.models import LoraSettings, apply_lora, tiny_causal_lm
from detached_rl.weights.base_fingerprint import BaseCheckedSink, base_fingerprint, base_keys
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.sink import ModuleWeightSink
from detached_rl.weights.update import (
    OffTrainerError,
    WeightUpdate,
    WeightUpdateError,
    build_weight_update,
    tensor_checksum,
)

from .helpers import (
    ObjectStore,
    arithmetic_prompts,
    grpo_maker_models,
    lane_device,
    state_snapshot,
    tiny_llama,
)

CHUNK = 40_000  # bytes: the tiny llama is cut into a dozen chunks
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def lora_llama(seed: int) -> torch.nn.Module:
    """A tiny llama (base seed 0) with a peft adapter whose A and B come from `seed`."""
    model = apply_lora(tiny_causal_lm("llama", seed=0)[0], LoraSettings(r=4, alpha=8))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.to(lane_device())


def unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(tensor, before[key]) for key, tensor in model.state_dict().items())


def full(store: ObjectStore, model: torch.nn.Module, version: int, run: str | None = "run-a") -> WeightUpdate:
    metadata = {} if run is None else {"trainer_run": run}
    return build_weight_update({"actor": model.state_dict()}, version, store.put, chunk_bytes=CHUNK,
                               metadata=metadata)[0]


def poisoned(update: WeightUpdate, store: ObjectStore, name: str, value: float) -> WeightUpdate:
    """`update` with one element of tensor `name` set to `value`, its checksum recomputed: the manifest
    vouches for it, as a trainer's own NaN weights would be vouched for."""
    spec = next(spec for spec in update.manifest.tensors if spec.name == name)
    ref = update.chunk_refs[spec.chunk]
    tensor = store.objects[ref][name].clone()
    tensor.view(-1)[tensor.numel() // 2] = value
    return replaced(update, store, name, tensor)


def replaced(update: WeightUpdate, store: ObjectStore, name: str, tensor: torch.Tensor) -> WeightUpdate:
    """`update` with tensor `name` replaced by `tensor`, its checksum recomputed (a well-formed forgery)."""
    spec = next(spec for spec in update.manifest.tensors if spec.name == name)
    ref = update.chunk_refs[spec.chunk]
    store.objects[ref] = {**store.objects[ref], name: tensor}
    tensors = tuple(dataclasses.replace(s, checksum=tensor_checksum(tensor)) if s.name == name else s
                    for s in update.manifest.tensors)
    return WeightUpdate(dataclasses.replace(update.manifest, tensors=tensors), update.chunk_refs)


@pytest.fixture
def bound():
    """A maker's receiver that took version 3 of trainer run "run-a"."""
    store, maker = ObjectStore(), tiny_llama(seed=1)
    receiver = WeightReceiver({"actor": maker}, version=-1)
    assert receiver.receive(full(store, tiny_llama(seed=2), 3), store.fetch).applied
    assert (receiver.version, receiver.trainer_run) == (3, "run-a")
    return store, maker, receiver


def test_an_update_of_another_trainer_run_is_refused_until_an_explicit_reset(bound):
    store, maker, receiver = bound
    before = state_snapshot(maker)
    for run in ("run-b", None):  # another run, or none named
        with pytest.raises(WeightUpdateError, match=f"trainer_run {run!r} is not the trainer run"):
            receiver.receive(full(store, tiny_llama(seed=3), 4, run=run), store.fetch)
        assert unchanged(maker, before) and (receiver.version, receiver.trainer_run) == (3, "run-a")
    # A trainer resumed from its step-2 checkpoint (a new run): the maker registers with it again.
    resumed = tiny_llama(seed=3)
    assert receiver.receive(full(store, resumed, 2, run="run-b"), store.fetch, reset=True).applied
    assert (receiver.version,
            receiver.trainer_run) == (2, "run-b") and unchanged(maker, state_snapshot(resumed))
    with pytest.raises(WeightUpdateError, match="trainer_run 'run-a'"):
        # The old run is now the foreign one.
        receiver.receive(full(store, tiny_llama(seed=2), 5), store.fetch)
    assert receiver.receive(full(store, tiny_llama(seed=4), 3, run="run-b"), store.fetch).applied
    assert (receiver.version, receiver.trainer_run) == (3, "run-b")


def test_registering_with_a_trainer_that_has_no_weights_yet_follows_its_run_from_its_first_update(bound):
    store, maker, receiver = bound
    # The maker met a trainer resumed under the same name before it had loaded its checkpoint: registration
    # offered nothing, only the new run's id. Its first update (a full one, at the
    # checkpoint's step) is the reset.
    receiver.expect_runs(["run-b", "run-x"])
    with pytest.raises(WeightUpdateError, match="trainer_run 'run-c'"):
        receiver.receive(full(store, tiny_llama(seed=3), 2, run="run-c"), store.fetch)
    resumed = tiny_llama(seed=3)
    assert receiver.receive(full(store, resumed, 2, run="run-b"), store.fetch).applied
    assert (receiver.version,
            receiver.trainer_run) == (2, "run-b") and unchanged(maker, state_snapshot(resumed))
    with pytest.raises(WeightUpdateError, match="stale version 1"):
        # now an ordinary rollback
        receiver.receive(full(store, tiny_llama(seed=4), 1, run="run-b"), store.fetch)
    # Following run-b ended the other registration's claim: run-x is now just another run.
    with pytest.raises(WeightUpdateError, match="trainer_run 'run-x' is not the trainer run"):
        receiver.receive(full(store, tiny_llama(seed=4), 5, run="run-x"), store.fetch)


def test_a_far_future_version_is_refused_and_the_real_next_update_still_applies(bound):
    store, maker, receiver = bound
    before = state_snapshot(maker)
    with pytest.raises(WeightUpdateError, match=r"version 1000000000 .*max_version_jump 1000"):
        receiver.receive(full(store, tiny_llama(seed=3), 10**9), store.fetch)
    assert unchanged(maker, before) and receiver.version == 3
    nxt = tiny_llama(seed=4)
    assert receiver.receive(full(store, nxt, 4), store.fetch).applied
    assert receiver.version == 4 and unchanged(maker, state_snapshot(nxt))
    # the bound itself is allowed
    assert receiver.receive(full(store, tiny_llama(seed=5), 4 + 1000), store.fetch).applied
    # An explicit reset may go anywhere.
    assert receiver.receive(full(store, tiny_llama(seed=6), 10**9), store.fetch, reset=True).applied
    assert receiver.version == 10**9


def test_rollbacks_are_refused_from_any_run_without_a_reset(bound):
    store, maker, receiver = bound
    before = state_snapshot(maker)
    with pytest.raises(WeightUpdateError, match="stale version 2 < current 3"):
        receiver.receive(full(store, tiny_llama(seed=3), 2), store.fetch)
    with pytest.raises(WeightUpdateError, match="trainer_run 'run-b'"):
        receiver.receive(full(store, tiny_llama(seed=3), 2, run="run-b"), store.fetch)
    assert unchanged(maker, before) and (receiver.version, receiver.trainer_run) == (3, "run-a")
    assert receiver.receive(full(store, tiny_llama(seed=3), 2), store.fetch, reset=True).applied
    assert receiver.version == 2


def test_a_lora_update_of_a_new_run_without_a_verified_base_needs_a_full_update_even_as_a_reset():
    store, maker = ObjectStore(), lora_llama(seed=1)
    receiver = WeightReceiver({"actor": maker})
    assert receiver.receive(full(store, lora_llama(seed=2), 1), store.fetch).applied
    adapter = {key: p.detach() for key, p in lora_llama(seed=3).named_parameters() if p.requires_grad}
    update = build_weight_update({"actor": adapter}, 1, store.put, kind="lora",
                                 metadata={"trainer_run": "run-b"})[0]
    with pytest.raises(OffTrainerError, match="lacks 'actor/base_model.*no verified base provides"):
        receiver.receive(update, store.fetch, reset=True)
    assert (receiver.trainer_run, receiver.version) == ("run-a", 1)


def lora_update(store: ObjectStore, trainer: torch.nn.Module, version: int, run: str = "run-b",
                base: torch.nn.Module | None = None) -> WeightUpdate:
    """A LoRA-only update of `trainer` (A, B) naming the base fingerprint of `base` (default: its own)."""
    adapter = {key: p.detach() for key, p in trainer.named_parameters() if p.requires_grad}
    metadata = {"trainer_run": run, "base_fingerprint": base_fingerprint(base or trainer)}
    return build_weight_update({"actor": adapter}, version, store.put, kind="lora", metadata=metadata)[0]


def test_a_maker_that_proves_the_base_starts_from_a_lora_only_update_and_one_that_cannot_fetches_nothing():
    """What a maker starting out (version -1) or registering takes: a LoRA-only update of a new run when the
    base it serves is the one the update names; refused before any chunk is fetched otherwise."""
    store, fetched = ObjectStore(), []

    def fetch(ref):
        fetched.append(ref)
        return store.fetch(ref)

    maker = lora_llama(seed=1)
    checked = BaseCheckedSink(ModuleWeightSink(maker), base_keys(maker))
    receiver = WeightReceiver({"actor": checked}, version=-1)
    stranger = apply_lora(tiny_causal_lm("llama", seed=5)[0], LoraSettings(r=4, alpha=8))  # another base
    before = state_snapshot(maker)
    with pytest.raises(OffTrainerError, match="base fingerprint mismatch"):
        receiver.receive(lora_update(store, lora_llama(seed=2), 0, base=stranger), fetch, reset=True)
    assert fetched == [] and unchanged(maker, before) and receiver.version == -1
    trainer = lora_llama(seed=2)
    assert receiver.receive(lora_update(store, trainer, 0), fetch, reset=True).applied
    assert fetched and (receiver.version, receiver.trainer_run) == (0, "run-b")
    assert all(torch.equal(maker.state_dict()[key], value) for key, value in trainer.state_dict().items())
    # and again, from another run (a registration with a trainer that resumed in a new process)
    later = lora_llama(seed=3)
    assert receiver.receive(lora_update(store, later, 7, run="run-c"), fetch, reset=True).applied
    assert all(torch.equal(maker.state_dict()[key], value) for key, value in later.state_dict().items())


@pytest.mark.parametrize("mode", ["staged", "in_place"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_full_update_with_nan_or_inf_is_refused_and_nothing_changes(bound, mode, value):
    store, maker, receiver = bound
    receiver.mode = mode
    before, fingerprint = state_snapshot(maker), receiver.fingerprint
    update = poisoned(full(store, tiny_llama(seed=3), 4), store, f"actor/{Q_PROJ}", value)
    # in place, an earlier chunk could be written first
    assert update.manifest.tensors[0].name != f"actor/{Q_PROJ}"
    with pytest.raises(WeightUpdateError, match=f"'actor/{Q_PROJ}' holds NaN or Inf"):
        receiver.receive(update, store.fetch)
    assert (receiver.version, receiver.trainer_run) == (3, "run-a")
    assert all(torch.isfinite(tensor).all() for tensor in maker.state_dict().values())
    if mode == "staged":
        assert unchanged(maker, before) and receiver.consistent and receiver.fingerprint == fingerprint


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_full_update_poisoned_in_its_first_chunk_leaves_the_weights_as_they_were(bound, mode):
    store, maker, receiver = bound
    receiver.mode = mode
    before = state_snapshot(maker)
    clean = full(store, tiny_llama(seed=3), 4)
    update = poisoned(clean, store, clean.manifest.tensors[0].name, float("nan"))
    with pytest.raises(WeightUpdateError, match="holds NaN or Inf"):
        receiver.receive(update, store.fetch)
    assert unchanged(maker, before) and receiver.consistent and receiver.version == 3


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_lora_update_with_nan_is_refused_and_the_adapter_is_kept(mode):
    store, maker = ObjectStore(), lora_llama(seed=1)
    receiver = WeightReceiver({"actor": maker}, mode=mode, version=-1)
    assert receiver.receive(full(store, lora_llama(seed=2), 1), store.fetch).applied
    before = state_snapshot(maker)
    adapter = {key: p.detach() for key, p in lora_llama(seed=3).named_parameters() if p.requires_grad}
    update = build_weight_update({"actor": adapter}, 2, store.put, kind="lora",
                                 metadata={"trainer_run": "run-a"})[0]
    name = next(spec.name for spec in update.manifest.tensors if "lora_B" in spec.name)
    with pytest.raises(WeightUpdateError, match=f"{name!r} holds NaN or Inf"):
        receiver.receive(poisoned(update, store, name, float("nan")), store.fetch)
    assert unchanged(maker, before) and receiver.version == 1 and receiver.consistent


def test_a_value_the_cast_dtype_cannot_hold_is_refused():
    store, maker = ObjectStore(), tiny_llama(seed=1, dtype=torch.float16)
    receiver = WeightReceiver({"actor": maker}, cast_dtype=torch.float16)
    before = state_snapshot(maker)
    update = poisoned(full(store, tiny_llama(seed=2), 1), store, f"actor/{Q_PROJ}", 1e6)  # finite in float32
    with pytest.raises(WeightUpdateError, match="holds NaN or Inf or values beyond torch.float16"):
        receiver.receive(update, store.fetch)
    assert unchanged(maker, before) and receiver.version == 0


class Buffers(torch.nn.Module):
    def __init__(self, value: float = 0.0) -> None:
        super().__init__()
        for name, dtype in (("f8", torch.float8_e4m3fn), ("bf16", torch.bfloat16), ("c64", torch.complex64)):
            self.register_buffer(name, torch.full((5,), value).to(dtype))
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("name", ["f8", "bf16", "c64"])
def test_nan_is_found_in_float8_bfloat16_and_complex_tensors(name):
    store, maker = ObjectStore(), Buffers()
    receiver = WeightReceiver({"actor": maker})
    update = build_weight_update({"actor": Buffers(1.0).state_dict()}, 1, store.put)[0]
    with pytest.raises(WeightUpdateError, match=f"'actor/{name}' holds NaN"):
        receiver.receive(poisoned(update, store, f"actor/{name}", float("nan")), store.fetch)
    assert receiver.receive(build_weight_update({"actor": Buffers(1.0).state_dict()}, 1, store.put)[0],
                          store.fetch).applied


def test_a_failed_in_place_reset_binds_to_the_new_run_whose_full_update_repairs_it(bound):
    store, maker, receiver = bound
    receiver.mode = "in_place"
    resumed = tiny_llama(seed=3)
    update = full(store, resumed, 1, run="run-b")
    lost = update.chunk_refs[2]
    del store.objects[lost]
    with pytest.raises(WeightUpdateError, match="chunk 2"):
        receiver.receive(update, store.fetch, reset=True)
    assert not receiver.consistent and receiver.trainer_run == "run-b"
    # The resumed trainer's next push (an older version than the half-written weights carry) repairs them.
    assert receiver.receive(full(store, resumed, 2, run="run-b"), store.fetch).applied
    assert receiver.consistent and receiver.version == 2 and unchanged(maker, state_snapshot(resumed))


def test_a_makers_registration_is_the_reset_and_pushes_are_not():
    config = MakerConfig(experience_batch_size=1, max_version_jump=10)
    maker = ExperienceMaker("maker_0", grpo_maker_models(device=lane_device()),
                            CyclingPrompts(arithmetic_prompts()),
                            config)
    assert maker.receiver.max_version_jump == 10
    store, trainer = ObjectStore(), maker.backend.weight_sink.state()
    state = {"actor": dict(trainer)}

    def update(version: int, run: str) -> WeightUpdate:
        return build_weight_update(state, version, store.put, metadata={"trainer_run": run})[0]

    maker.subscriber.take_offered([update(5, "run-a")], store.fetch)
    assert (maker.policy_version, maker.receiver.trainer_run) == (5, "run-a")
    with pytest.raises(WeightUpdateError, match="trainer_run 'run-b'"):
        maker.apply_weight_update(update(1, "run-b"), store.fetch)  # a push
    assert "trainer_run 'run-b'" in maker.last_error
    with pytest.raises(WeightUpdateError, match="max_version_jump 10"):
        maker.apply_weight_update(update(16, "run-a"), store.fetch)
    maker.subscriber.take_offered([update(1, "run-b")], store.fetch)  # registered with the resumed trainer
    assert (maker.policy_version, maker.receiver.trainer_run) == (1, "run-b")
    # registering again after a long absence
    maker.subscriber.take_offered([update(500, "run-b")], store.fetch)
    assert maker.policy_version == 500
    with pytest.raises(ValueError, match="max_version_jump"):
        MakerConfig(max_version_jump=0)


@pytest.mark.parametrize("version", [4.5, True, -1, "5", None])
def test_a_version_that_is_not_a_non_negative_integer_is_refused(bound, version):
    store, maker, receiver = bound
    before = state_snapshot(maker)
    update = full(store, tiny_llama(seed=3), 4)
    forged = WeightUpdate(dataclasses.replace(update.manifest, version=version), update.chunk_refs)
    with pytest.raises(WeightUpdateError, match="version must be a non-negative integer"):
        receiver.receive(forged, store.fetch)
    assert unchanged(maker, before) and receiver.version == 3
    assert receiver.receive(update, store.fetch).applied  # the real next version still applies


@pytest.mark.parametrize("mode", ["staged", "in_place"])
def test_a_finite_but_absurd_tensor_with_valid_checksums_is_refused_and_the_next_update_applies(mode):
    store, maker = ObjectStore(), tiny_llama(seed=1)
    receiver = WeightReceiver({"actor": maker}, version=-1, mode=mode)
    assert receiver.receive(full(store, tiny_llama(seed=2), 3), store.fetch).applied
    before = state_snapshot(maker)
    trained = tiny_llama(seed=2)
    with torch.no_grad():  # what an optimizer step does: a small change
        trained.get_parameter(Q_PROJ).add_(1e-3)

    def forged(version: int) -> WeightUpdate:  # q_proj all 1e30, checksums recomputed
        return replaced(full(store, trained, version), store, f"actor/{Q_PROJ}",
                        torch.full_like(trained.get_parameter(Q_PROJ).detach(), 1e30))

    with pytest.raises(WeightUpdateError, match=rf"'actor/{Q_PROJ}' would change by .*max_weight_change 10"):
        receiver.receive(forged(4), store.fetch)
    assert unchanged(maker, before) and receiver.version == 3
    assert receiver.consistent == (mode == "staged")  # in place, the chunks before it were written
    assert receiver.receive(full(store, trained, 4), store.fetch).applied  # the real step goes through
    assert unchanged(maker, state_snapshot(trained))
    # An explicit reset (registering with a trainer) takes any weights, and None lifts the bound.
    assert receiver.receive(forged(5), store.fetch, reset=True).applied
    unbounded = WeightReceiver({"actor": tiny_llama(seed=1)}, version=-1, max_weight_change=None)
    assert unbounded.receive(full(store, tiny_llama(seed=2), 3), store.fetch).applied
    assert unbounded.receive(forged(4), store.fetch).applied


def test_a_lora_b_matrix_that_starts_at_zero_may_move():
    store, maker = ObjectStore(), lora_llama(seed=1)
    with torch.no_grad():
        for name, parameter in maker.named_parameters():
            if "lora_B" in name:
                parameter.zero_()
    receiver = WeightReceiver({"actor": lora_llama(seed=2)}, version=-1)
    assert receiver.receive(full(store, maker, 0), store.fetch).applied
    trained = lora_llama(seed=1)
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.full_like(parameter, 3e-3))  # 10 Adam steps at lr 3e-4
    assert receiver.receive(full(store, trained, 1), store.fetch).applied
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:
                parameter.fill_(1.0)  # no optimizer step goes from 3e-3 to 1 (relative change 100)
    with pytest.raises(WeightUpdateError, match="lora_B.* would change by"):
        receiver.receive(full(store, trained, 2), store.fetch)
