"""Shared test factories: tiny PPO models, a token-level reward, an in-memory object store."""

from __future__ import annotations

import copy
import itertools
import threading

import torch

from detached_rl.maker.experience_maker import MakerModels
from detached_rl.models import Actor, Critic, tiny_causal_lm
from detached_rl.models.scalar_heads import backbone_of
from detached_rl.rewards.tasks import addition_problems

REWARDED_BELOW = 100


def make_experience(prompt=(5, 6, 7), response=(8, 9), reward=1.0, **kwargs):
    """A small valid Experience; keyword arguments override its fields."""
    from detached_rl import Experience

    n = len(response)
    return Experience(
        prompt_ids=torch.tensor(prompt, dtype=torch.long),
        response_ids=torch.tensor(response, dtype=torch.long),
        log_probs=kwargs.pop("log_probs", -torch.arange(1, n + 1, dtype=torch.float32) / 10),
        reward=torch.as_tensor(reward, dtype=torch.float32),
        **kwargs,
    )


class LowTokenReward:
    """Reward = fraction of response tokens with an id below REWARDED_BELOW (a signal tiny models can learn)."""

    def score(self, sequences, attention_mask, response_mask, metadata=None):
        response = sequences[:, -response_mask.shape[1]:]
        hits = ((response < REWARDED_BELOW) & (response_mask != 0)).float().sum(1)
        return hits / response_mask.sum(1).clamp(min=1)


def tiny_actor_critic(seed: int = 0) -> tuple[Actor, Critic]:
    """A tiny llama policy and a critic on another tiny llama, deterministic per seed."""
    policy, tokenizer = tiny_causal_lm("llama", seed=seed)
    value_model, _ = tiny_causal_lm("llama", seed=seed + 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        critic = Critic(backbone_of(value_model))
    return Actor(policy, tokenizer), critic


def tiny_maker_models(seed: int = 0, reference: bool = True) -> MakerModels:
    """Maker-side models: a policy, a critic, a reference policy and the token reward."""
    actor, critic = tiny_actor_critic(seed)
    ref = Actor(*tiny_causal_lm("llama", seed=seed)) if reference else None
    return MakerModels(actor=actor, critic=critic, reference=ref, reward=LowTokenReward())


def arithmetic_prompts(count: int = 32) -> list:
    """Deterministic prompts with answers."""
    return addition_problems(count, seed=0)


class ObjectStore:
    """`put` / `fetch` over a dict, counting puts (stands in for the Ray object store, which copies at put time)."""

    def __init__(self) -> None:
        self.objects: dict[int, object] = {}
        self.puts = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def put(self, value):
        with self._lock:
            key = next(self._ids)
            self.objects[key] = copy.deepcopy(value)
            self.puts += 1
            return key

    def fetch(self, key):
        return self.objects[key]


def lora_actor_critic(backend: str = "peft", seed: int = 0) -> tuple[Actor, Critic]:
    """A tiny llama policy with a LoRA adapter (peft or loralib) and a small critic."""
    from detached_rl.models import LoraSettings, apply_lora

    policy, tokenizer = tiny_causal_lm("llama", seed=seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        policy = apply_lora(policy, LoraSettings(backend=backend, r=4, alpha=8))
        critic = Critic(backbone_of(tiny_causal_lm("llama", seed=seed + 1)[0]))
    return Actor(policy, tokenizer), critic


def lora_maker_models(backend: str = "peft", seed: int = 0) -> MakerModels:
    """Maker-side models around a LoRA policy (no reference model: KL off)."""
    actor, critic = lora_actor_critic(backend, seed)
    return MakerModels(actor=actor, critic=critic, reward=LowTokenReward())


def tiny_policy(seed: int = 0) -> Actor:
    """A tiny llama policy (GRPO trainers need no critic)."""
    return Actor(*tiny_causal_lm("llama", seed=seed))


def grpo_maker_models(seed: int = 7) -> MakerModels:
    """A GRPO maker: the policy and the token reward (no critic, no reference)."""
    return MakerModels(actor=tiny_policy(seed), reward=LowTokenReward())
