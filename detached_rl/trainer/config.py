"""The trainer's settings: `TrainerConfig` (one trainer) and `TrainerGroupConfig` (ranks, strategy, placement)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from detached_rl.core.experience import DEFAULT_MAX_ABS_REWARD
from detached_rl.core.replay_buffer import check_max_abs_reward
from detached_rl.core.resources import PLACEMENT_STRATEGIES, check_amount, check_resources
from detached_rl.core.weight_sync import KINDS as WEIGHT_SYNC_KINDS


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
    weight_sync: str = "full"  # "lora": send only trainable tensors (LoRA adapters) after the first full update
    weight_push_timeout_s: float = 300.0
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

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "buffer_max_samples", "buffer_max_bytes", "weight_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.train_batch_size > self.buffer_max_samples:
            raise ValueError(
                f"TrainerConfig.train_batch_size {self.train_batch_size} exceeds buffer_max_samples "
                f"{self.buffer_max_samples}: a batch could never be sampled"
            )
        if self.weight_sync not in WEIGHT_SYNC_KINDS:
            raise ValueError(f"TrainerConfig.weight_sync must be one of {WEIGHT_SYNC_KINDS}, got {self.weight_sync!r}")
        for name in ("weight_push_timeout_s", "batch_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainerConfig.{name} must be > 0, got {getattr(self, name)}")
        self.max_abs_reward = check_max_abs_reward("TrainerConfig.max_abs_reward", self.max_abs_reward)


@dataclass
class TrainerGroupConfig:
    """How many trainer ranks, trained with which strategy, placed how (one Ray placement-group bundle per rank)."""

    strategy: str = "naive"  # naive | ddp | colossalai_ddp | colossalai_zero2 | colossalai_gemini
    world_size: int = 1
    placement_strategy: str = "PACK"  # PACK: ranks on as few nodes as fit; SPREAD: over as many as possible
    # What each rank asks Ray for; a naive trainer is a 1-rank group and asks for these too. Fractions of a GPU
    # are allowed (0.5: the trainer shares a GPU with makers); a rank with no GPU keeps its models on the CPU.
    num_cpus_per_rank: float = 1.0
    num_gpus_per_rank: float = 0.0
    backend: str | None = None  # process-group backend: gloo (CPU) or nccl (GPU); None picks by device
    timeout_s: float = 300.0  # collectives and forming the group fail after this long
    # Custom Ray resources each rank asks for (e.g. {"trainer_node": 1} to place ranks on nodes that offer it).
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from detached_rl.strategies import STRATEGIES

        check_resources(self.resources, "TrainerGroupConfig.resources")

        if self.strategy not in STRATEGIES:
            raise ValueError(f"TrainerGroupConfig.strategy must be one of {sorted(STRATEGIES)}, got {self.strategy!r}")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"TrainerGroupConfig.world_size must be an int >= 1, got {self.world_size!r}")
        if self.strategy == "naive" and self.world_size != 1:
            raise ValueError(f"TrainerGroupConfig.world_size must be 1 with strategy 'naive' (one process), got "
                             f"{self.world_size}; choose ddp or colossalai_ddp for more ranks")
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


def oldest_useful_version(policy_version: int, step_in_progress: bool, queued: int, train_batch_size: int,
                          max_staleness: int, update_steps: int = 1) -> int:
    """The oldest policy version a batch pushed now can carry and still be trained (not dropped as stale).

    The batch is trained at version `policy_version + step_in_progress + queued // train_batch_size`
    (the step under way, then the full batches queued before it) and may then be `max_staleness` old.
    The answer is capped at the version the step under way produces (rounded down to a multiple of
    `update_steps`, the versions makers receive): queued samples may themselves go stale and be dropped,
    so only that version is sure to come without more samples, and a maker waiting for it never waits
    for samples that only it could provide. Trainers now answer with `GenerationLedger` (`paced_version`),
    which counts only samples that will be trained, those promised by other makers too, and needs no cap;
    this rule stays as the reference it replaced (tests/test_pacing.py).
    """
    trained_at = policy_version + int(step_in_progress) + queued // train_batch_size
    surely_reached = policy_version + int(step_in_progress)
    surely_pushed = surely_reached - surely_reached % update_steps
    return max(0, min(trained_at - max_staleness, surely_pushed))


def paced_version(policy_version: int, step_in_progress: bool, ahead: int, samples_per_version: int,
                  max_staleness: int, update_steps: int = 1) -> int:
    """The oldest policy version a batch can carry and still be trained behind `ahead` samples that will be.

    The batch is trained at version `policy_version + step_in_progress + ahead // samples_per_version`
    and may then be `max_staleness` old; the answer is rounded down to a multiple of `update_steps` (the
    versions makers receive), so the samples ahead reach it. `ahead` counts only samples that will be
    trained (`fresh_samples`), buffered or promised by other makers (`GenerationLedger`).
    """
    oldest = policy_version + int(step_in_progress) + ahead // samples_per_version - max_staleness
    return max(0, oldest - oldest % update_steps)


def fresh_samples(versions: Iterable[int], version: int, train_batch_size: int, max_staleness: int) -> int:
    """How many buffered samples (their policy versions, in sampling order) are trained, not dropped as stale.

    Sampling starts at `version` and moves one version on per `train_batch_size` samples; a sample more than
    `max_staleness` versions older than the version it comes up at is dropped as stale instead.
    """
    fresh = 0
    for sample_version in versions:
        if version + fresh // train_batch_size - sample_version <= max_staleness:
            fresh += 1
    return fresh


class GenerationLedger:
    """The batches a trainer's acknowledgements told makers to generate next, counted by later ones.

    Each acknowledged push records that its maker now generates one more batch of that size, with weights at
    least as new as the answer and as its push, trained after what was buffered and promised before it; the
    maker's next push settles it. A promise whose batch has not come by the version its last sample was due
    to be trained at no longer counts (the maker is late or gone). Not thread-safe: the trainer calls it
    under its push lock.
    """

    def __init__(self, train_batch_size: int, max_staleness: int) -> None:
        self.train_batch_size = train_batch_size
        self.max_staleness = max_staleness
        # maker -> (samples, the version they will carry, the version the last one is due to be trained at)
        self._promised: dict[str, tuple[int, int, int]] = {}

    @property
    def in_flight(self) -> int:
        """Samples promised and not pushed yet."""
        return sum(samples for samples, _, _ in self._promised.values())

    def acknowledge(self, maker: str | None, samples: int, full: bool, policy_version: int,
                    step_in_progress: bool, buffered: Iterable[int], update_steps: int = 1,
                    samples_per_version: int | None = None, pushed_version: int = 0) -> int:
        """The oldest weights `maker`'s next batch can come from and be trained (`paced_version`), after its
        push of `samples` (`full`: refused for room) made with weights of `pushed_version`.

        `buffered`: the policy versions of the samples in the buffer after the push, in the order they are
        sampled. Ahead of the maker's next batch it counts those and the other makers' promised batches,
        less what will be dropped as stale (`fresh_samples`). `samples_per_version`: what a step takes from
        the buffer, if more than `train_batch_size` (dynamic sampling draws again for the groups it drops).
        """
        self._promised = {m: p for m, p in self._promised.items() if p[2] >= policy_version}
        if maker is not None and not full:
            self._promised.pop(maker, None)
        size = max(self.train_batch_size, samples_per_version or 0)
        start = policy_version + int(step_in_progress)
        versions = list(buffered)
        for other, (count, version, _) in self._promised.items():
            if other != maker:
                versions += [version] * count
        ahead = fresh_samples(versions, start, size, self.max_staleness)
        answer = paced_version(policy_version, step_in_progress, ahead, size, self.max_staleness,
                               update_steps)
        if maker is not None and not full and samples > 0:
            due = start + (ahead + samples - 1) // size
            self._promised[maker] = (samples, max(answer, pushed_version), due)
        return answer
