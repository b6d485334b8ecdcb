"""One typed configuration for the CLI, the examples and the Python API, loadable from YAML.

`RunConfig` gathers the settings of every part (models, task, sampling, maker, trainer, PPO)
as dataclasses. Its defaults are the main job's, the one set that every command and `RunConfig()`
start from: GRPO on SmolLM2-135M-Instruct with a LoRA adapter, word problems, two makers
(`config/run.yaml` states them for reading; a test holds it to them). `load_config(path, overrides)`
reads YAML, applies `key.sub=value` overrides from the command line (`detached_rl.config.loading`),
and refuses unknown keys and bad values with a `ConfigError` that names the dotted key. `RunConfig` also
hands out the prompt source; the model factories (`detached_rl.config.factories`) build from it.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from detached_rl.algorithms.grpo import GRPOConfig
from detached_rl.algorithms.ppo import PPOConfig
from detached_rl.core.namespace import DEFAULT_NAMESPACE
from detached_rl.core.sampling import SamplingConfig
from detached_rl.maker.experience_maker import MakerConfig
from detached_rl.rewards.functions import REWARD_FUNCTIONS
from detached_rl.scorer.config import ScorerGroupConfig
from detached_rl.trainer.config import TrainerConfig, TrainerGroupConfig

TASKS = ("addition", "word_problems")
TASK_REWARDS = {"addition": "numeric_answer", "word_problems": "answer_line"}  # how each task is graded
ALGORITHMS = ("ppo", "grpo")


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names the dotted key."""


@dataclass
class LoraConfig:
    """LoRA adapter on the policy (see `detached_rl.models.LoraSettings`)."""

    backend: str = "peft"
    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = ("all-linear",)  # every Linear layer but the output head


@dataclass
class ModelConfig:
    """Which models the makers and trainers build; specs are `smollm2`,
    `tiny[-<type>]` or a local directory."""

    policy: str = "smollm2"
    critic: str | None = None  # None: a critic on the policy's architecture (spec `policy`)
    reference: bool = True  # makers hold a frozen copy of the initial policy for the KL term
    # A reward model (spec as `policy`: a scalar head on that backbone) instead of the task's reward function.
    reward_model: str | None = None
    lora: LoraConfig | None = field(default_factory=LoraConfig)  # None: train the whole policy
    seed: int = 0


@dataclass
class TaskConfig:
    """The prompt set and how it is graded."""

    name: str = "word_problems"
    train_size: int = 2048
    # Held-out problems `detached-rl run` grades (before, during and after training): at 256 the standard
    # error of an accuracy near 50 % is 3.1 points, so two runs 10 points apart are told apart.
    eval_size: int = 256
    seed: int = 0
    reward: str | None = None  # None: the task's own (`TASK_REWARDS`)
    # Prompts from a file (.csv/.jsonl/.json with a `prompt` and an optional `answer`
    # column) instead of `name`'s.
    prompt_file: str | None = None

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"TaskConfig.name must be one of {TASKS}, got {self.name!r}")
        if self.reward is None:
            self.reward = TASK_REWARDS[self.name]
        if self.reward not in REWARD_FUNCTIONS:
            raise ValueError(f"TaskConfig.reward must be one of {tuple(REWARD_FUNCTIONS)}, got "
                             f"{self.reward!r}")
        for name in ("train_size", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TaskConfig.{name} must be >= 1, got {getattr(self, name)}")


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


# The main job's settings of the sections whose classes live in other layers, where they differ from
# those classes' own defaults. Data, not instances: `from_dict` lays a config's own data over it, so a
# preset picked there (e.g. `grpo.algorithm: dapo`) fills in what neither says.
MAIN_JOB: dict[str, dict[str, Any]] = {
    "sampling": {"max_new_tokens": 40, "temperature": 0.8},
    # vLLM where it serves the policy; 2 prompts x 8 answers = 16 samples per push (4 x 4 learned the answer
    # format more slowly: docs/performance.md, the recipe study), one push in flight; the next batch once the
    # last is in the buffer (fresher samples).
    "maker": {"backend": "auto", "experience_batch_size": 2, "group_size": 8, "max_pushes_in_flight": 1,
              "wait_for_ack": True},
    # LoRA-only updates pushed while it trains on. Samples at most 1 version old: vLLM makers outrun the
    # trainer, and at 4 they trained on 3-4 step old samples and learned half as much. A 32-sample buffer
    # (one push per maker): makers wait instead of generating samples that would go stale.
    "trainer": {"train_batch_size": 16, "weight_sync": "lora", "overlap_weight_push": True,
                "max_staleness": 1, "buffer_max_samples": 32},
    # lr 5e-4 decayed along a cosine to 5e-5 by the last step (at a constant 5e-4 the policy peaked, then
    # collapsed, over 36 steps) and a KL coefficient of 0.1 (at 0.01 one seed in five kept the answer format
    # and lost its arithmetic): docs/performance.md, the recipe study; token-mean: no per-sequence length
    # normalisation (short answers get no extra weight); the trainer's forward passes in bfloat16.
    "grpo": {"algorithm": "grpo", "actor_optimizer": {"lr": 5e-4, "schedule": "cosine", "min_lr_ratio": 0.1},
             "loss_agg": "token-mean",
             "kl_coef": 0.1, "proximal_recompute": True, "micro_batch_size": 16,
             "autocast_dtype": "bfloat16"},
}


def main_job_section(cls: type, name: str) -> Any:
    """Section `name` of the main job, built as a `cls` from `MAIN_JOB` (nested sections too)."""
    hints = typing.get_type_hints(cls)
    data = {key: hints[key](**value) if isinstance(value, dict) and dataclasses.is_dataclass(hints[key])
            else value for key, value in MAIN_JOB[name].items()}
    return cls(**data)


@dataclass
class RunConfig:
    """Everything a detached run needs; the defaults are the main job's (`detached-rl run`)."""

    namespace: str = DEFAULT_NAMESPACE
    algorithm: str = "grpo"  # "ppo" (critic, GAE) or "grpo" (the GRPO family, see `grpo.algorithm`)
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sampling: SamplingConfig = field(default_factory=lambda: main_job_section(SamplingConfig, "sampling"))
    maker: MakerConfig = field(default_factory=lambda: main_job_section(MakerConfig, "maker"))
    trainer: TrainerConfig = field(default_factory=lambda: main_job_section(TrainerConfig, "trainer"))
    # ranks, strategy, placement
    trainer_group: TrainerGroupConfig = field(default_factory=TrainerGroupConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    grpo: GRPOConfig = field(default_factory=lambda: main_job_section(GRPOConfig, "grpo"))
    run: RunSection = field(default_factory=RunSection)
    scorers: ScorersConfig = field(default_factory=ScorersConfig)

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
        if self.task.prompt_file is not None:
            from detached_rl.core.prompts import load_prompt_file

            problems = load_prompt_file(self.task.prompt_file)[shard::num_shards]
        else:
            problems = make_problems(self.task.name, self.task.train_size,
                                     seed=self.task.seed)[shard::num_shards]
        if not problems:
            source = ("task.prompt_file" if self.task.prompt_file is not None
                      else f"task.train_size={self.task.train_size}")
            raise ValueError(f"{source} has fewer prompts than the {num_shards} prompt shards")
        return CyclingPrompts(problems, seed=self.task.seed + shard)

    def eval_problems(self) -> list:
        """The held-out problems `detached-rl run` grades before and after training."""
        from detached_rl.rewards.tasks import make_problems

        return make_problems(self.task.name, self.task.eval_size, seed=self.task.seed, split="test")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (as YAML would hold it); sampling appears once, at the top."""
        data = dataclasses.asdict(self)
        for section in ("maker", "ppo", "grpo"):
            data[section].pop("sampling")
        return data
