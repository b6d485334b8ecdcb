"""The naive strategy: optimizer over trainable parameters, stepping, chunked state dicts, atomic checkpoints;
strategies that cannot run here refuse at construction."""

import pytest
import torch

from detached_rl.actors.trainer import PPOTrainerShell
from detached_rl.algorithms.grpo import GRPOLearner
from detached_rl.algorithms.ppo import PPOLearner
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import ExperienceMaker, MakerModels
from detached_rl.models import Actor, LoraSettings, apply_lora, tiny_causal_lm
from detached_rl.strategies import NaiveStrategy, StrategyUnavailableError, make_strategy
from detached_rl.strategies import colossalai as colossalai_strategies
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.core import TrainerCore

from .helpers import LowTokenReward, arithmetic_prompts, lane_device, lora_actor_critic, naive_strategy


def test_make_strategy_refuses_unknown_names():
    assert isinstance(make_strategy("naive"), NaiveStrategy)
    with pytest.raises(ValueError, match="'bogus'.*naive"):
        make_strategy("bogus")


def test_optimizer_covers_only_trainable_parameters_and_steps():
    strategy = naive_strategy()
    model = strategy.prepare_model(apply_lora(tiny_causal_lm("llama")[0], LoraSettings(r=4)))
    assert next(model.parameters()).device == strategy.device
    optimizer, scheduler = strategy.create_optimizer(model, OptimizerConfig(lr=1e-2, warmup_steps=2))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for g in optimizer.param_groups
               for p in g["params"]) == sum(p.numel() for p in trainable)
    before = [p.detach().clone() for p in trainable]
    ids = torch.tensor([[3, 4, 5, 6]], device=strategy.device)
    loss = model(ids, labels=ids).loss
    strategy.backward(loss, model, optimizer)
    norm = strategy.optimizer_step(optimizer, model, max_grad_norm=1e-3)
    assert norm > 0
    assert all(p.grad is None for p in trainable)
    assert any(not torch.equal(a, p) for a, p in zip(before, trainable, strict=True))
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)  # warm-up: 0.5 * lr, then lr
    with pytest.raises(ValueError, match="OptimizerConfig.lr"):
        strategy.create_optimizer(model, OptimizerConfig(lr=0))


def test_state_dict_chunks_respect_the_byte_budget_and_cover_everything():
    strategy = naive_strategy()
    model = strategy.prepare_model(tiny_causal_lm("gpt2")[0])
    full = model.state_dict()
    budget = 40_000
    chunks = list(strategy.iter_state_dict(model, chunk_bytes=budget))
    assert len(chunks) > 1
    seen = {}
    for chunk in chunks:
        sizes = [t.numel() * t.element_size() for t in chunk.values()]
        assert sum(sizes) <= budget or len(chunk) == 1
        seen.update(chunk)
    assert list(seen) == list(full) and all(torch.equal(seen[k], full[k]) for k in full)
    lora = strategy.prepare_model(apply_lora(tiny_causal_lm("llama")[0], LoraSettings(r=4)))
    only = {k for c in strategy.iter_state_dict(lora, only_trainable=True) for k in c}
    assert only and all("lora_" in k for k in only)


def test_checkpoint_round_trip_and_atomic_replace(tmp_path):
    strategy = naive_strategy()
    model = strategy.prepare_model(tiny_causal_lm("llama", seed=1)[0])
    optimizer, _ = strategy.create_optimizer(model, OptimizerConfig(lr=1e-3))
    ids = torch.tensor([[1, 2, 3]], device=strategy.device)
    model(ids, labels=ids).loss.backward()
    strategy.optimizer_step(optimizer, model)
    path = strategy.save_checkpoint(tmp_path / "ckpt", model, optimizer, extra={"step": 1})
    strategy.save_checkpoint(path, model, optimizer, extra={"step": 2})  # replaces the first one whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    other = strategy.prepare_model(tiny_causal_lm("llama", seed=2)[0])
    other_optimizer, _ = strategy.create_optimizer(other, OptimizerConfig(lr=1e-3))
    assert strategy.load_checkpoint(path, other, other_optimizer) == {"step": 2}
    assert all(torch.equal(a, b)
               for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))
    assert other_optimizer.state_dict()["state"][0]["step"] == 1
    with pytest.raises(FileNotFoundError, match="not a detached-rl checkpoint"):
        strategy.load_checkpoint(tmp_path / "nothing", other)
    assert sorted(p.name for p in path.iterdir()) == ["state.json", "tensors.safetensors"]


@pytest.mark.parametrize(
    ("schedule", "expected"),
    # warm-up 2 steps (0.5, 1.0), then decay over total_steps - warmup = 4 steps to min_lr_ratio 0.2.
    [("constant", [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
     ("linear", [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2]),
     ("cosine", [0.5, 1.0, 1.0, 0.2 + 0.8 * 0.8535534, 0.6, 0.2 + 0.8 * 0.1464466, 0.2])],
)
def test_learning_rate_schedules(schedule, expected):
    config = OptimizerConfig(lr=1.0, schedule=schedule, warmup_steps=2, total_steps=6, min_lr_ratio=0.2)
    assert [config.lr_factor(step) for step in range(7)] == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [(dict(betas=(0.9, 1.0)), "betas"), (dict(schedule="step"), "schedule"),
     (dict(schedule="cosine", total_steps=0), "total_steps"),
     (dict(weight_decay=-1), "weight_decay"), (dict(max_grad_norm=0), "max_grad_norm")],
)
def test_optimizer_config_refuses_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"OptimizerConfig.{field}"):
        OptimizerConfig(**kwargs)


def test_a_decaying_schedule_without_its_length_is_refused_when_built():
    from detached_rl.strategies.optim import build_optimizer

    with pytest.raises(ValueError, match="OptimizerConfig.total_steps is required by the 'cosine' schedule"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerConfig(schedule="cosine"))


GROUP = {"rank": 0, "world_size": 2, "master_addr": "127.0.0.1", "master_port": 29500}


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA these strategies run")
@pytest.mark.parametrize(("name", "plugin"), [("colossalai_zero2", "LowLevelZeroPlugin"),
                                              ("colossalai_gemini", "GeminiPlugin")])
def test_sharded_colossalai_strategies_refuse_cpu_naming_what_works(name, plugin):
    with pytest.raises(StrategyUnavailableError) as error:
        make_strategy(name, **GROUP)
    message = str(error.value)
    assert f"strategy '{name}' needs CUDA GPUs ({plugin}" in message
    assert message.endswith("on CPU use one of naive, ddp, colossalai_ddp")


def test_colossalai_strategies_say_how_to_install_it_when_it_is_missing(monkeypatch):
    monkeypatch.setattr(colossalai_strategies, "colossalai_available", lambda: False)
    with pytest.raises(StrategyUnavailableError,
                       match=r"needs the colossalai package.*make colossalai.*'naive' or 'ddp'"):
        make_strategy("colossalai_ddp", **GROUP)


def test_prepare_training_is_prepare_model_plus_optimizer_and_gradient_share_is_one():
    strategy = naive_strategy()
    model, optimizer, scheduler = strategy.prepare_training(tiny_causal_lm("llama")[0],
                                                            OptimizerConfig(lr=1e-3))
    assert scheduler.optimizer is optimizer and optimizer.param_groups[0]["lr"] == 1e-3
    assert strategy.gradient_share(17.0) == 1.0 and not strategy.shards_weights
    names = [name for name, _ in strategy.named_tensors(model, prefix="model.layers.0.")]
    assert names and all(not n.startswith("model.") for n in names)


# -------------------------------------------------------------- gradient accumulation and the sharded plugins

def test_backwards_per_step_refuses_a_second_pass_only_where_accumulation_is_off():
    first, second = object(), object()
    counting = colossalai_strategies.BackwardsPerStep("colossalai_zero2", allowed=True, how_to_allow="")
    for _ in range(3):
        counting.backward(first)
    strict = colossalai_strategies.BackwardsPerStep("colossalai_gemini", allowed=False,
                                                    how_to_allow="leave it on")
    strict.backward(first)
    strict.backward(second)  # another optimizer (PPO's critic) counts on its own
    with pytest.raises(ValueError, match=r"'colossalai_gemini' takes one backward pass per optimizer step.*"
                                         r"PPOConfig.micro_batch_size / "
                                         r"GRPOConfig.micro_batch_size.*leave it on"):
        strict.backward(first)
    strict.stepped(first)
    strict.backward(first)  # a new step starts afresh
    with pytest.raises(ValueError):
        strict.backward(second)


def test_gemini_accumulates_gradients_unless_told_not_to():
    options = colossalai_strategies.gemini_plugin_options("bf16", None, {})
    assert options == {"precision": "bf16", "max_norm": 0.0, "enable_gradient_accumulation": True}
    user = colossalai_strategies.gemini_plugin_options("bf16", 1.0, {"enable_gradient_accumulation": False,
                                                                      "placement_policy": "static"})
    assert user["enable_gradient_accumulation"] is False and user["max_norm"] == 1.0
    assert user["placement_policy"] == "static"


def test_strategies_declare_gradient_accumulation():
    assert naive_strategy().supports_gradient_accumulation
    from detached_rl.strategies import STRATEGIES

    for name in ("ddp", "colossalai_ddp", "colossalai_zero2"):
        assert STRATEGIES[name].supports_gradient_accumulation is True, name


# GPU lane: a 1-rank ZeRO-2 / Gemini group against a naive trainer doing the same mixed-precision arithmetic.
STEPS, MICRO_BATCHES, LR = 3, 2, 1e-3


def _needs_sharded_colossalai():
    from .helpers import lane_device

    if lane_device().type != "cuda":
        pytest.skip("GPU lane only (pytest --device cuda): ZeRO-2 and Gemini need CUDA")
    if not colossalai_strategies.colossalai_available():
        pytest.skip(f"colossalai is not installed; {colossalai_strategies.INSTALL_HINT}")


def _batches(device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randint(3, 120, (2, 12), generator=generator).to(device) for _ in range(MICRO_BATCHES)]
            for _ in range(STEPS)]


def _naive_mixed_precision(model, batches, dtype):
    """What ZeRO and Gemini do, in plain torch: fp32 master weights stepped by AdamW on the gradients the
    `dtype` model accumulated over the micro-batches, then copied back as master.to(dtype).
    Returns the `dtype` weights."""
    working = model.to(dtype).train()
    masters = [p.detach().float().clone().requires_grad_(True) for p in working.parameters()]
    optimizer = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    for step in batches:
        for ids in step:
            (working(ids, labels=ids).loss / len(step)).backward()
        for master, param in zip(masters, working.parameters(), strict=True):
            master.grad = param.grad.float()
            param.grad = None
        optimizer.step()
        with torch.no_grad():
            for master, param in zip(masters, working.parameters(), strict=True):
                param.copy_(master)
    return {k: v.detach().clone() for k, v in working.state_dict().items()}


def _sharded_run(name, precision, batches, **plugin_options):
    from detached_rl.strategies.ddp import find_free_port

    strategy = make_strategy(name, rank=0, world_size=1, master_addr="127.0.0.1",
                             master_port=find_free_port(),
                             precision=precision, plugin_options=plugin_options)
    try:
        model, optimizer, _ = strategy.prepare_training(tiny_causal_lm("llama", seed=4)[0].train(),
                                                        OptimizerConfig(lr=LR, max_grad_norm=None))
        initial = {k: t.detach().cpu().clone() for k, t in strategy.named_tensors(model)}
        for step in batches:
            for ids in step:
                strategy.backward(model(ids, labels=ids).loss / len(step), model, optimizer)
            strategy.optimizer_step(optimizer, model)
        return initial, {k: t.detach().cpu().clone() for k, t in strategy.named_tensors(model)}
    finally:
        strategy.destroy()


@pytest.mark.parametrize(("name", "precision"), [("colossalai_zero2", "bf16"), ("colossalai_zero2", "fp32"),
                                                 ("colossalai_gemini", "bf16")])
def test_one_rank_sharded_group_gathers_the_trained_weights(name, precision):
    """After STEPS steps of MICRO_BATCHES micro-batches each, the weights makers would receive are the naive
    mixed-precision trainer's (bf16: the rounded fp32 masters; fp32: a plain AdamW trainer's)."""
    _needs_sharded_colossalai()
    device = torch.device("cuda", torch.cuda.current_device())
    batches = _batches(device)
    initial, gathered = _sharded_run(name, precision, batches)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    expected = _naive_mixed_precision(tiny_causal_lm("llama", seed=4)[0].to(device), batches, dtype)
    assert gathered.keys() == expected.keys()
    for key, tensor in expected.items():
        assert gathered[key].dtype == dtype, key
        # bf16: one rounding step at most where HybridAdam's fp32 arithmetic differs from
        # AdamW's in the last bits.
        bf16 = dtype == torch.bfloat16
        tolerance = {"rtol": 1.6e-2, "atol": 1e-5} if bf16 else {"rtol": 1e-4, "atol": 1e-6}
        torch.testing.assert_close(gathered[key], tensor.cpu(), msg=key, **tolerance)
    moved = [k for k in gathered if not torch.equal(gathered[k], initial[k])]
    assert moved, "training moved no weight"


def test_gemini_without_accumulation_refuses_a_second_micro_batch_by_name():
    _needs_sharded_colossalai()
    device = torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(ValueError, match="micro_batch_size.*enable_gradient_accumulation"):
        _sharded_run("colossalai_gemini", "bf16", _batches(device), enable_gradient_accumulation=False)


# `strategy=` takes a strategy name or a Strategy; a callable (a factory) is refused wherever it is given.


def naive_factory() -> NaiveStrategy:
    return NaiveStrategy(device=lane_device())


def test_a_callable_strategy_is_refused_at_construction_naming_strategy():
    with pytest.raises(TypeError, match=r"trainer 't': strategy must be a strategy name.*strategy_fn"):
        PPOTrainerShell("t", lora_actor_critic, strategy=naive_factory)
    with pytest.raises(TypeError, match="strategy must be a strategy name"):
        make_strategy(naive_factory)
    with pytest.raises(ValueError, match="strategy 'fsdp' is not available"):
        PPOTrainerShell("t", lora_actor_critic, strategy="fsdp")
    with pytest.raises(TypeError, match="GRPOLearner: strategy must be a detached_rl Strategy"):
        GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_factory)
    learner = GRPOLearner(Actor(*tiny_causal_lm("llama", seed=0)), naive_strategy())
    learner.strategy = "naive"
    with pytest.raises(TypeError, match=r"TrainerCore 't': learner.strategy .*make_strategy"):
        TrainerCore("t", learner)
    actor, critic = lora_actor_critic("peft", seed=0)
    with pytest.raises(TypeError, match="maker 'm': strategy"):
        ExperienceMaker("m", MakerModels(actor=actor, critic=critic, reward=LowTokenReward()),
                        CyclingPrompts(arithmetic_prompts()), strategy=naive_factory)


def test_ppo_learner_refuses_a_callable_strategy():
    actor, critic = lora_actor_critic("peft", seed=0)
    with pytest.raises(TypeError, match="PPOLearner: strategy must be a detached_rl Strategy"):
        PPOLearner(actor, critic, naive_factory)
