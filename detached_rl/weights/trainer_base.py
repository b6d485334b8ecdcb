"""`TrainerBase`: a LoRA trainer's frozen base as its makers check it, the trainer side of
`weights.base_fingerprint`.

It holds the base's exact fingerprint, its fingerprints cast to the dtypes makers store weights in, and which
checkpoint it was loaded from; stamps them into the metadata of every update (so a maker registered with any
rank can check a LoRA update from rank 0); answers a maker's fingerprint in that maker's form; and
fingerprints the base again when a checkpoint replaced it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from torch import nn

from detached_rl.weights.base_fingerprint import (
    base_fingerprint,
    base_model_label,
    cast_base_fingerprints,
    dtype_name,
    fingerprint_cast_dtype,
)
from detached_rl.weights.update import WeightUpdate


class TrainerBase:
    """The base of the policy `policy()` returns: fingerprinted now, and again on `refresh`."""

    def __init__(self, policy: Callable[[], nn.Module]) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        model = policy()
        self.fingerprint = base_fingerprint(model)
        # dtype name -> the base's fingerprint cast to it, for makers that cast weights (bf16/fp16 makers).
        self.cast = cast_base_fingerprints(model)
        self.model = base_model_label(model)  # the checkpoint (and Hub commit), named in a maker's refusal

    def refresh(self) -> None:
        """Fingerprint the base again (a checkpoint was loaded: its base may not be the one the trainer
        started from; makers holding the old one then refuse the LoRA updates and register for a full one)."""
        model = self.policy()
        exact, cast, label = base_fingerprint(model), cast_base_fingerprints(model), base_model_label(model)
        with self._lock:
            self.fingerprint, self.cast, self.model = exact, cast, label

    def like(self, fingerprint: str) -> str:
        """The base's fingerprint in the form of a maker's: exact, or cast to the dtype it names."""
        dtype = fingerprint_cast_dtype(fingerprint)
        if dtype is None:
            return self.fingerprint
        with self._lock:
            key = dtype_name(dtype)
            if key not in self.cast:  # a dtype beyond the common ones (fp64 ...): once, on demand
                self.cast[key] = base_fingerprint(self.policy(), dtype)
            return self.cast[key]

    def metadata(self) -> dict[str, Any]:
        """What every update made against this base carries about it."""
        with self._lock:
            return {"base_fingerprint": self.fingerprint, "base_fingerprints": dict(self.cast),
                    "base_model": self.model}

    def stamp(self, update: WeightUpdate) -> WeightUpdate:
        """`update` with the current cast fingerprints in its metadata (same chunks), if it names a base."""
        metadata = update.manifest.metadata
        if "base_fingerprint" not in metadata:
            return update
        with self._lock:
            cast = dict(self.cast)
        if metadata.get("base_fingerprints") == cast:
            return update
        manifest = dataclasses.replace(update.manifest, metadata={**metadata, "base_fingerprints": cast})
        return WeightUpdate(manifest, update.chunk_refs)
