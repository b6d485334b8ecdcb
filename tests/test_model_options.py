"""How models are loaded for training (issue 47.2): the attention kernel and gradient checkpointing, as the
model factories build them, and a kernel that is not installed refused before anything starts."""

from __future__ import annotations

import subprocess

import pytest
import torch

from detached_rl.config.factories import build_critic, build_policy, trainer_factory
from detached_rl.config.loading import load_config
from detached_rl.config.schema import ConfigError, ModelConfig
from tests.test_run_sockets import console_script, plain_environment


def test_the_attention_kernel_is_the_one_asked_for_and_a_bad_name_is_refused_by_key() -> None:
    assert build_policy(ModelConfig(policy="tiny", attn_implementation="eager")).model.config \
        ._attn_implementation == "eager"
    assert build_policy(ModelConfig(policy="tiny")).model.config._attn_implementation == "sdpa"
    assert build_policy(ModelConfig(policy="tiny-bloom")).model.config._attn_implementation == "eager"
    with pytest.raises(ConfigError, match="model.attn_implementation: .*must be one of"):
        load_config(None, ["model.attn_implementation=flash"])


def test_a_kernel_that_is_not_installed_stops_the_command_naming_it(tmp_path) -> None:
    done = subprocess.run([*console_script(), "run", "--model", "tiny", "--set",
                           "model.attn_implementation=flash_attention_2"], env=plain_environment(tmp_path),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert ("model.attn_implementation: 'flash_attention_2' needs the flash-attn package, which is not "
            "installed here") in done.stderr, done.stderr


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters' gradients of one backward pass of a fixed batch (dropout is off)."""
    ids = torch.arange(3, 35).reshape(2, 16)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def test_trainers_checkpoint_gradients_when_asked_and_get_the_same_ones_makers_never() -> None:
    config = load_config(None, ["model.policy=tiny", "model.gradient_checkpointing=true"])
    trained = trainer_factory(config)().model
    assert trained.base_model.model.is_gradient_checkpointing and not trained.config.use_cache
    made = build_policy(config.model).model  # a maker's: it never trains
    assert not made.base_model.model.is_gradient_checkpointing
    plain = build_policy(ModelConfig(policy="tiny", lora=config.model.lora), training=True).model
    assert not plain.base_model.model.is_gradient_checkpointing
    checkpointed, reference = gradients(trained), gradients(plain)
    assert checkpointed.keys() == reference.keys() and checkpointed
    for name, grad in checkpointed.items():
        torch.testing.assert_close(grad, reference[name], msg=name)


def test_a_ppo_trainers_critic_checkpoints_too_and_a_makers_does_not() -> None:
    config = load_config(None, ["algorithm=ppo", "model.policy=tiny", "model.gradient_checkpointing=true"])
    actor, critic = trainer_factory(config)()
    assert critic.backbone.is_gradient_checkpointing
    assert actor.model.base_model.model.is_gradient_checkpointing
    assert not build_critic(config.model).backbone.is_gradient_checkpointing
