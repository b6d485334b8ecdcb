"""What a `detached-rl run` is before anything starts: its config, name, errors, GPU shares and CPU slots."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from detached_rl.config import RunConfig, load_config
from detached_rl.config.schema import RECIPE

DEFAULT_RUN_CONFIG = RECIPE  # the main job's recipe, which every config is laid over


class RunError(RuntimeError):
    """The run failed for a reason the message names (an actor's error, a timeout, a name in use)."""


class RunInterrupted(RunError):
    """Ctrl-C or SIGTERM: the run stopped early and shut down what it started."""


class ActorDied(RunError):
    """A call failed because the actor's process died (Ray may be restarting it)."""


def run_config(
    config_path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    steps: int | None = None,
    makers: int | None = None,
    model: str | None = None,
    task: str | None = None,
    name: str | None = None,
) -> RunConfig:
    """The defaults (`RunConfig`'s), then `config_path`, then the command-line flags, then `overrides`."""
    flags = []
    if steps is not None:
        flags.append(f"run.steps={steps}")
    if makers is not None:
        flags.append(f"run.makers={makers}")
    if model is not None:
        flags.append(f"model.policy={model}")
    if task is not None:
        flags += [f"task.name={task}", "task.reward=null"]  # the task's own reward
    if name is not None:
        flags.append(f"run.name={name}")
    return load_config(config_path, [*flags, *overrides])


def default_run_name(config: RunConfig) -> str:
    """"<variant>-<model>-<YYYYmmdd-HHMMSS>", e.g. grpo-smollm2-20261122-031500."""
    model = Path(config.model.policy).name or "model"
    variant = config.grpo.algorithm if config.algorithm == "grpo" else config.algorithm
    return f"{variant}-{model}-{datetime.now():%Y%m%d-%H%M%S}"


def run_gpus(config: RunConfig, cluster_gpus: float) -> RunConfig:
    """The config with the GPUs `run.gpus` gives the trainer and makers on a cluster of `cluster_gpus` GPUs.

    "auto" shares the cluster's GPUs (`gpu_shares`) unless `trainer_group.num_gpus_per_rank` or
    `maker.num_gpus` is set (> 0): values in the config win. "manual", or a cluster without GPUs:
    the config as it is. A trainer group of n ranks takes one GPU per rank and the makers share the
    rest; a cluster with GPUs but no more than n of them is refused (RunError): no share works there.
    """
    from detached_rl.actors.launch import uses_trainer_group
    from detached_rl.core.resources import gpu_shares

    if config.run.gpus != "auto" or config.trainer_group.num_gpus_per_rank > 0 or config.maker.num_gpus > 0:
        return config
    ranks = config.trainer_group.world_size if uses_trainer_group(config) else 1
    whole = math.floor(cluster_gpus + 1e-9)
    if ranks > 1 and whole >= 1:
        if whole <= ranks:
            raise RunError(f"run.gpus auto: a trainer group of {ranks} ranks takes one GPU each and the "
                           f"makers need more; the cluster has {cluster_gpus:g} GPUs (set "
                           "trainer_group.num_gpus_per_rank and maker.num_gpus, or run.gpus: manual)")
        cluster_gpus = whole - ranks + 1  # one of them stands for the group's: the makers share the others
    trainer, per_maker = gpu_shares(cluster_gpus, config.run.makers)
    if trainer == 0 and per_maker == 0:
        return config
    return dataclasses.replace(
        config, maker=dataclasses.replace(config.maker, num_gpus=per_maker),
        trainer_group=dataclasses.replace(config.trainer_group, num_gpus_per_rank=trainer))


def run_cpu_slots(config: RunConfig) -> int:
    """Logical CPUs an embedded cluster needs for the run's trainer ranks and makers (mostly waiting)."""
    group = config.trainer_group
    return math.ceil(group.world_size * group.num_cpus_per_rank + config.run.makers * config.maker.num_cpus)


@dataclass
class RunResult:
    """What `run_job` produced: where, how long, and the held-out figures before and after."""

    name: str
    directory: Path
    seconds: float
    steps: int
    before: dict[str, float]
    after: dict[str, float]
    files: dict[str, str] = field(default_factory=dict)


def check_vllm_installed() -> None:
    """Refuse `maker.backend: vllm` where the vllm package is not installed (RunError saying how to)."""
    from detached_rl.generation.vllm_config import VLLM_INSTALL_HINT, vllm_installed

    if not vllm_installed():
        raise RunError(f"maker.backend 'vllm' needs the vllm package, which is not installed; "
                       f"{VLLM_INSTALL_HINT}")
