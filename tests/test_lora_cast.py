"""LoRA-only updates for makers that cast weights (`MakerConfig.weight_cast_dtype`): base fingerprints are
compared after casting both bases to the maker's dtype, so a bf16/fp16 maker with the trainer's base takes
LoRA-only updates from the first one on (one that asks gets the whole model first), a maker that reconnects
(or restarts) with the same base gets LoRA-only ones, and a maker with another base never does."""

import copy

import pytest
import torch

from detached_rl.algorithms.ppo import PPOConfig, PPOLearner
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerConfig
from detached_rl.models import SamplingConfig
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig
from detached_rl.trainer.core import TrainerCore
from detached_rl.weights.base_fingerprint import (
    base_fingerprint,
    base_state_fingerprint,
    cast_base_fingerprints,
    fingerprint_cast_dtype,
    lowest_precision_dtype,
    sent_base_fingerprint,
)
from detached_rl.weights.update import WeightUpdateError, state_fingerprint

from .helpers import (
    ObjectStore,
    arithmetic_prompts,
    lora_actor_critic,
    lora_maker_models,
    model_device,
    naive_strategy,
)

SAMPLING = SamplingConfig(max_new_tokens=6)
PROBE = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Measured on the CPU: served logits are within 5e-3 (bf16) / 6e-4 (fp16) of the fp32 trainer's, in keep and
# merge modes, while one LoRA step at lr 1e-2 moves them by more than 0.1: a maker
# left on older weights fails.
TOLERANCE = {"bfloat16": 1.5e-2, "float16": 2e-3}


def logits_of(model):
    """The model's fp32 logits on PROBE, on the CPU."""
    with torch.no_grad():
        return model(PROBE.to(model_device(model))).logits.float().cpu()


def make_trainer():
    actor, critic = lora_actor_critic("peft", seed=0)
    learner = PPOLearner(actor, critic, naive_strategy(),
                         PPOConfig(sampling=SAMPLING, actor_optimizer=OptimizerConfig(lr=1e-2)))
    trainer = TrainerCore("trainer_0", learner, TrainerConfig(train_batch_size=8, weight_sync="lora"))
    store = ObjectStore()
    trainer.weights.snapshot(store.put)  # version 0: LoRA-only too (makers with another base get a full one)
    return trainer, store


def casting_maker(name, dtype, mode="keep", seed=0):
    """A maker whose models are stored in `dtype` and which casts incoming weights to it;
    seed 0 = the trainer's base."""
    models = lora_maker_models("peft", seed=seed)
    models.actor.to(DTYPES[dtype])
    models.critic.to(DTYPES[dtype])
    return ExperienceMaker(name, models, CyclingPrompts(arithmetic_prompts()),
                           MakerConfig(experience_batch_size=8, sampling=SAMPLING, lora_mode=mode,
                                       weight_cast_dtype=dtype), strategy=naive_strategy())


def synced_maker(trainer, store, name, dtype):
    """A casting maker with the trainer's base that applied what registration offered it."""
    maker = casting_maker(name, dtype)
    maker.apply_weight_update(trainer.weights.register(name, maker.base_fingerprint, store.put), store.fetch)
    return maker


def train_and_sync(trainer, store, makers):
    """One training step on the first maker's experience, then a weight update applied by every maker."""
    trainer.push_experience(makers[0].make_experience())
    trainer.train_step()
    return trainer.weights.publish(store.put, lambda update, names: {
        maker.name: maker.apply_weight_update(update, store.fetch) for maker in makers})


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", ["keep", "merge"])
def test_a_casting_maker_with_the_trainers_base_takes_lora_only_updates_from_the_first_on(dtype, mode):
    trainer, store = make_trainer()
    maker = casting_maker("maker_0", dtype, mode)
    assert maker.base_fingerprint.startswith(f"{dtype}:")
    # Same base, cast: it matches before any update (a maker loaded from the trainer's checkpoint in bf16).
    assert maker.base_fingerprint == trainer.weights.cast_base_fingerprints[dtype]
    first = trainer.weights.register("maker_0", maker.base_fingerprint, store.put)
    assert first.manifest.kind == "lora"  # the base never crosses: the maker proved it holds it
    maker.apply_weight_update(first, store.fetch, reset=True)
    assert maker.policy_version == 0
    # Recomputed over the cast bytes it now holds, the fingerprint still matches the trainer's cast one.
    assert maker.base_fingerprint == trainer.weights.cast_base_fingerprints[dtype]
    trainer_model = trainer.learner.actor.model
    for step in range(3):
        metrics = train_and_sync(trainer, store, [maker])
        update = trainer.weights.latest_update
        assert update.manifest.kind == "lora"
        assert metrics["weight_sync/makers_updated"] == 1 and metrics["weight_sync/makers_failed"] == 0
        assert maker.policy_version == step + 1
        served = logits_of(maker.backend.model)
        cast_trainer = logits_of(copy.deepcopy(trainer_model).to(DTYPES[dtype]))
        difference = (served - logits_of(trainer_model)).abs().max().item()
        assert difference <= TOLERANCE[dtype], f"step {step}: max |logit diff| to the trainer {difference}"
        assert (served - cast_trainer).abs().max().item() <= TOLERANCE[dtype]
    assert {p.dtype for p in maker.backend.model.parameters()} == {DTYPES[dtype]}


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reconnecting_with_the_same_base_gets_lora_only_and_another_base_a_full_update(dtype):
    trainer, store = make_trainer()
    maker = casting_maker("maker_0", dtype)
    maker.apply_weight_update(trainer.weights.register("maker_0", maker.base_fingerprint, store.put),
                              store.fetch)
    train_and_sync(trainer, store, [maker])
    lora_update = trainer.weights.latest_update
    assert lora_update.manifest.kind == "lora" and maker.policy_version == 1

    # The same maker registers again (a reconnect): LoRA-only, in the dtype it serves (wire_variants).
    again = trainer.weights.register("maker_0", maker.base_fingerprint, store.put)
    assert again.manifest.kind == "lora" and again.version == lora_update.version
    assert again.manifest.metadata["wire_dtype"] == dtype
    # A fresh maker with the same base in the same dtype (a restarted one): LoRA-only, and it serves the
    # trainer's weights once it applied it.
    fresh = casting_maker("maker_1", dtype)
    offered = trainer.weights.register("maker_1", fresh.base_fingerprint, store.put)
    assert offered.manifest.kind == "lora"
    fresh.apply_weight_update(offered, store.fetch)
    assert torch.equal(logits_of(fresh.backend.model), logits_of(maker.backend.model))

    # Another base, cast the same way: a full update at registration, and a LoRA update is refused.
    stranger = casting_maker("maker_2", dtype, seed=3)
    before = logits_of(stranger.backend.model)
    with pytest.raises(WeightUpdateError, match="base fingerprint mismatch"):
        stranger.apply_weight_update(lora_update, store.fetch)
    assert stranger.policy_version == -1 and torch.equal(before, logits_of(stranger.backend.model))
    offered = trainer.weights.register("maker_2", stranger.base_fingerprint, store.put)
    assert offered.manifest.kind == "full"
    stranger.apply_weight_update(offered, store.fetch)
    assert stranger.base_fingerprint == trainer.weights.cast_base_fingerprints[dtype]
    # From then on it follows LoRA-only updates like the others.
    train_and_sync(trainer, store, [maker, fresh, stranger])
    assert trainer.weights.latest_update.manifest.kind == "lora"
    assert {m.policy_version for m in (maker, fresh, stranger)} == {2}
    assert torch.equal(logits_of(stranger.backend.model), logits_of(maker.backend.model))


def test_a_maker_with_a_slightly_different_base_is_not_taken_for_the_trainer():
    trainer, store = make_trainer()
    maker = casting_maker("maker_0", "bfloat16")
    # One base weight off by a few bf16 steps: the cast fingerprints differ.
    key = next(k for k in sorted(maker.base_check.keys) if k.endswith("q_proj.base_layer.weight"))
    with torch.no_grad():
        maker.backend.weight_sink.state()[key][0, 0] += 0.05
    maker.base_check.refresh_fingerprint()  # the base changed outside the receiver: fingerprint it again
    assert maker.base_fingerprint != trainer.weights.cast_base_fingerprints["bfloat16"]
    train_and_sync(trainer, store, [synced_maker(trainer, store, "maker_1", "bfloat16")])
    assert trainer.weights.register("maker_0", maker.base_fingerprint, store.put).manifest.kind == "full"


def test_uncast_makers_keep_exact_fingerprints():
    trainer, store = make_trainer()
    maker = ExperienceMaker("maker_0", lora_maker_models("peft", seed=0),
                            CyclingPrompts(arithmetic_prompts()),
                            MakerConfig(experience_batch_size=8, sampling=SAMPLING),
                            strategy=naive_strategy())
    assert maker.base_fingerprint == trainer.weights.base_fingerprint and ":" not in maker.base_fingerprint
    metadata = trainer.weights.latest_update.manifest.metadata
    assert sent_base_fingerprint(metadata, None) == trainer.weights.base_fingerprint
    cast = trainer.weights.cast_base_fingerprints
    assert sent_base_fingerprint(metadata, torch.bfloat16) == cast["bfloat16"]
    assert set(metadata["base_fingerprints"]) == {"bfloat16", "float16", "float32"}


def test_cast_fingerprints_compare_values_at_the_cast_dtype():
    model = lora_actor_critic("peft", seed=0)[0].model
    keys = [k for k, p in model.state_dict(keep_vars=True).items() if not p.requires_grad]
    state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    as_bf16 = {k: t.to(torch.bfloat16) for k, t in state.items()}
    exact = base_state_fingerprint(state, keys)
    assert exact == state_fingerprint({"base": {k: state[k] for k in keys}}) and ":" not in exact
    assert base_state_fingerprint(as_bf16, keys) != exact
    cast = base_state_fingerprint(state, keys, torch.bfloat16)
    assert cast.startswith("bfloat16:") and cast == base_state_fingerprint(as_bf16, keys, torch.bfloat16)
    # Below bf16's resolution the bases agree at bf16 (not exactly); above it they differ at bf16 too.
    nudged = dict(state)
    nudged[keys[1]] = state[keys[1]].clone()
    nudged[keys[1]].view(-1)[0] += 1e-7
    assert base_state_fingerprint(nudged, keys) != exact
    assert base_state_fingerprint(nudged, keys, torch.bfloat16) == cast
    nudged[keys[1]].view(-1)[0] += 0.05
    assert base_state_fingerprint(nudged, keys, torch.bfloat16) != cast
    # cast_base_fingerprints: the no-op cast (fp32 -> fp32) takes the exact digest, named.
    every = cast_base_fingerprints(model)
    assert every["float32"] == f"float32:{exact}" == base_fingerprint(model, torch.float32)
    assert every["bfloat16"] == cast and every["float16"] == base_fingerprint(model, torch.float16)
    with pytest.raises(ValueError, match="floating dtype"):
        base_state_fingerprint(state, keys, torch.int8)


def test_fingerprint_dtypes_are_parsed_and_ranked():
    assert fingerprint_cast_dtype("ab12") is None
    assert fingerprint_cast_dtype("bfloat16:ab12") is torch.bfloat16
    assert fingerprint_cast_dtype("float16:ab12") is torch.float16
    for bad in ("int8:ab12", "float99:ab12"):
        with pytest.raises(ValueError, match="not a floating torch dtype"):
            fingerprint_cast_dtype(bad)
    assert lowest_precision_dtype([torch.float32, torch.bfloat16, torch.int64]) is torch.bfloat16
    assert lowest_precision_dtype([torch.float32, torch.float16]) is torch.float16
    assert lowest_precision_dtype([torch.float16, torch.bfloat16]) is torch.bfloat16
    assert lowest_precision_dtype([torch.float64, torch.float32]) is torch.float32
    assert lowest_precision_dtype([torch.int64]) is None


def test_a_trainer_answers_a_dtype_beyond_the_common_ones_on_demand():
    trainer, store = make_trainer()
    train_and_sync(trainer, store, [synced_maker(trainer, store, "maker_0", "bfloat16")])
    model = trainer.learner.actor.model
    wanted = base_fingerprint(model, torch.float64)
    assert "float64" not in trainer.weights.latest_update.manifest.metadata["base_fingerprints"]
    offered = trainer.weights.register("maker_9", wanted, store.put)
    assert offered.manifest.kind == "lora" and offered.chunk_refs == trainer.weights.latest_update.chunk_refs
    assert sent_base_fingerprint(offered.manifest.metadata, torch.float64) == wanted
    assert trainer.weights.register("maker_9", "float64:" + "0" * 64, store.put).manifest.kind == "full"


def test_a_maker_that_asks_for_the_whole_model_first_gets_it_then_lora_only_updates():
    """`maker.first_update: full`: the maker registers without its fingerprint and gets a full update."""
    trainer, store = make_trainer()
    maker = casting_maker("maker_0", "bfloat16")
    maker.config.first_update = "full"
    assert maker.registration_fingerprint is None and maker.base_fingerprint is not None
    first = trainer.weights.register("maker_0", maker.registration_fingerprint, store.put)
    assert first.manifest.kind == "full" and trainer.weights.latest_update.manifest.kind == "lora"
    maker.apply_weight_update(first, store.fetch, reset=True)
    train_and_sync(trainer, store, [maker])
    assert trainer.weights.latest_update.manifest.kind == "lora" and maker.policy_version == 1
