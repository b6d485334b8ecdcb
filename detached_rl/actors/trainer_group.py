"""Trainer groups: the data-parallel ranks `<prefix>_0` … of one trainer, an `ActorGroup` whose ranks form
one process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ray

from detached_rl.actors.group import ActorGroup, worker_names
from detached_rl.actors.trainer import trainer_class
from detached_rl.actors.transport import get_all, resolve_namespace
from detached_rl.trainer.config import TrainerConfig, TrainerGroupConfig

if TYPE_CHECKING:
    from detached_rl.algorithms.grpo import GRPOConfig
    from detached_rl.algorithms.ppo import PPOConfig
    from detached_rl.core.sampling import SamplingConfig


def trainer_names(prefix: str, world_size: int) -> list[str]:
    """Names of the ranks of a trainer group: prefix_0 … prefix_{n-1}."""
    return worker_names(prefix, world_size)


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
    sampling: SamplingConfig | None = None,
    detached: bool = True,
) -> list[Any]:
    """Create `world_size` named trainer ranks (prefix_0 ...) in a placement group and form their process
    group.

    The ranks are detached actors (`detached=False`: owned by this driver), one per bundle of a placement
    group named `<prefix>-placement` (`group.placement_strategy`, PACK by default). Rank 0 hosts the process
    group at its own node address and a port free there. If any rank fails to start or join
    (e.g. a strategy that needs CUDA on a CPU node), every rank and the placement group are
    removed and the error is raised.
    """
    if group is None:
        group = TrainerGroupConfig(strategy=strategy, world_size=world_size)
    elif (group.world_size, group.strategy) != (world_size, strategy):
        raise ValueError(f"start_trainer_group: world_size/strategy ({world_size}, {strategy!r}) "
                         f"disagree with group ({group.world_size}, {group.strategy!r})")
    namespace = resolve_namespace(namespace)
    bundle = {"CPU": group.num_cpus_per_rank} if group.num_cpus_per_rank else {}
    if group.num_gpus_per_rank:
        bundle["GPU"] = group.num_gpus_per_rank
    bundle.update(group.resources)
    options = {"num_cpus": group.num_cpus_per_rank, "num_gpus": group.num_gpus_per_rank,
               "resources": dict(group.resources) or None, **(actor_options or {})}

    def form_process_group(handles: list[Any]) -> None:
        if group.strategy != "naive":
            address, port = ray.get(handles[0].master_address.remote(), timeout=timeout)
            get_all([h.join_process_group.remote(address, port, group.strategy_options()) for h in handles],
                    timeout=timeout)
        else:
            # built in its constructor: surface errors
            ray.get(handles[0].policy_version.remote(), timeout=timeout)

    return ActorGroup(prefix, world_size, namespace, kind="trainer group").start(
        trainer_class(algorithm),
        lambda rank, name: (name, model_factory, config, algorithm, namespace, rank, world_size,
                            group.strategy,
                            sampling),
        bundle, group.placement_strategy, timeout, options, ready=form_process_group, detached=detached,
        label_selector=group.label_selector or None,
    )


def stop_trainer_group(prefix: str, world_size: int, namespace: str | None = None,
                       timeout: float = 60.0) -> None:
    """Free each rank's models, kill the ranks and remove their placement group
    (missing parts are skipped)."""
    # All ranks shut down at once: a DDP model freed after its process group is gone can hang.
    ActorGroup(prefix, world_size, namespace, kind="trainer group").stop(shutdown="shutdown", timeout=timeout)
