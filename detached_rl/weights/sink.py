"""Where a model's verified weights go: the `WeightSink` protocol and `ModuleWeightSink` for torch modules.

An inference engine owns its weights: a generation backend brings its own sink (see
`detached_rl.generation.base`), and the `WeightReceiver` hands every verified update to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from detached_rl.weights.update import WeightManifest, check_model_name


@dataclass(frozen=True)
class TensorLayout:
    """Shape and dtype of one tensor a `WeightSink` takes."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class SinkCommit:
    """What `WeightSink.commit` is told about the update whose tensors it was just given."""

    version: int
    kind: str  # "full" | "lora"
    keys: frozenset[str]  # the keys written to this sink (its own naming, no "<model>/" prefix)
    metadata: Mapping[str, Any]  # the manifest's (LoRA updates: "lora" holds the adapter config)


class SinkUnchanged(RuntimeError):
    """Raised by a `WeightSink.write`/`commit` that failed but put back what it changed (old version serves).

    The `WeightReceiver` then refuses the update without marking the model half-written.
    """


@runtime_checkable
class WeightSink(Protocol):
    """Where one model's verified weights go: the engine-specific part of applying a `WeightUpdate`.

    The `WeightReceiver` keeps the protocol (versions, manifests, chunk fetching, checksums,
    refusals, the generation lock, fingerprints); a sink only says what it holds and writes.
    Keys are the model's state-dict keys as the trainer names them. Per applied update the
    receiver calls, in order: `layout` (to check the manifest before fetching anything);
    `stage` on each verified chunk (mode "staged", outside the lock); `write` once with every
    staged tensor (mode "staged") or once per verified chunk, unstaged (mode "in_place"); then
    `commit`. `write` and `commit` run under the generation lock, so an update becomes visible
    between two generation batches. If either raises, the receiver refuses the update and marks
    the model half-written until a later full update, unless the sink raised `SinkUnchanged`.

    Optional hook, not part of the protocol's checked members: a sink may define
    `check_update(kind: str, metadata: Mapping[str, Any]) -> None`, raising ValueError naming the
    field for an update it cannot take although its tensors fit `layout` (e.g. a LoRA update
    whose `metadata["lora"]` has another alpha). The receiver calls it, for each model the update
    names, after checking the manifest and before fetching or writing anything, and refuses the
    update with the error (a `WeightUpdateError` keeps its type: `OffTrainerError` says registering
    again fixes it, as `detached_rl.weights.base_fingerprint.BaseCheckedSink` raises for another base).
    """

    def layout(self) -> Mapping[str, TensorLayout]:
        """Every key this sink holds, with the shape and dtype it stores it in."""
        ...

    def state(self) -> Mapping[str, Tensor]:
        """The tensors as served, by key (for fingerprints; may copy)."""
        ...

    def stage(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Verified tensors made ready for `write` (e.g. on the serving device, in the stored dtype)."""
        ...

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        """Write tensors (staged, or straight from a chunk) into the served weights; casts as needed."""
        ...

    def commit(self, update: SinkCommit) -> None:
        """Make the written tensors serve (e.g. re-merge LoRA weights, switch to a new adapter)."""
        ...


class ModuleWeightSink:
    """A `WeightSink` over a torch module: writes into the tensors of its `state_dict()` (shared storage)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def layout(self) -> dict[str, TensorLayout]:
        """Shape and dtype of each state-dict tensor."""
        return {key: TensorLayout(tuple(t.shape), t.dtype) for key, t in self.module.state_dict().items()}

    def state(self) -> Mapping[str, Tensor]:
        """The module's state dict (no copies)."""
        return self.module.state_dict()

    def stage(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Each tensor on its target's device and in its dtype (no copy when it already is)."""
        targets = self.module.state_dict()
        return {key: t.to(device=targets[key].device, dtype=targets[key].dtype) for key, t in tensors.items()}

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy each tensor into the module's tensor of that key."""
        targets = self.module.state_dict()
        with torch.no_grad():
            for key, tensor in tensors.items():
                targets[key].copy_(tensor)

    def commit(self, update: SinkCommit) -> None:
        """Nothing to do: the module computes with the written tensors."""


def commit_update(sinks: Mapping[str, WeightSink], manifest: WeightManifest) -> None:
    """Tell each sink the update names that its part of it (the keys written to it) is written."""
    keys: dict[str, set[str]] = {}
    for spec in manifest.tensors:
        model_name, _, key = spec.name.partition("/")
        keys.setdefault(model_name, set()).add(key)
    for model_name, written in keys.items():
        sinks[model_name].commit(
            SinkCommit(manifest.version, manifest.kind, frozenset(written), manifest.metadata))


def left_unchanged(error: Exception, models: Set[str]) -> bool:
    """True when the one model an update named put all back (`SinkUnchanged`): nothing is half-written."""
    return isinstance(error, SinkUnchanged) and len(models) == 1


def sinks_of(models: Mapping[str, nn.Module | WeightSink]) -> dict[str, WeightSink]:
    """Each model's `WeightSink`: its own, or a `ModuleWeightSink` over a torch module; names checked."""
    sinks: dict[str, WeightSink] = {}
    for name, model in models.items():
        check_model_name(name)
        if isinstance(model, nn.Module):
            sinks[name] = ModuleWeightSink(model)
        elif isinstance(model, WeightSink):
            sinks[name] = model
        else:
            raise TypeError(f"model {name!r} is a {type(model).__name__}, not a torch module or a WeightSink")
    return sinks
