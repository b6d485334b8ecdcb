"""The scorer roles and `ScorerGroupConfig`: how many workers serve a role and where they go."""

from __future__ import annotations

from dataclasses import dataclass, field

from detached_rl.core.resources import PLACEMENT_STRATEGIES, check_resources

SCORER_ROLES = ("reward", "reference", "critic")


@dataclass
class ScorerGroupConfig:
    """How many workers serve a role and where they go (one placement-group bundle per worker)."""

    num_nodes: int = 1
    num_gpus_per_node: int = 0  # 0: CPU workers, one per node; else one worker per GPU
    num_cpus_per_worker: float = 1.0
    resources: dict[str, float] = field(default_factory=dict)  # custom resources per bundle, to pick nodes
    placement_strategy: str = "PACK"
    max_batch_rows: int = 64  # rows merged into one forward pass
    max_wait_s: float = 0.01  # how long a request waits for others to merge with
    timeout_s: float = 300.0  # placing and starting the group

    def __post_init__(self) -> None:
        for name in ("num_nodes", "max_batch_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ScorerGroupConfig.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.num_gpus_per_node, bool) or not isinstance(self.num_gpus_per_node, int) \
                or self.num_gpus_per_node < 0:
            raise ValueError("ScorerGroupConfig.num_gpus_per_node must be an int >= 0, got "
                             f"{self.num_gpus_per_node!r}")
        if not self.num_cpus_per_worker >= 0 or (self.num_cpus_per_worker == 0 and self.num_gpus_per_node == 0
                                                 and not self.resources):
            raise ValueError(f"ScorerGroupConfig.num_cpus_per_worker must be > 0 for CPU workers, got "
                             f"{self.num_cpus_per_worker!r}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"ScorerGroupConfig.placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                             f"got {self.placement_strategy!r}")
        check_resources(self.resources, "ScorerGroupConfig.resources")
        if not self.max_wait_s >= 0 or not self.timeout_s > 0:
            raise ValueError("ScorerGroupConfig.max_wait_s must be >= 0 and timeout_s > 0")

    @property
    def num_workers(self) -> int:
        """Workers in the group: one per GPU, or one per node for CPU workers."""
        return self.num_nodes * max(1, self.num_gpus_per_node)

    def bundle(self) -> dict[str, float]:
        """The resources of one worker's bundle."""
        bundle: dict[str, float] = {"CPU": self.num_cpus_per_worker} if self.num_cpus_per_worker else {}
        if self.num_gpus_per_node:
            bundle["GPU"] = 1
        bundle.update(self.resources)
        return bundle
