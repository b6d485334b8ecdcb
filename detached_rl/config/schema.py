"""One typed configuration for the CLI, the examples and the Python API, loadable from YAML.

`RunConfig` gathers the settings of every part (models, task, sampling, maker, trainer, PPO)
as dataclasses. Its defaults are the main job's, the one set that every command and `RunConfig()`
start from: GRPO on SmolLM2-135M-Instruct with a LoRA adapter, word problems, two makers. Each value has
one home: a dataclass default, or, where the main job departs from the default of a class that is not the
run config's own (sampling, maker, trainer, GRPO, LoRA), the recipe `config/run.yaml`, which every section
of `RunConfig()` is built from (`main_job`). `load_config(path, overrides)` lays YAML and `key.sub=value`
overrides over the recipe (`detached_rl.config.loading`) and refuses unknown keys and bad values with a
`ConfigError` that names the dotted key. `RunConfig` also hands out the prompt source; the model factories
(`detached_rl.config.factories`) build from it. Nothing here imports torch.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detached_rl.algorithms.grpo_config import GRPOConfig
from detached_rl.algorithms.ppo_config import PPOConfig
from detached_rl.config.convert import ConfigError, from_data, read_yaml
from detached_rl.core.namespace import DEFAULT_NAMESPACE
from detached_rl.core.sampling import SamplingConfig
from detached_rl.maker.config import MakerConfig
from detached_rl.models.lora_settings import LoraSettings
from detached_rl.models.specs import REWARD_HEADS
from detached_rl.rewards.specs import RewardSpec, reward_specs
from detached_rl.scorer.config import ScorerGroupConfig
from detached_rl.trainer.config import TrainerConfig, TrainerGroupConfig

TASKS = ("addition", "word_problems")
TASK_REWARDS = {"addition": "numeric_answer", "word_problems": "answer_line"}  # how each task is graded
ALGORITHMS = ("ppo", "grpo")
ATTENTION_KERNELS = ("sdpa", "eager", "flash_attention_2")

# Where the main job departs from the defaults of the classes below the config layer: sections of plain data
# that `RunConfig()` and `load_config` build on (`main_job`).
RECIPE = Path(__file__).with_name("run.yaml")

__all__ = ["ALGORITHMS", "ATTENTION_KERNELS", "RECIPE", "RUN_GPUS", "TASKS", "TASK_REWARDS", "ConfigError",
           "ModelConfig", "RunConfig", "RunSection", "ScorersConfig", "TaskConfig", "main_job",
           "main_job_section"]


@dataclass
class ModelConfig:
    """Which models the makers and trainers build; specs are `smollm2`, `tiny[-<type>]`, a local directory or
    a Hugging Face Hub id (`org/name`: downloaded into the Hugging Face cache, or read from it offline)."""

    policy: str = "smollm2"
    # The policy's Hub revision (a branch, tag or commit; None: its main branch), for every process that loads
    # it: trainers, makers and the reference. Other Hub ids (critic, reward_model) load their main branch.
    revision: str | None = None
    trust_remote_code: bool = False  # run a Hub model's own modelling code (only for ids you trust)
    critic: str | None = None  # None: a critic on the policy's architecture (spec `policy`)
    reference: bool = True  # makers hold a frozen copy of the initial policy for the KL term
    # A trained reward model (spec as `policy`: a one-label ...ForSequenceClassification checkpoint, scored
    # with its own tokenizer) instead of the task's reward function.
    reward_model: str | None = None
    reward_head: str = "trained"  # or "fresh": a new random scalar head on a head-less backbone (the demo)
    lora: LoraSettings | None = field(default_factory=LoraSettings)  # None: train the whole policy
    seed: int = 0
    # The attention kernel of every model a process loads, as `from_pretrained(attn_implementation=...)` takes
    # it: "sdpa" (torch's), "eager", or "flash_attention_2" (the flash-attn package, on CUDA); None:
    # transformers' choice, sdpa where the architecture has it (all but a few, such as BLOOM), else eager.
    attn_implementation: str | None = None
    # Trainers recompute activations in the backward pass instead of keeping them (less memory for a longer
    # step; makers never train, so theirs is off).
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.reward_head not in REWARD_HEADS:
            raise ValueError(f"ModelConfig.reward_head must be one of {REWARD_HEADS}, got "
                             f"{self.reward_head!r}")
        if self.attn_implementation is not None and self.attn_implementation not in ATTENTION_KERNELS:
            raise ValueError(f"ModelConfig.attn_implementation must be one of {ATTENTION_KERNELS}, got "
                             f"{self.attn_implementation!r}")


@dataclass
class TaskConfig:
    """The prompt set and how it is graded: a built-in task (`name`), or the user's own data (`dataset`) and
    rewards (`reward` / `rewards`, by import path: docs/your-task.md)."""

    name: str = "word_problems"
    train_size: int = 2048
    # Held-out problems `detached-rl run` grades (before, during and after training): at 256 the standard
    # error of an accuracy near 50 % is 3.1 points, so two runs 10 points apart are told apart.
    eval_size: int = 256
    seed: int = 0
    # One reward: a built-in name or `module:function`; None: the task's own (`TASK_REWARDS`).
    reward: str | None = None
    # Several, weighted, each logged as `reward/<label>_mean`: [{fn: my_rewards:score, weight: 1.0}, ...].
    rewards: tuple[RewardSpec, ...] = ()
    # A reward call on a batch that runs longer is killed; its samples are refused (counted as "timeout").
    reward_timeout_s: float = 30.0
    # The user's data: a `save_to_disk` directory, .parquet, .jsonl, .json or .csv (`core.task_data`).
    dataset: str | None = None
    columns: dict[str, str] | None = None  # {prompt: question, answer: solution}; others are metadata
    held_out: float | str | None = None  # a fraction, a split name or a file; None: "test" split, else 0.1
    train_split: str = "train"  # the training split of a saved DatasetDict
    system_prompt: str | None = None
    # Prompts from a file (.csv/.jsonl/.json with a `prompt` and an optional `answer`
    # column) instead of `name`'s.
    prompt_file: str | None = None

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"TaskConfig.name must be one of {TASKS}, got {self.name!r}")
        if self.reward is None and not self.rewards:
            if self.dataset is not None:
                raise ValueError("TaskConfig.reward: task.dataset needs its reward named (task.reward: "
                                 "module:function, or task.rewards)")
            self.reward = TASK_REWARDS[self.name]
        self.rewards = tuple(self.rewards)
        reward_specs(self.reward, self.rewards, "TaskConfig")
        for name in ("train_size", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TaskConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"TaskConfig.reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if self.dataset is not None and self.prompt_file is not None:
            raise ValueError("TaskConfig.dataset: task.prompt_file is set too; give one")

    @property
    def reward_specs(self) -> list[RewardSpec]:
        """The rewards the task is graded with, in order (the first decides `correct` where none reports
        it)."""
        return reward_specs(self.reward, self.rewards, "task")


RUN_GPUS = ("auto", "manual")


@dataclass
class RunSection:
    """How `detached-rl run` drives a whole job: how long, how many makers, where the results go, which GPUs.

    `gpus`: "auto" (default) puts the trainer and the makers on the cluster's GPUs when it has some
    and neither `trainer_group.num_gpus_per_rank` nor `maker.num_gpus` is set (> 0): with one GPU
    the trainer takes half and the makers split the other half, with more the trainer takes one and
    the makers share the rest (`detached_rl.core.resources.gpu_shares`); on a cluster without GPUs
    nothing changes. "manual": only what those two keys say (default 0: all on the CPU). Values
    set in the config always win over "auto".
    """

    name: str | None = None  # None: "<algorithm>-<model>-<date>-<time>"
    steps: int = 28
    makers: int = 2
    output_dir: str = "runs"
    examples: int = 4  # decoded held-out examples shown before/after
    # A held-out curve point every this many steps, graded by the makers while they generate (0: before and
    # after training only); metrics.jsonl, TensorBoard and metrics.png show it.
    eval_every: int = 14
    # Torch threads per actor (0: torch's default). On 2 cores two trainer threads against two makers spin
    # in OpenMP barriers and run several times slower.
    trainer_threads: int = 1
    maker_threads: int = 1
    # Makers run this much nicer than the trainer: on a machine they share, the trainer (the bottleneck
    # when makers can run ahead) gets the CPU first and makers use what is left.
    maker_nice: int = 5
    progress: bool = True
    poll_interval_s: float = 1.0
    timeout_s: float = 3600.0  # the whole run, from start to shutdown
    gpus: str = "auto"  # "auto" | "manual": see the class docstring

    def __post_init__(self) -> None:
        for name in ("steps", "makers"):
            if getattr(self, name) < 1:
                raise ValueError(f"RunSection.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("examples", "eval_every", "trainer_threads", "maker_threads", "maker_nice"):
            if getattr(self, name) < 0:
                raise ValueError(f"RunSection.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("poll_interval_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RunSection.{name} must be > 0, got {getattr(self, name)}")
        if self.gpus not in RUN_GPUS:
            raise ValueError(f"RunSection.gpus must be one of {RUN_GPUS}, got {self.gpus!r}")
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ValueError(f"RunSection.name must be letters, digits, '.', '_' or '-', got {self.name!r}")


@dataclass
class ScorersConfig:
    """The shape and placement of each scorer group (used for the roles `maker.<role>_scorer` names)."""

    reward: ScorerGroupConfig = field(default_factory=ScorerGroupConfig)
    reference: ScorerGroupConfig = field(default_factory=ScorerGroupConfig)
    critic: ScorerGroupConfig = field(default_factory=ScorerGroupConfig)


@functools.cache
def _recipe() -> dict[str, Any]:
    return read_yaml(RECIPE)


def main_job() -> dict[str, Any]:
    """The main job's recipe (`RECIPE`) as plain data, a fresh copy: section -> the settings it changes."""
    return copy.deepcopy(_recipe())


def main_job_section(cls: type, name: str) -> Any:
    """Section `name` of the main job: a `cls` with the recipe's settings, `cls`'s defaults for the rest."""
    return from_data(cls, main_job().get(name, {}), name)


def _recipe_section(cls: type, name: str) -> Any:
    return field(default_factory=lambda: main_job_section(cls, name))


@dataclass
class RunConfig:
    """Everything a detached run needs; the defaults are the main job's (`detached-rl run`)."""

    namespace: str = DEFAULT_NAMESPACE
    algorithm: str = "grpo"  # "ppo" (critic, GAE) or "grpo" (the GRPO family, see `grpo.algorithm`)
    # Each section: its class's defaults with the recipe's settings laid over them.
    model: ModelConfig = _recipe_section(ModelConfig, "model")
    task: TaskConfig = _recipe_section(TaskConfig, "task")
    sampling: SamplingConfig = _recipe_section(SamplingConfig, "sampling")
    maker: MakerConfig = _recipe_section(MakerConfig, "maker")
    trainer: TrainerConfig = _recipe_section(TrainerConfig, "trainer")
    trainer_group: TrainerGroupConfig = _recipe_section(TrainerGroupConfig, "trainer_group")  # ranks
    ppo: PPOConfig = _recipe_section(PPOConfig, "ppo")
    grpo: GRPOConfig = _recipe_section(GRPOConfig, "grpo")
    run: RunSection = _recipe_section(RunSection, "run")
    scorers: ScorersConfig = _recipe_section(ScorersConfig, "scorers")

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"RunConfig.algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        # One sampling setting, given at the top only: the launch code hands it to the makers (`maker_config`)
        # and to the trainer's learner, which recomputes log-probs with it. No section holds a copy.
        try:
            self.grpo.check_overlong_buffer(self.sampling.max_new_tokens)
        except ValueError as error:
            raise ValueError(f"RunConfig.grpo: {str(error).removeprefix('GRPOConfig.')}") from None
        # A decaying learning-rate schedule spans the run unless its length is given.
        for section, name in ((self.grpo, "actor_optimizer"), (self.ppo, "actor_optimizer"),
                              (self.ppo, "critic_optimizer")):
            optimizer = getattr(section, name)
            if optimizer.schedule != "constant" and optimizer.total_steps is None:
                setattr(section, name, dataclasses.replace(optimizer, total_steps=self.run.steps))
        if self.grpo.group_size is not None and self.grpo.group_size != self.maker.group_size:
            raise ValueError(f"RunConfig.grpo.group_size {self.grpo.group_size} differs from "
                             f"maker.group_size {self.maker.group_size} (leave it unset: the trainer takes "
                             "the makers')")

    @property
    def algorithm_config(self) -> PPOConfig | GRPOConfig:
        """The trainer's algorithm settings (the learner takes the run's `sampling` separately); GRPO's
        `group_size` is the makers', so the trainer refuses pushes that are not whole groups."""
        if self.algorithm != "grpo":
            return self.ppo
        return self.grpo if self.grpo.group_size is not None else dataclasses.replace(
            self.grpo, group_size=self.maker.group_size)

    @property
    def maker_config(self) -> MakerConfig:
        """The makers' settings with the run's one `sampling` (a copy: the `maker` section carries none of its
        own), and, unless set, the LoRA adapter versions a vLLM engine keeps: `trainer.max_staleness` + 1."""
        vllm = self.maker.vllm
        if vllm.lora_versions_kept is None and self.trainer.max_staleness is not None:
            vllm = dataclasses.replace(vllm, lora_versions_kept=self.trainer.max_staleness + 1)
        return dataclasses.replace(self.maker, sampling=self.sampling, vllm=vllm)

    def prompts(self, shard: int = 0, num_shards: int = 1):
        """The training prompts as a cycling prompt source; makers take disjoint shards
        (`shard` of `num_shards`)."""
        from detached_rl.core.prompts import CyclingPrompts
        from detached_rl.rewards.tasks import make_problems

        if not 0 <= shard < num_shards:
            raise ValueError(f"prompts: shard must be in [0, {num_shards}), got {shard}")
        if self.task.dataset is not None:
            problems = self.task_data().train[shard::num_shards]
        elif self.task.prompt_file is not None:
            from detached_rl.core.prompts import load_prompt_file

            problems = load_prompt_file(self.task.prompt_file)[shard::num_shards]
        else:
            problems = make_problems(self.task.name, self.task.train_size,
                                     seed=self.task.seed)[shard::num_shards]
        if not problems:
            source = ("task.dataset" if self.task.dataset is not None else "task.prompt_file"
                      if self.task.prompt_file is not None else f"task.train_size={self.task.train_size}")
            raise ValueError(f"{source} has fewer prompts than the {num_shards} prompt shards")
        return CyclingPrompts(problems, seed=self.task.seed + shard)

    def eval_problems(self) -> list:
        """The held-out problems `detached-rl run` grades before and after training (of a dataset: its
        held-out split, at most `task.eval_size` of it)."""
        from detached_rl.rewards.tasks import make_problems

        if self.task.dataset is not None:
            return self.task_data().held_out[: self.task.eval_size]
        return make_problems(self.task.name, self.task.eval_size, seed=self.task.seed, split="test")

    def task_data(self):
        """The user's dataset (`task.dataset`) split into train and held-out prompts (`core.task_data`)."""
        from detached_rl.core.task_data import load_task_data, resolve_data_path

        task = self.task
        held_out = resolve_data_path(task.held_out) if isinstance(task.held_out, str) else task.held_out
        return load_task_data(resolve_data_path(task.dataset), task.columns, held_out, task.system_prompt,
                              task.train_split)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (as YAML would hold it); sampling appears once, at the top."""
        data = dataclasses.asdict(self)
        for section in ("maker", "ppo", "grpo"):
            data[section].pop("sampling")
        return data
