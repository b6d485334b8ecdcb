"""Trainer groups: named ranks in one detached placement group, started and stopped as a whole."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import ray

from detached_rl.actors.trainer import DetachedGRPOTrainer, DetachedPPOTrainer
from detached_rl.actors.transport import DEFAULT_NAMESPACE, get_all
from detached_rl.algorithms.grpo import GRPOConfig
from detached_rl.algorithms.ppo import PPOConfig
from detached_rl.trainer.core import TrainerConfig, TrainerGroupConfig

logger = logging.getLogger(__name__)


def trainer_names(prefix: str, world_size: int) -> list[str]:
    """Names of the ranks of a trainer group: prefix_0 … prefix_{n-1}."""
    return [f"{prefix}_{rank}" for rank in range(world_size)]


def placement_group_name(prefix: str) -> str:
    """Name of the placement group that holds the ranks of trainer group `prefix`."""
    return f"{prefix}-placement"


def start_trainer_group(
    prefix: str,
    world_size: int,
    model_factory: Callable[[], Any],
    config: TrainerConfig | None = None,
    algorithm: PPOConfig | GRPOConfig | None = None,
    namespace: str | None = None,
    strategy: str = "ddp",
    actor_options: dict[str, Any] | None = None,
    timeout: float = 300.0,
    group: TrainerGroupConfig | None = None,
) -> list[Any]:
    """Create `world_size` named trainer ranks (prefix_0 ...) in a placement group and form their process group.

    The ranks are detached actors, one per bundle of a detached placement group named
    `<prefix>-placement` (`group.placement_strategy`, PACK by default). Rank 0 hosts the process
    group at its own node address and a port free there. If any rank fails to start or join
    (e.g. a strategy that needs CUDA on a CPU node), every rank and the placement group are
    removed and the error is raised.
    """
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if group is None:
        group = TrainerGroupConfig(strategy=strategy, world_size=world_size)
    elif (group.world_size, group.strategy) != (world_size, strategy):
        raise ValueError(f"start_trainer_group: world_size/strategy ({world_size}, {strategy!r}) disagree with "
                         f"group ({group.world_size}, {group.strategy!r})")
    namespace = namespace or DEFAULT_NAMESPACE
    bundle = {"CPU": group.num_cpus_per_rank} if group.num_cpus_per_rank else {}
    if group.num_gpus_per_rank:
        bundle["GPU"] = group.num_gpus_per_rank
    bundle.update(group.resources)
    pg = placement_group([dict(bundle) for _ in range(world_size)], strategy=group.placement_strategy,
                         name=placement_group_name(prefix), lifetime="detached")
    handles: list[Any] = []
    try:
        if not pg.wait(timeout_seconds=timeout):
            raise TimeoutError(
                f"trainer group {prefix!r}: {world_size} bundles of {bundle} ({group.placement_strategy}) could not be "
                f"placed within {timeout:.0f} s; the cluster has {ray.available_resources()} available"
            )
        trainer_class = DetachedGRPOTrainer if isinstance(algorithm, GRPOConfig) else DetachedPPOTrainer
        for rank, name in enumerate(trainer_names(prefix, world_size)):
            options = {
                "lifetime": "detached", "namespace": namespace, "name": name,
                "num_cpus": group.num_cpus_per_rank, "num_gpus": group.num_gpus_per_rank,
                "resources": dict(group.resources) or None,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
                **(actor_options or {}),
            }
            handles.append(trainer_class.options(**options).remote(
                name, model_factory, config, algorithm, namespace, rank, world_size, group.strategy))
        if group.strategy != "naive":
            address, port = ray.get(handles[0].master_address.remote(), timeout=timeout)
            get_all([h.join_process_group.remote(address, port, group.strategy_options()) for h in handles],
                    timeout=timeout)
        else:
            ray.get(handles[0].policy_version.remote(), timeout=timeout)  # built in its constructor: surface errors
    except BaseException:
        remove_group(pg, handles)
        raise
    return handles


def remove_group(pg: Any, handles: Sequence[Any]) -> None:
    """Kill a group's actors and remove its placement group (a group that failed to start)."""
    from ray.util.placement_group import remove_placement_group

    for handle in handles:
        ray.kill(handle)
    remove_placement_group(pg)


def stop_trainer_group(prefix: str, world_size: int, namespace: str | None = None, timeout: float = 60.0) -> None:
    """Free each rank's models, kill the ranks and remove their placement group (missing parts are skipped)."""
    from ray.util.placement_group import get_placement_group, remove_placement_group

    namespace = namespace or DEFAULT_NAMESPACE
    handles = []
    for name in trainer_names(prefix, world_size):
        try:
            handles.append(ray.get_actor(name, namespace=namespace))
        except ValueError:
            continue
    try:  # all ranks at once: a DDP model freed after its group is gone can hang
        get_all([h.shutdown.remote() for h in handles], timeout=timeout)
    except Exception as error:  # noqa: BLE001 - killing them below is what matters
        logger.warning("trainer group %s did not shut down cleanly: %s", prefix, error)
    for handle in handles:
        ray.kill(handle)
    with contextlib.suppress(ValueError):
        remove_placement_group(get_placement_group(placement_group_name(prefix)))
