"""One typed configuration for the CLI, the examples and the Python API, loadable from YAML.

`RunConfig` gathers the settings of every part (models, task, sampling, maker, trainer, PPO)
as dataclasses with working defaults. `load_config(path, overrides)` reads YAML, applies
`key.sub=value` overrides from the command line, and refuses unknown keys and bad values
with a `ConfigError` that names the dotted key. `RunConfig` also builds what the actors
need: model factories (picklable, so Ray can ship them) and the prompt source.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from detached_rl.grpo import GRPOConfig
from detached_rl.maker import MakerConfig, MakerModels
from detached_rl.models.generation import SamplingConfig
from detached_rl.ppo import PPOConfig
from detached_rl.rewards import REWARD_FUNCTIONS
from detached_rl.scorers import ScorerGroupConfig
from detached_rl.trainer import TrainerConfig, TrainerGroupConfig

TASKS = ("addition", "word_problems")
ALGORITHMS = ("ppo", "grpo")


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names the dotted key."""


@dataclass
class LoraConfig:
    """LoRA adapter on the policy (see `detached_rl.models.LoraSettings`)."""

    backend: str = "peft"
    r: int = 8
    alpha: float = 16
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None


@dataclass
class ModelConfig:
    """Which models the makers and trainers build; specs are `smollm2`, `tiny[-<type>]` or a local directory."""

    policy: str = "tiny"
    critic: str | None = None  # None: a critic on the policy's architecture (spec `policy`)
    reference: bool = True  # makers hold a frozen copy of the initial policy for the KL term
    # A reward model (spec as `policy`: a scalar head on that backbone) instead of the task's reward function.
    reward_model: str | None = None
    lora: LoraConfig | None = None
    seed: int = 0


@dataclass
class TaskConfig:
    """The prompt set and how it is graded."""

    name: str = "addition"
    train_size: int = 256
    eval_size: int = 64  # held-out problems for `detached-rl run`'s before/after accuracy
    seed: int = 0
    reward: str = "numeric_answer"
    # Prompts from a file (.csv/.jsonl/.json with a `prompt` and an optional `answer` column) instead of `name`'s.
    prompt_file: str | None = None

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"TaskConfig.name must be one of {TASKS}, got {self.name!r}")
        if self.reward not in REWARD_FUNCTIONS:
            raise ValueError(f"TaskConfig.reward must be one of {tuple(REWARD_FUNCTIONS)}, got {self.reward!r}")
        for name in ("train_size", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TaskConfig.{name} must be >= 1, got {getattr(self, name)}")


TASK_REWARDS = {"addition": "numeric_answer", "word_problems": "answer_line"}


@dataclass
class RunSection:
    """How `detached-rl run` drives a whole job: how long, how many makers, where the results go."""

    name: str | None = None  # None: "<algorithm>-<model>-<date>-<time>"
    steps: int = 30
    makers: int = 2
    output_dir: str = "runs"
    examples: int = 4  # decoded held-out examples shown before/after
    trainer_threads: int = 0  # torch threads per actor; 0: torch's default
    maker_threads: int = 0
    # Makers run this much nicer than the trainer: on a machine they share, the trainer (the bottleneck
    # when makers can run ahead) gets the CPU first and makers use what is left.
    maker_nice: int = 0
    progress: bool = True
    poll_interval_s: float = 1.0
    timeout_s: float = 3600.0  # the whole run, from start to shutdown

    def __post_init__(self) -> None:
        for name in ("steps", "makers"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunSection.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("examples", "trainer_threads", "maker_threads", "maker_nice"):
            if getattr(self, name) < 0:
                raise ValueError(f"RunSection.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("poll_interval_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RunSection.{name} must be > 0, got {getattr(self, name)}")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ValueError(f"RunSection.name must be letters, digits, '.', '_' or '-', got {self.name!r}")


@dataclass
class ScorersConfig:
    """The shape and placement of each scorer group (used for the roles `maker.<role>_scorer` names)."""

    reward: ScorerGroupConfig = field(default_factory=ScorerGroupConfig)
    reference: ScorerGroupConfig = field(default_factory=ScorerGroupConfig)
    critic: ScorerGroupConfig = field(default_factory=ScorerGroupConfig)


@dataclass
class RunConfig:
    """Everything a detached run needs; every field has a default that works."""

    namespace: str = "detached_rl"
    algorithm: str = "ppo"  # "ppo" (critic, GAE) or "grpo" (the GRPO family, see `grpo.algorithm`)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=32))
    maker: MakerConfig = field(default_factory=MakerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    trainer_group: TrainerGroupConfig = field(default_factory=TrainerGroupConfig)  # ranks, strategy, placement
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    run: RunSection = field(default_factory=RunSection)
    scorers: ScorersConfig = field(default_factory=ScorersConfig)

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"RunConfig.algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        # One sampling setting: the makers sample with it and the trainer recomputes log-probs with it.
        self.maker.sampling = self.sampling
        self.ppo.sampling = self.sampling
        self.grpo.sampling = self.sampling

    @property
    def algorithm_config(self) -> PPOConfig | GRPOConfig:
        """The trainer's algorithm settings."""
        return self.grpo if self.algorithm == "grpo" else self.ppo

    def trainer_factory(self) -> functools.partial:
        """A picklable zero-argument factory of the trainer's models ((Actor, Critic) for PPO, Actor for GRPO)."""
        if self.algorithm == "grpo":
            return functools.partial(build_policy, self.model)
        return functools.partial(build_actor_critic, self.model)

    def maker_factory(self) -> functools.partial:
        """A picklable zero-argument factory of a maker's models (GRPO makers hold only the policy)."""
        return functools.partial(build_maker_models, self.model, self.task, self.algorithm == "ppo",
                                 frozenset(self.maker.scorers))

    def scorer_factory(self, role: str) -> functools.partial:
        """A picklable zero-argument factory of the model a `role` scorer group serves."""
        return functools.partial(build_scorer_model, self.model, self.task, role)

    def prompts(self, shard: int = 0, num_shards: int = 1):
        """The training prompts as a cycling prompt source; makers take disjoint shards (`shard` of `num_shards`)."""
        from detached_rl.prompts import CyclingPrompts
        from detached_rl.tasks import make_problems

        if not 0 <= shard < num_shards:
            raise ValueError(f"prompts: shard must be in [0, {num_shards}), got {shard}")
        if self.task.prompt_file is not None:
            from detached_rl.prompts import load_prompt_file

            problems = load_prompt_file(self.task.prompt_file)[shard::num_shards]
        else:
            problems = make_problems(self.task.name, self.task.train_size, seed=self.task.seed)[shard::num_shards]
        if not problems:
            source = "task.prompt_file" if self.task.prompt_file is not None else f"task.train_size={self.task.train_size}"
            raise ValueError(f"{source} has fewer prompts than the {num_shards} prompt shards")
        return CyclingPrompts(problems, seed=self.task.seed + shard)

    def eval_problems(self) -> list:
        """The held-out problems `detached-rl run` grades before and after training."""
        from detached_rl.tasks import make_problems

        return make_problems(self.task.name, self.task.eval_size, seed=self.task.seed, split="test")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (as YAML would hold it); sampling appears once, at the top."""
        data = dataclasses.asdict(self)
        for section in ("maker", "ppo", "grpo"):
            data[section].pop("sampling")
        return data


def build_policy(model: ModelConfig):
    """The policy `Actor` (with its LoRA adapter, if configured), from the model config."""
    from detached_rl.models import Actor, LoraSettings, apply_lora, load_causal_lm

    policy, tokenizer = load_causal_lm(model.policy, seed=model.seed)
    if model.lora is not None:
        policy = apply_lora(policy, LoraSettings(**dataclasses.asdict(model.lora)))
    return Actor(policy, tokenizer)


def build_critic(model: ModelConfig):
    """The critic (a value head on the critic's, else the policy's, architecture), from the model config."""
    from detached_rl.models import Critic, load_causal_lm
    from detached_rl.models.scalar_heads import backbone_of

    critic_model, _ = load_causal_lm(model.critic or model.policy, seed=model.seed + 1)
    with torch.random.fork_rng(devices=[]):  # the value head too: the same config gives the same critic
        torch.manual_seed(model.seed + 1)
        return Critic(backbone_of(critic_model))


def build_actor_critic(model: ModelConfig):
    """The policy and a critic, from the model config."""
    return build_policy(model), build_critic(model)


def build_maker_models(model: ModelConfig, task: TaskConfig, with_critic: bool = True,
                       remote_roles: frozenset[str] = frozenset()) -> MakerModels:
    """A maker's policy, reward function and, for PPO, critic and reference model (none for `remote_roles`)."""
    from detached_rl.models import Actor, load_causal_lm

    if with_critic and "critic" not in remote_roles:
        actor, critic = build_actor_critic(model)
    else:  # GRPO is critic-free; a remote critic is a scorer group's
        actor, critic = build_policy(model), None
    local_reference = with_critic and model.reference and "reference" not in remote_roles
    reference = Actor(*load_causal_lm(model.policy, seed=model.seed)) if local_reference else None
    reward = None if "reward" in remote_roles else build_reward(model, task, actor.tokenizer)
    return MakerModels(actor=actor, critic=critic, reference=reference, reward=reward)


def build_reward(model: ModelConfig, task: TaskConfig, tokenizer):
    """The reward: a reward model when `model.reward_model` names one, else the task's reward function."""
    from detached_rl.models import FunctionReward, load_causal_lm
    from detached_rl.models.scalar_heads import RewardModel, backbone_of

    if model.reward_model is None:
        return FunctionReward(REWARD_FUNCTIONS[task.reward], tokenizer)
    backbone, _ = load_causal_lm(model.reward_model, seed=model.seed + 2)
    with torch.random.fork_rng(devices=[]):  # a seeded head: the same config gives the same reward model
        torch.manual_seed(model.seed + 2)
        return RewardModel(backbone_of(backbone)).eval()


def build_scorer_model(model: ModelConfig, task: TaskConfig, role: str):
    """The model a scorer group serves: the reward function, the frozen reference policy, or the critic."""
    from detached_rl.models import Actor, load_causal_lm
    from detached_rl.models.loaders import load_tokenizer

    if role == "reward":  # the policy's tokenizer decodes the responses; its weights are not needed
        return build_reward(model, task, load_tokenizer(model.policy))
    if role == "reference":
        return Actor(*load_causal_lm(model.policy, seed=model.seed))
    if role == "critic":
        return build_critic(model)
    raise ValueError(f"build_scorer_model: unknown role {role!r}")


# ------------------------------------------------------------------ dict -> dataclass

def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from nested plain data, checking keys and value types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields or (cls in (MakerConfig, PPOConfig, GRPOConfig) and key == "sampling"):
            known = ", ".join(sorted(k for k in fields
                                     if not (cls in (MakerConfig, PPOConfig, GRPOConfig) and k == "sampling")))
            raise ConfigError(f"{dotted}: unknown key (known keys: {known})")
        kwargs[key] = _convert(hints[key], value, dotted)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as error:
        # "MakerConfig.push_policy must be ..." -> "maker.push_policy: must be ..."
        message = str(error)
        match = re.match(rf"{cls.__name__}\.(\w+)(?::)? (.*)", message, flags=re.DOTALL)
        if match:
            key = f"{path}.{match.group(1)}" if path else match.group(1)
            raise ConfigError(f"{key}: {match.group(2)}") from None
        raise ConfigError(f"{path or 'config'}: {message}") from None


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{path}: must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {hint}")
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_hint, value_hint = typing.get_args(hint)
        return {_convert(key_hint, k, f"{path}.{k}"): _convert(value_hint, v, f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if item is None:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {error}") from None
    return key.strip().split("."), value


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML file's top-level mapping (empty for an empty file); refuses missing files and bad YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {error}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r}: the top level must be a mapping")
    return loaded or {}


def merge_mappings(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` laid over `base`: nested mappings merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_mappings(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: str | os.PathLike | None = None,
) -> RunConfig:
    """Read a YAML config (laid over the `base` YAML, else the defaults), apply overrides, validate."""
    data: dict[str, Any] = read_yaml(base) if base is not None else {}
    if path is not None:
        data = merge_mappings(data, read_yaml(path))
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {'.'.join(keys[: depth + 1])}: is not a mapping")
            node = child
        node[keys[-1]] = value
    return from_dict(RunConfig, data)


def dump_config(config: RunConfig) -> str:
    """The config as YAML (tuples as lists)."""
    return yaml.safe_dump(_plain(config.to_dict()), sort_keys=False)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
