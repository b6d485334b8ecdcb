"""What a `WeightPublisher` is built from: where its tensors come from and under which lock, the ranks it
publishes for, its settings and where its errors go. Explicit dependencies, so the publisher holds no
pointer back to the trainer that owns it."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# (model name, tensor) streams of each synced model, gathered shard by shard; the argument: trainable only.
TensorStreams = Callable[[bool], dict[str, Iterator[tuple[str, torch.Tensor]]]]
# A publisher's errors: (the message now shown, or None when none is; the message it replaces, or None).
ErrorReport = Callable[[str | None, str | None], None]


@dataclass(frozen=True)
class WeightSource:
    """The weights a publisher snapshots: the synced models, their tensor streams, the LoRA policy (for base
    fingerprints), the lock held while they change, and the policy version they are."""

    models: Callable[[], dict[str, torch.nn.Module]]
    tensors: TensorStreams
    policy: Callable[[], torch.nn.Module]
    lock: threading.Lock
    version: Callable[[], int]


class RankGroup(Protocol):
    """The data-parallel ranks a publisher publishes for (a `Strategy` is one)."""

    name: str
    shards_weights: bool
    rank: int
    world_size: int

    @property
    def is_rank_zero(self) -> bool:
        """Whether this is rank 0."""
        ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """`obj` of every rank, in rank order."""
        ...


@dataclass(frozen=True)
class PublishConfig:
    """A publisher's settings (the same names as `TrainerConfig`'s, which `of` reads them from)."""

    weight_sync: str = "full"  # "full" or "lora" (LoRA-only updates)
    sparse_deltas: bool = True  # full updates to narrower makers as sparse deltas where they fit
    weight_chunk_bytes: int = 64 * 2**20
    record_weights_fingerprint: bool = False
    weight_push_timeout_s: float = 300.0
    overlap_weight_push: bool = False
    max_staleness: int | None = None  # makers trailing by more are reported `makers_behind`

    @classmethod
    def of(cls, config: Any) -> PublishConfig:
        """The publisher settings of a config that has these fields (a `TrainerConfig`)."""
        return cls(**{field.name: getattr(config, field.name) for field in dataclasses.fields(cls)})
