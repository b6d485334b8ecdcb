"""The one place that creates named actors from a `RunConfig`: a trainer or trainer group, makers, scorer
groups.

Two kinds of launch share it. `detached=True` (the cluster commands `detached-rl trainer|maker`):
the actors outlive the driver that creates them and ask for the config's custom resources.
`detached=False` (`detached-rl run`): the driver owns them and ends them with itself. The actor
class of a trainer comes from `TRAINER_CLASSES` by `config.algorithm`.

Every actor asks Ray for its CPUs and GPUs: a trainer (a naive one is a 1-rank group) for
`trainer_group.num_cpus_per_rank`/`num_gpus_per_rank`, a maker for `maker.num_cpus`/`num_gpus`,
a scorer worker for its group's bundle. Callers check the whole launch first with
`check_placeable(launch_requests(...))`, which refuses at once what the cluster can never place.

Placement by the user's choice (`placed`, by default the same as `detached`; `detached-rl run` passes it when
it joins a cluster): custom resources (`maker.resources`, `trainer_group.resources`) and node labels
(`maker.label_selector`, `trainer_group.label_selector`: Ray's `label_selector`, a group's as its placement
group's `bundle_label_selector`). A launch whose labels no alive node carries is refused at once
(`check_labels`), naming the labels; Ray would otherwise keep the actor pending for ever.

A maker's constructor arguments stay small (`check_inline_arguments`): Ray puts an argument over
its inlining limit in the object store, and an actor restarted after its process died cannot get
it back (Ray issue 53727: the restart dies with ReferenceCountingAssertionError; a detached
maker's arguments are even owned by a driver that has exited). So a maker gets its prompts as a
factory it calls itself, not as the (hundreds of kB) prompt list.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from detached_rl.actors.maker import ExperienceMakerHolder
from detached_rl.actors.scorer import scorer_names, start_scorer_group
from detached_rl.actors.trainer import trainer_class
from detached_rl.actors.trainer_group import start_trainer_group, trainer_names
from detached_rl.config.factories import maker_factory, scorer_factory, trainer_factory
from detached_rl.config.schema import RunConfig
from detached_rl.config.shipping import shipped_config
from detached_rl.core.labels import unmatched
from detached_rl.core.resources import UnplaceableError, resource_request, unplaceable

# Ray's `max_direct_call_object_size` (its default): a task or actor argument whose serialised form is larger
# goes to the object store instead of travelling inside the call.
INLINE_ARGUMENT_BYTES = 100 * 1024


def check_inline_arguments(what: str, arguments: dict[str, Any]) -> None:
    """Refuse (ValueError naming the argument and its size) an argument Ray would put in the object store,
    where a restarted actor cannot find it."""
    from ray import cloudpickle

    for name, value in arguments.items():
        size = len(cloudpickle.dumps(value))
        if size > INLINE_ARGUMENT_BYTES:
            raise ValueError(f"{what}: constructor argument {name!r} is {size} bytes serialised, over "
                             f"Ray's inlining limit of {INLINE_ARGUMENT_BYTES}; it would live in the "
                             "object store, from which a restarted actor cannot read it (pass "
                             "something it can build itself)")


def prompt_factory(config: RunConfig, shard: tuple[int, int] = (0, 1)) -> Callable[[], Any]:
    """A small picklable zero-argument factory of the prompt shard `shard` = (index, count), built where it is
    called.

    Checked here once (a `task.prompt_file` it cannot read, fewer prompts than shards fail now, not
    in the actor). The actor reads `task.prompt_file` itself, as it loads `model.policy`: on a cluster
    of several machines the file must be at the same path on the maker's; a relative path is made
    absolute here, as the actor's working directory may differ.
    """
    config.prompts(*shard)
    config = shipped_config(config)[0]  # a dataset is read from the copy shipped with the actor
    if config.task.prompt_file is not None:
        task = dataclasses.replace(config.task, prompt_file=str(Path(config.task.prompt_file).resolve()))
        config = dataclasses.replace(config, task=task)
    return functools.partial(config.prompts, *shard)


def with_threads(threads: int, factory: Callable[[], Any], nice: int = 0) -> Any:
    """Call `factory` after capping this process's torch threads (0: leave torch's default) and raising its
    nice value by `nice` (lower CPU priority)."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)
    if nice > 0:
        os.nice(nice)
    return factory()


def _options(name: str, config: RunConfig, detached: bool, request: dict[str, float],
             label_selector: dict[str, str] | None = None) -> dict[str, Any]:
    """Actor options asking Ray for `request` (CPU, GPU and custom resources), on a node with the labels
    `label_selector`; a detached actor outlives its driver."""
    custom = {key: amount for key, amount in request.items() if key not in ("CPU", "GPU")}
    options: dict[str, Any] = {"name": name, "namespace": config.namespace,
                               "num_cpus": request.get("CPU", 0.0),
                               "num_gpus": request.get("GPU", 0.0)}
    if detached:
        options.update(lifetime="detached")
    if custom:
        options.update(resources=custom)
    if label_selector:
        options.update(label_selector=dict(label_selector))
    return options


def trainer_request(config: RunConfig, detached: bool = True) -> dict[str, float]:
    """What one trainer rank asks Ray for (`trainer_group`: CPUs, GPUs, and
    custom resources when `detached`, i.e. placed by the config)."""
    group = config.trainer_group
    return resource_request(group.num_cpus_per_rank, group.num_gpus_per_rank,
                            group.resources if detached else None)


def maker_request(config: RunConfig, detached: bool = True) -> dict[str, float]:
    """What one maker asks Ray for (`maker.num_cpus`, `maker.num_gpus`, and
    `maker.resources` when `detached`, i.e. placed by the config)."""
    maker = config.maker
    return resource_request(maker.num_cpus, maker.num_gpus, maker.resources if detached else None)


def scorer_request(config: RunConfig, role: str) -> dict[str, float]:
    """What one worker of the `role` scorer group asks Ray for (its placement-group bundle)."""
    return dict(getattr(config.scorers, role).bundle())


def launch_requests(config: RunConfig, trainer: str | None = None, makers: Sequence[str] = (),
                    scorer_roles: Sequence[str] = (), detached: bool = True) -> dict[str, dict[str, float]]:
    """Label ("maker m0", "trainer rank t_1", ...) -> resources of every actor
    launching these roles creates."""
    requests: dict[str, dict[str, float]] = {}
    if trainer is not None:
        kind = "trainer rank" if uses_trainer_group(config) else "trainer"
        for name in trainer_names_of(config, trainer):
            requests[f"{kind} {name}"] = trainer_request(config, detached)
    for name in makers:
        requests[f"maker {name}"] = maker_request(config, detached)
    for role in scorer_roles:
        group = getattr(config.scorers, role)
        for name in scorer_names(config.maker.scorers[role], group.num_workers):
            requests[f"{role} scorer {name}"] = scorer_request(config, role)
    return requests


def launch_selectors(config: RunConfig, trainer: str | None = None, makers: Sequence[str] = ()
                     ) -> dict[str, dict[str, str]]:
    """Label ("maker m0", "trainer rank t_1", ...) -> the node labels each actor of this launch asks for
    (only those that ask for some)."""
    selectors: dict[str, dict[str, str]] = {}
    if trainer is not None and config.trainer_group.label_selector:
        kind = "trainer rank" if uses_trainer_group(config) else "trainer"
        for name in trainer_names_of(config, trainer):
            selectors[f"{kind} {name}"] = dict(config.trainer_group.label_selector)
    if config.maker.label_selector:
        for name in makers:
            selectors[f"maker {name}"] = dict(config.maker.label_selector)
    return selectors


def check_labels(selectors: dict[str, dict[str, str]]) -> None:
    """Refuse at once (`UnplaceableError`, naming the role and the labels) an actor whose node labels no
    alive node of the cluster carries."""
    import ray

    if not any(selectors.values()):
        return
    nodes = [node.get("Labels") or {} for node in ray.nodes() if node.get("Alive")]
    reason = unmatched(selectors, nodes)
    if reason is not None:
        raise UnplaceableError(reason)


def check_placeable(requests: dict[str, dict[str, float]]) -> None:
    """Refuse at once (`UnplaceableError`, naming the role and the resources) what
    the cluster can never place."""
    import ray

    reason = unplaceable(requests, ray.cluster_resources())
    if reason is not None:
        raise UnplaceableError(reason)


def uses_trainer_group(config: RunConfig) -> bool:
    """True when `config.trainer_group` asks for more than one rank or a distributed strategy."""
    return not (config.trainer_group.world_size == 1 and config.trainer_group.strategy == "naive")


def trainer_names_of(config: RunConfig, name: str) -> list[str]:
    """The actor names `launch_trainers(config, name)` creates: `name`, or the ranks `name_0` … of a group."""
    return trainer_names(name, config.trainer_group.world_size) if uses_trainer_group(config) else [name]


def launch_trainers(config: RunConfig, name: str, timeout: float | None = None, detached: bool = True,
                    threads: int = 0, placed: bool | None = None) -> list[Any]:
    """Create the trainer or trainer group `name` (`config.trainer_group`); returns the handles of its ranks.

    Every command launches its trainer here. `threads` caps each rank's torch threads. `placed` (default:
    `detached`): on the nodes `trainer_group.resources` and `label_selector` choose; labels no alive node
    carries are refused at once (`UnplaceableError`). A group waits
    until its ranks formed their process group; if one fails or the ranks cannot be placed within
    `timeout` (default `trainer_group.timeout_s`, never more), nothing of the group is left and the
    error (RayTaskError, TimeoutError) is raised.
    """
    placed = detached if placed is None else placed
    if placed:
        check_labels(launch_selectors(config, trainer=name))
    factory = trainer_factory(config)
    if threads > 0:
        factory = functools.partial(with_threads, threads, factory)
    selector = config.trainer_group.label_selector if placed else None
    if not uses_trainer_group(config):
        options = _options(name, config, detached, trainer_request(config, placed), selector)
        trainer = trainer_class(config.algorithm).options(**options)
        return [trainer.remote(name, factory, config.trainer, config.algorithm_config, config.namespace,
                               sampling=config.sampling)]
    group = config.trainer_group if placed else dataclasses.replace(config.trainer_group, resources={},
                                                                    label_selector={})
    wait = group.timeout_s if timeout is None else min(timeout, group.timeout_s)
    return start_trainer_group(name, group.world_size, factory, config.trainer, config.algorithm_config,
                               config.namespace, strategy=group.strategy, group=group, timeout=wait,
                               sampling=config.sampling, detached=detached)


def maker_arguments(
    config: RunConfig,
    name: str,
    trainers: Sequence[str],
    shard: tuple[int, int] = (0, 1),
    state_path: str | None = None,
    threads: int = 0,
    nice: int = 0,
) -> dict[str, Any]:
    """The constructor arguments of maker `name` (see `launch_maker`), each small enough to travel inline."""
    factory = maker_factory(config)
    if threads > 0 or nice > 0:
        factory = functools.partial(with_threads, threads, factory, nice)
    arguments = {"name": name, "trainer_names": list(trainers), "model_factory": factory,
                 "prompts": prompt_factory(config, shard), "config": config.maker_config,
                 "namespace": config.namespace, "state_path": state_path}
    check_inline_arguments(f"maker {name!r}", arguments)
    return arguments


def launch_maker(
    config: RunConfig,
    name: str,
    trainers: Sequence[str],
    shard: tuple[int, int] = (0, 1),
    state_path: str | None = None,
    detached: bool = True,
    threads: int = 0,
    nice: int = 0,
    placed: bool | None = None,
) -> Any:
    """Create a named experience maker feeding `trainers` with prompt shard `shard` = (index, count).

    `state_path`: where it saves its prompt cursor and counters after every batch (and resumes from), a
    path on the maker's node; `threads` and `nice` cap its torch threads and lower its CPU priority.
    `placed` (default: `detached`): on a node `maker.resources` and `maker.label_selector` choose; labels
    no alive node carries are refused at once (`UnplaceableError`). Ray restarts it after its
    process dies (`maker.max_restarts`) from the same, inline, constructor arguments.
    """
    placed = detached if placed is None else placed
    if placed:
        check_labels(launch_selectors(config, makers=[name]))
    arguments = maker_arguments(config, name, trainers, shard, state_path, threads, nice)
    options = _options(name, config, detached, maker_request(config, placed),
                       config.maker.label_selector if placed else None)
    return ExperienceMakerHolder.options(max_restarts=config.maker.max_restarts,
                                         **options).remote(**arguments)


def launch_scorer_group(config: RunConfig, role: str, trainers: Sequence[str] = (),
                        timeout: float | None = None
                        ) -> list[Any]:
    """Start the scorer group the makers' config names for `role` (`maker.<role>_scorer`), shaped by
    `config.scorers.<role>`; a critic group takes its weights from `trainers`. Its placement waits at most
    `timeout` (default and cap: the group's `timeout_s`). Returns the worker handles."""
    prefix = config.maker.scorers[role]
    group = getattr(config.scorers, role)
    if timeout is not None and timeout < group.timeout_s:
        group = dataclasses.replace(group, timeout_s=timeout)
    return start_scorer_group(prefix, role, scorer_factory(config, role), group,
                              config.sampling, config.namespace, trainers if role == "critic" else ())
