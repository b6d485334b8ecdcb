"""open-instruct's `ModelGroup`: the learner ranks, named and placed so that makers find them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray

from detached_rl.actors.launch import check_placeable
from detached_rl.actors.transport import get_all, resolve_namespace
from detached_rl.compat.placement import actor_request, check_bundles_placeable

logger = logging.getLogger(__name__)


def bundle_index(rank: int, num_gpus_per_node: Sequence[int]) -> int:
    """The placement-group bundle (node) of `rank` when node i holds `num_gpus_per_node[i]` ranks."""
    for index, count in enumerate(num_gpus_per_node):
        if rank < count:
            return index
        rank -= count
    raise ValueError(f"rank beyond the {sum(num_gpus_per_node)} ranks of num_gpus_per_node "
                     f"{list(num_gpus_per_node)}")


class ModelGroup:
    """open-instruct's `ModelGroup`: `sum(num_gpus_per_node)` learner ranks `<name>_<rank>` in `namespace`.

    The arguments come in open-instruct's order; `data_prep_actor_name` goes to every rank, which keeps it.
    `pg` (a placement group with one bundle per node, or None) places rank r on bundle `bundle_index(r, ...)`.
    Each rank asks for `num_gpus_per_actor` GPUs: None means open-instruct's (1, or 0.48 with
    `single_gpu_mode`) on a cluster with GPUs, and 0 on one without. `namespace` left out: the driver's named
    namespace, else `detached_rl`, where makers look (`resolve_namespace`; never a plain `ray.init()`'s
    anonymous one).
    """

    def __init__(self, pg: Any, ray_process_cls: Any, num_gpus_per_node: Sequence[int], single_gpu_mode: bool,
                 args: Any, streaming_config: Any, vllm_config: Any, data_prep_actor_name: str | None = None,
                 tokenizer: Any = None, *, name: str = "policy_trainer", namespace: str | None = None,
                 num_gpus_per_actor: float | None = None, num_cpus_per_actor: float = 1.0) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = sum(num_gpus_per_node)
        if world_size < 1:
            raise ValueError(f"ModelGroup: num_gpus_per_node {list(num_gpus_per_node)} holds no rank")
        if num_gpus_per_actor is None:
            has_gpus = ray.cluster_resources().get("GPU", 0) > 0
            num_gpus_per_actor = (0.48 if single_gpu_mode else 1.0) if has_gpus else 0.0
        self.namespace = resolve_namespace(namespace)
        self.names = [f"{name}_{rank}" for rank in range(world_size)]
        self.pg = pg
        # Refused at once, before any rank starts, what the cluster can never place (else from_pretrained
        # hangs).
        if pg is None:
            request = actor_request({"num_cpus": num_cpus_per_actor, "num_gpus": num_gpus_per_actor}) or {}
            check_placeable({f"learner {rank_name}": request for rank_name in self.names if request})
        else:
            check_bundles_placeable("placement group", list(pg.bundle_specs))

        def create(rank: int, master: Any) -> Any:
            options: dict[str, Any] = {"name": self.names[rank], "namespace": self.namespace,
                                       "num_cpus": num_cpus_per_actor, "num_gpus": num_gpus_per_actor}
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle_index(rank, num_gpus_per_node))
            return ray_process_cls.options(**options).remote(
                world_size, rank, 0, None, None, args, streaming_config, vllm_config, data_prep_actor_name,
                tokenizer, name=self.names[rank], namespace=self.namespace, master=master)

        # Every rank starts at once; ranks > 0 ask rank 0 for the process group's address in from_pretrained.
        self.models = [create(0, None)]
        self.models += [create(rank, self.models[0]) for rank in range(1, world_size)]

    def stop(self, timeout: float = 60.0) -> None:
        """Free every rank's models together (a DDP model freed alone can hang), then kill the ranks."""
        try:
            get_all([model.shutdown.remote() for model in self.models], timeout=timeout)
        except Exception as error:  # noqa: BLE001 - killing them below is what matters
            logger.warning("learner ranks %s did not shut down cleanly: %s", self.names, error)
        for model in self.models:
            ray.kill(model, no_restart=True)
