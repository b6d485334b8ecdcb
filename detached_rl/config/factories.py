"""Model factories: build the actors' models from a `RunConfig` (picklable through `functools.partial`).

The schema is data and imports nothing from here; these functions build from it, importing the models (torch)
only when they run.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from detached_rl.config.schema import ModelConfig, RunConfig, TaskConfig

if TYPE_CHECKING:
    from detached_rl.maker.experience_maker import MakerModels


def trainer_factory(config: RunConfig) -> functools.partial:
    """A picklable zero-argument factory of the trainer's models ((Actor, Critic) for PPO, Actor for GRPO)."""
    if config.algorithm == "grpo":
        return functools.partial(build_policy, config.model, training=True)
    return functools.partial(build_actor_critic, config.model, training=True)


def maker_factory(config: RunConfig) -> functools.partial:
    """A picklable zero-argument factory of a maker's models (GRPO makers hold only the policy)."""
    return functools.partial(build_maker_models, config.model, config.task, config.algorithm == "ppo",
                             frozenset(config.maker.scorers))


def scorer_factory(config: RunConfig, role: str) -> functools.partial:
    """A picklable zero-argument factory of the model a `role` scorer group serves."""
    return functools.partial(build_scorer_model, config.model, config.task, role)


def load_options(model: ModelConfig, spec: str) -> dict[str, Any]:
    """`load_causal_lm`'s options for `spec`: revision (the policy's applies to it only), remote code and the
    attention kernel."""
    return {"revision": model.revision if spec == model.policy else None,
            "trust_remote_code": model.trust_remote_code, "attn_implementation": model.attn_implementation}


def build_policy(model: ModelConfig, training: bool = False):
    """The policy `Actor` (with its LoRA adapter, if configured), from the model config; `training`: a
    trainer's, with gradient checkpointing when the config asks for it."""
    from detached_rl.models import Actor, apply_lora, load_causal_lm
    from detached_rl.models.loaders import seeded

    policy, tokenizer = load_causal_lm(model.policy, seed=model.seed, **load_options(model, model.policy))
    if training and model.gradient_checkpointing:
        checkpoint(policy)
    if model.lora is not None:
        with seeded(model.seed):  # the adapter's random initialisation too: the same config, the same policy
            policy = apply_lora(policy, model.lora)
    return Actor(policy, tokenizer)


def build_critic(model: ModelConfig, training: bool = False):
    """The critic (a value head on the critic's, else the policy's, architecture), from the model config; a
    `model.critic` that is a reward model (a sequence classifier) starts as that model, head included."""
    from detached_rl.models import Critic, load_causal_lm
    from detached_rl.models.loaders import seeded
    from detached_rl.models.scalar_heads import backbone_of
    from detached_rl.models.sequence_reward import critic_from_reward_model

    spec = model.critic or model.policy
    # A reward model named as the critic starts it, head included; else a new value head on the backbone.
    critic = critic_from_reward_model(spec, **load_options(model, spec)) if model.critic is not None else None
    if critic is None:
        critic_model, _ = load_causal_lm(spec, seed=model.seed + 1, **load_options(model, spec))
        with seeded(model.seed + 1):  # the value head too: the same config gives the same critic
            critic = Critic(backbone_of(critic_model))
    if training and model.gradient_checkpointing:
        checkpoint(critic.backbone)
    return critic


def build_actor_critic(model: ModelConfig, training: bool = False):
    """The policy and a critic, from the model config (`training`: as `build_policy`)."""
    return build_policy(model, training), build_critic(model, training)


def checkpoint(model) -> None:
    """Gradient checkpointing on a Hugging Face model, non-reentrant (torch's recommendation: it needs no
    input that requires grad, so a LoRA model's frozen embeddings work), and no KV cache while training."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def build_maker_models(model: ModelConfig, task: TaskConfig, with_critic: bool = True,
                       remote_roles: frozenset[str] = frozenset()) -> MakerModels:
    """A maker's policy, reward function and, for PPO, critic and reference model
    (none for `remote_roles`)."""
    from detached_rl.maker.experience_maker import MakerModels
    from detached_rl.models import Actor, load_causal_lm

    if with_critic and "critic" not in remote_roles:
        actor, critic = build_actor_critic(model)
    else:  # GRPO is critic-free; a remote critic is a scorer group's
        actor, critic = build_policy(model), None
    local_reference = with_critic and model.reference and "reference" not in remote_roles
    reference = (Actor(*load_causal_lm(model.policy, seed=model.seed, **load_options(model, model.policy)))
                 if local_reference else None)
    reward = None if "reward" in remote_roles else build_reward(model, task, actor.tokenizer)
    return MakerModels(actor=actor, critic=critic, reference=reference, reward=reward)


def build_reward(model: ModelConfig, task: TaskConfig, tokenizer):
    """The reward: a reward model when `model.reward_model` names one, else the task's reward function."""
    from detached_rl.models.sequence_reward import load_reward_model
    from detached_rl.rewards.task_reward import TaskReward

    if model.reward_model is None:
        return TaskReward(task.reward_specs, tokenizer, task.reward_timeout_s)
    return load_reward_model(model.reward_model, tokenizer, model.reward_head, seed=model.seed + 2,
                             **load_options(model, model.reward_model))


def build_scorer_model(model: ModelConfig, task: TaskConfig, role: str):
    """The model a scorer group serves: the reward function, the frozen reference policy, or the critic."""
    from detached_rl.models import Actor, load_causal_lm
    from detached_rl.models.loaders import load_tokenizer

    if role == "reward":  # the policy's tokenizer decodes the responses; its weights are not needed
        return build_reward(model, task, load_tokenizer(model.policy, revision=model.revision,
                                                        trust_remote_code=model.trust_remote_code))
    if role == "reference":
        return Actor(*load_causal_lm(model.policy, seed=model.seed, **load_options(model, model.policy)))
    if role == "critic":
        return build_critic(model)
    raise ValueError(f"build_scorer_model: unknown role {role!r}")
