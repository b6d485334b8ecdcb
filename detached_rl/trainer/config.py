"""The trainer's settings: `TrainerConfig` (one trainer) and `TrainerGroupConfig`
(ranks, strategy, placement); torch-free, part of the run config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from detached_rl.core.labels import check_label_selector
from detached_rl.core.limits import (
    DEFAULT_MAX_ABS_REWARD,
    WEIGHT_SYNC_KINDS,
    check_compression,
    check_max_abs_reward,
    check_stall_s,
)
from detached_rl.core.resources import PLACEMENT_STRATEGIES, check_amount, check_resources
from detached_rl.core.sample_checks import ProvenanceConfig
from detached_rl.strategies.registry import STRATEGIES


@dataclass
class TrainerConfig:
    """Buffer, batching, weight-sync and timeout settings of a trainer (per rank)."""

    train_batch_size: int = 8  # samples per training step on each rank
    buffer_max_samples: int = 1024
    buffer_max_bytes: int = 1 << 30
    max_staleness: int | None = None
    max_reuse: int = 1
    buffer_overflow: str = "refuse"
    weight_chunk_bytes: int = 64 * 2**20
    # Each chunk travels in pieces of this size, a stall is no new piece for `weight_stall_timeout_s`: on a
    # thin link keep a piece well under what the link moves in a fraction of that (1 MiB: 1.7 s at 5 Mbit/s).
    weight_piece_bytes: int = 2**20
    # Pieces compressed losslessly (byte planes + zlib, about 0.86 of a trained fp32 adapter) before they are
    # stored: "auto" when the cluster has several nodes (makers may be across a thin link), "zlib", "none".
    wire_compression: str = "auto"
    # "lora": send only trainable tensors (LoRA adapters) after the first full update
    weight_sync: str = "full"
    # With weight_sync "full": makers that serve bf16 (any dtype narrower than the trainer's) get each version
    # as the bf16 values that changed since the one they hold, where that is smaller (`weights.encoding`).
    sparse_deltas: bool = True
    # An update a maker answers about but is not receiving (its intake busy, its generation lock held) fails
    # after this long; a non-overlapped step waits at most this long for its makers' acknowledgements.
    weight_push_timeout_s: float = 300.0
    # An update a maker is receiving fails only when the maker reports no new bytes for this long, or does
    # not answer the question within it (docs/operations.md, "Thin links").
    weight_stall_timeout_s: float = 30.0
    # > 0: makers on other hosts than the trainer's take each update from one another, at most this many
    # from each relay, so a version leaves the trainer's host about once (`weights.relay`); 0: each from it.
    weight_relay_fanout: int = 2
    # Smaller updates go to every maker from the trainer: a relay's hop costs round trips that save nothing on
    # a few hundred KB (measured, docs/performance.md "A swarm"); the default job's adapters are ~10 MB.
    weight_relay_min_bytes: int = 2 * 2**20
    batch_timeout_s: float = 300.0  # how long `fit` waits for a full batch before failing
    stop_makers_at_end: bool = True
    metrics_history: int = 10_000
    record_weights_fingerprint: bool = False  # keep version -> fingerprint of each update (audits, tests)
    # Train the next step while makers apply an update (they swap between two generation batches, which can
    # take a batch's time); the trainer waits for it only before sending the next one and at the end of `fit`.
    overlap_weight_push: bool = False
    # Pushes with a reward beyond +-this are refused (naming the field); values, returns and advantages may be
    # `ESTIMATE_SCALE` times it (`detached_rl.core.experience`). At most MAX_ABS_REWARD_LIMIT (1e8).
    max_abs_reward: float = DEFAULT_MAX_ABS_REWARD
    # Check that on-version samples come from the policy they name; quarantine makers whose samples keep not.
    provenance: ProvenanceConfig = field(default_factory=ProvenanceConfig)

    def __post_init__(self) -> None:
        check_compression(self.wire_compression, "TrainerConfig.wire_compression")
        for name in ("train_batch_size", "buffer_max_samples", "buffer_max_bytes", "weight_chunk_bytes",
                     "weight_piece_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.train_batch_size > self.buffer_max_samples:
            raise ValueError(
                f"TrainerConfig.train_batch_size {self.train_batch_size} exceeds buffer_max_samples "
                f"{self.buffer_max_samples}: a batch could never be sampled"
            )
        if self.weight_sync not in WEIGHT_SYNC_KINDS:
            raise ValueError(f"TrainerConfig.weight_sync must be one of {WEIGHT_SYNC_KINDS}, got "
                             f"{self.weight_sync!r}")
        for name in ("weight_push_timeout_s", "batch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainerConfig.{name} must be > 0, got {getattr(self, name)}")
        check_stall_s("TrainerConfig.weight_stall_timeout_s", self.weight_stall_timeout_s)
        if isinstance(self.weight_relay_fanout, bool) or not isinstance(self.weight_relay_fanout, int) \
                or self.weight_relay_fanout < 0:
            raise ValueError("TrainerConfig.weight_relay_fanout must be an int >= 0 (0: no relaying), got "
                             f"{self.weight_relay_fanout!r}")
        if isinstance(self.weight_relay_min_bytes, bool) or not isinstance(self.weight_relay_min_bytes, int) \
                or self.weight_relay_min_bytes < 0:
            raise ValueError("TrainerConfig.weight_relay_min_bytes must be an int >= 0, got "
                             f"{self.weight_relay_min_bytes!r}")
        self.max_abs_reward = check_max_abs_reward("TrainerConfig.max_abs_reward", self.max_abs_reward)


@dataclass
class TrainerGroupConfig:
    """How many trainer ranks, trained with which strategy, placed how (one Ray
    placement-group bundle per rank)."""

    strategy: str = "naive"  # a name in `STRATEGIES` (naive, ddp, colossalai_ddp, colossalai_zero2, ...)
    world_size: int = 1
    placement_strategy: str = "PACK"  # PACK: ranks on as few nodes as fit; SPREAD: over as many as possible
    # What each rank asks Ray for; a naive trainer is a 1-rank group and asks for these too. Fractions of a
    # GPU are allowed (0.5: the trainer shares a GPU with makers); a rank with no GPU
    # keeps its models on the CPU.
    num_cpus_per_rank: float = 1.0
    num_gpus_per_rank: float = 0.0
    backend: str | None = None  # process-group backend: gloo (CPU) or nccl (GPU); None picks by device
    timeout_s: float = 300.0  # collectives and forming the group fail after this long
    # Custom Ray resources each rank asks for (e.g. {"trainer_node": 1} to place ranks
    # on nodes that offer it).
    resources: dict[str, float] = field(default_factory=dict)
    # Node labels each rank's node must carry (Ray's label_selector, e.g. {"role": "trainer"}).
    label_selector: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_resources(self.resources, "TrainerGroupConfig.resources")
        check_label_selector(self.label_selector, "TrainerGroupConfig.label_selector")

        if self.strategy not in STRATEGIES:
            raise ValueError(f"TrainerGroupConfig.strategy must be one of {sorted(STRATEGIES)}, got "
                             f"{self.strategy!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"TrainerGroupConfig.world_size must be an int >= 1, got {self.world_size!r}")
        if self.strategy == "naive" and self.world_size != 1:
            raise ValueError("TrainerGroupConfig.world_size must be 1 with strategy 'naive' (one "
                             f"process), got {self.world_size}; choose ddp or colossalai_ddp for more ranks")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"TrainerGroupConfig.placement_strategy must be one of {PLACEMENT_STRATEGIES}, "
                             f"got {self.placement_strategy!r}")
        check_amount(self.num_cpus_per_rank, "TrainerGroupConfig.num_cpus_per_rank")
        check_amount(self.num_gpus_per_rank, "TrainerGroupConfig.num_gpus_per_rank", gpu=True)
        if self.num_cpus_per_rank == 0 and self.num_gpus_per_rank == 0:
            raise ValueError("TrainerGroupConfig.num_cpus_per_rank must be > 0 when num_gpus_per_rank is 0 "
                             "(a placement-group bundle cannot be empty)")
        if not self.timeout_s > 0:
            raise ValueError(f"TrainerGroupConfig.timeout_s must be > 0, got {self.timeout_s!r}")

    def strategy_options(self) -> dict[str, Any]:
        """Keyword arguments of the strategy besides rank, world size and address."""
        return {"backend": self.backend, "timeout_s": self.timeout_s}
