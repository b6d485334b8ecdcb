"""The one place that creates named actors from a `RunConfig`: a trainer or trainer group, makers, scorer groups.

Two kinds of launch share it. `detached=True` (the cluster commands `detached-rl trainer|maker`):
the actors outlive the driver that creates them and ask for the config's custom resources.
`detached=False` (`detached-rl run`): the driver owns them and ends them with itself. The actor
class of a trainer comes from `TRAINER_CLASSES` by `config.algorithm`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

from detached_rl.actors.group import start_trainer_group, trainer_names
from detached_rl.actors.maker import ExperienceMakerHolder
from detached_rl.actors.scorer import start_scorer_group
from detached_rl.actors.trainer import trainer_class
from detached_rl.config.schema import RunConfig


def with_threads(threads: int, factory: Callable[[], Any], nice: int = 0) -> Any:
    """Call `factory` after capping this process's torch threads (0: leave torch's default) and raising its nice
    value by `nice` (lower CPU priority)."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    if nice > 0:
        os.nice(nice)
    return factory()


def _options(name: str, config: RunConfig, detached: bool, resources: dict[str, float]) -> dict[str, Any]:
    options: dict[str, Any] = {"name": name, "namespace": config.namespace}
    if detached:
        options.update(lifetime="detached", resources=dict(resources) or None)
    return options


def uses_trainer_group(config: RunConfig) -> bool:
    """True when `config.trainer_group` asks for more than one rank or a distributed strategy."""
    return not (config.trainer_group.world_size == 1 and config.trainer_group.strategy == "naive")


def trainer_names_of(config: RunConfig, name: str) -> list[str]:
    """The actor names `launch_trainers(config, name)` creates: `name`, or the ranks `name_0` … of a group."""
    return trainer_names(name, config.trainer_group.world_size) if uses_trainer_group(config) else [name]


def launch_trainer(config: RunConfig, name: str, detached: bool = True, threads: int = 0) -> Any:
    """Create one named trainer (strategy naive) for `config.algorithm`; `threads` caps its torch threads."""
    factory = config.trainer_factory()
    if threads > 0:
        factory = functools.partial(with_threads, threads, factory)
    options = _options(name, config, detached, config.trainer_group.resources)
    return trainer_class(config.algorithm).options(**options).remote(
        name, factory, config.trainer, config.algorithm_config, config.namespace, sampling=config.sampling)


def launch_trainers(config: RunConfig, name: str) -> list[Any]:
    """Create the detached trainer `name`, or the trainer group `name` (`config.trainer_group`); returns the handles.

    A group waits until its ranks formed their process group; if one fails or the ranks cannot be
    placed in time, nothing of the group is left and the error (RayTaskError, TimeoutError) is raised.
    """
    if not uses_trainer_group(config):
        return [launch_trainer(config, name)]
    group = config.trainer_group
    return start_trainer_group(name, group.world_size, config.trainer_factory(), config.trainer,
                               config.algorithm_config, config.namespace, strategy=group.strategy, group=group,
                               timeout=group.timeout_s, sampling=config.sampling)


def launch_maker(
    config: RunConfig,
    name: str,
    trainers: Sequence[str],
    shard: tuple[int, int] = (0, 1),
    state_path: str | None = None,
    detached: bool = True,
    threads: int = 0,
    nice: int = 0,
) -> Any:
    """Create a named experience maker feeding `trainers` with prompt shard `shard` = (index, count).

    `state_path`: where it saves its prompt cursor and counters after every batch (and resumes from);
    `threads` and `nice` cap its torch threads and lower its CPU priority.
    """
    factory = config.maker_factory()
    if threads > 0 or nice > 0:
        factory = functools.partial(with_threads, threads, factory, nice)
    options = _options(name, config, detached, config.maker.resources)
    return ExperienceMakerHolder.options(max_restarts=config.maker.max_restarts, **options).remote(
        name, list(trainers), factory, config.prompts(*shard), config.maker_config, config.namespace,
        state_path=state_path,
    )


def launch_scorer_group(config: RunConfig, role: str, trainers: Sequence[str] = ()) -> list[Any]:
    """Start the scorer group the makers' config names for `role` (`maker.<role>_scorer`), shaped by
    `config.scorers.<role>`; a critic group takes its weights from `trainers`. Returns the worker handles."""
    prefix = config.maker.scorers[role]
    return start_scorer_group(prefix, role, config.scorer_factory(role), getattr(config.scorers, role),
                              config.sampling, config.namespace, trainers if role == "critic" else ())
