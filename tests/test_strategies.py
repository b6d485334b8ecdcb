"""The naive strategy: optimizer over trainable parameters, stepping, chunked state dicts, atomic checkpoints;
strategies that cannot run here refuse at construction."""

import pytest
import torch

from detached_rl.models import LoraSettings, apply_lora, tiny_causal_lm
from detached_rl.strategies import NaiveStrategy, StrategyUnavailableError, make_strategy
from detached_rl.strategies import colossalai as colossalai_strategies
from detached_rl.strategies.optim import OptimizerConfig


def test_make_strategy_refuses_unknown_names():
    assert isinstance(make_strategy("naive"), NaiveStrategy)
    with pytest.raises(ValueError, match="'bogus'.*naive"):
        make_strategy("bogus")


def test_optimizer_covers_only_trainable_parameters_and_steps():
    strategy = NaiveStrategy()
    model = strategy.prepare_model(apply_lora(tiny_causal_lm("llama")[0], LoraSettings(r=4)))
    assert next(model.parameters()).device == strategy.device
    optimizer, scheduler = strategy.create_optimizer(model, OptimizerConfig(lr=1e-2, warmup_steps=2))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(p.numel() for p in trainable)
    before = [p.detach().clone() for p in trainable]
    loss = model(torch.tensor([[3, 4, 5, 6]]), labels=torch.tensor([[3, 4, 5, 6]])).loss
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
    strategy = NaiveStrategy()
    model = tiny_causal_lm("gpt2")[0]
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
    lora = apply_lora(tiny_causal_lm("llama")[0], LoraSettings(r=4))
    only = {k for c in strategy.iter_state_dict(lora, only_trainable=True) for k in c}
    assert only and all("lora_" in k for k in only)


def test_checkpoint_round_trip_and_atomic_replace(tmp_path):
    strategy = NaiveStrategy()
    model = tiny_causal_lm("llama", seed=1)[0]
    optimizer, _ = strategy.create_optimizer(model, OptimizerConfig(lr=1e-3))
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    strategy.optimizer_step(optimizer, model)
    path = strategy.save_checkpoint(tmp_path / "ckpt", model, optimizer, extra={"step": 1})
    strategy.save_checkpoint(path, model, optimizer, extra={"step": 2})  # replaces the first one whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    other = tiny_causal_lm("llama", seed=2)[0]
    other_optimizer, _ = strategy.create_optimizer(other, OptimizerConfig(lr=1e-3))
    assert strategy.load_checkpoint(path, other, other_optimizer) == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))
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
    [(dict(betas=(0.9, 1.0)), "betas"), (dict(schedule="step"), "schedule"), (dict(schedule="cosine"), "total_steps"),
     (dict(weight_decay=-1), "weight_decay"), (dict(max_grad_norm=0), "max_grad_norm")],
)
def test_optimizer_config_refuses_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=f"OptimizerConfig.{field}"):
        OptimizerConfig(**kwargs)


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
    with pytest.raises(StrategyUnavailableError, match=r"needs the colossalai package.*make colossalai.*'naive' or 'ddp'"):
        make_strategy("colossalai_ddp", **GROUP)


def test_prepare_training_is_prepare_model_plus_optimizer_and_gradient_share_is_one():
    strategy = NaiveStrategy()
    model, optimizer, scheduler = strategy.prepare_training(tiny_causal_lm("llama")[0], OptimizerConfig(lr=1e-3))
    assert scheduler.optimizer is optimizer and optimizer.param_groups[0]["lr"] == 1e-3
    assert strategy.gradient_share(17.0) == 1.0 and not strategy.shards_weights
    names = [name for name, _ in strategy.named_tensors(model, prefix="model.layers.0.")]
    assert names and all(not n.startswith("model.") for n in names)
