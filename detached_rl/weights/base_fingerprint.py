"""LoRA base fingerprints: which base weights a LoRA-only update was computed against, on both sides.

A LoRA trainer fingerprints its frozen base (`base_fingerprint`, and cast to the dtypes makers store
weights in: `cast_base_fingerprints`) and puts both in every update's metadata ("base_fingerprint",
"base_fingerprints"). A maker fingerprints the base it serves the same way (`BaseCheckedSink.fingerprint`,
cast to its coarsest stored dtype when it casts incoming weights) and refuses a LoRA update made for
another base (`BaseCheckedSink.check_update`). Every computation and comparison of base fingerprints
lives here.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from detached_rl.models.lora_backend import base_keys
from detached_rl.weights.sink import SinkCommit, TensorLayout, WeightSink
from detached_rl.weights.update import OffTrainerError, parse_dtype, state_fingerprint

__all__ = [
    "CAST_FINGERPRINT_DTYPES", "BaseCheckedSink", "base_fingerprint", "base_keys", "base_model_label",
    "base_state_fingerprint",
    "cast_base_fingerprints", "dtype_name", "fingerprint_cast_dtype", "lowest_precision_dtype",
    "sent_base_fingerprint",
]

# Common cast targets of makers (`MakerConfig.weight_cast_dtype`): a LoRA trainer puts its base fingerprint
# cast to each of them in every update's metadata, so all its ranks agree on what a casting maker must hold.
CAST_FINGERPRINT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def base_fingerprint(model: nn.Module, cast_dtype: torch.dtype | None = None) -> str:
    """Fingerprint of the `base_keys` tensors of a LoRA model or target, exact or cast (see below)."""
    return base_state_fingerprint(model.state_dict(), base_keys(model), cast_dtype)


def base_state_fingerprint(state: Mapping[str, Tensor], keys: Iterable[str],
                           cast_dtype: torch.dtype | None = None) -> str:
    """sha256 over names, shapes, dtypes and xxh3 checksums of `state[key]` for `keys`.

    Without `cast_dtype`: over the bytes as they are (a hex digest). With it: every floating tensor is cast to
    `cast_dtype` first, and the result is "<dtype>:<digest>" (e.g. "bfloat16:9f3c..."). A maker that stores
    its weights in bf16 cannot reproduce its trainer's fp32 bytes, but both sides can cast to bf16 and agree:
    the maker's bytes after a full update are exactly the trainer's cast to its dtype (`Tensor.to` rounds the
    same way everywhere), and a maker that loaded the same checkpoint in bf16 holds them too.
    """
    keys = list(keys)
    if cast_dtype is None:
        return state_fingerprint({"base": {key: state[key] for key in keys}})
    if not cast_dtype.is_floating_point:
        raise ValueError(f"cast_dtype must be a floating dtype, got {cast_dtype}")

    def cast() -> Iterator[tuple[str, Tensor]]:  # one cast copy alive at a time
        for key in keys:
            tensor = state[key]
            yield key, tensor.to(cast_dtype) if tensor.is_floating_point() else tensor

    return f"{dtype_name(cast_dtype)}:{state_fingerprint({'base': cast()})}"


def cast_base_fingerprints(model: nn.Module, dtypes: Iterable[torch.dtype] = CAST_FINGERPRINT_DTYPES
                           ) -> dict[str, str]:
    """dtype name -> `base_fingerprint(model, dtype)` for each of `dtypes` (in a LoRA trainer's updates)."""
    state = model.state_dict()
    keys = base_keys(model)
    floating = {state[key].dtype for key in keys if state[key].is_floating_point()}
    exact = None
    out = {}
    for dtype in dtypes:
        if floating <= {dtype}:  # the cast changes nothing: the exact digest, named
            exact = exact or state_fingerprint({"base": {key: state[key] for key in keys}})
            out[dtype_name(dtype)] = f"{dtype_name(dtype)}:{exact}"
        else:
            out[dtype_name(dtype)] = base_state_fingerprint(state, keys, dtype)
    return out


def fingerprint_cast_dtype(fingerprint: str) -> torch.dtype | None:
    """The dtype a base fingerprint was cast to ("bfloat16:<digest>" -> torch.bfloat16); None if exact."""
    name, separator, _ = fingerprint.rpartition(":")
    if not separator:
        return None
    dtype = parse_dtype(name)
    if dtype is None or not dtype.is_floating_point:
        raise ValueError(f"base fingerprint {fingerprint[:48]!r} names {name!r}, which is not a "
                         "floating torch dtype")
    return dtype


def lowest_precision_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The floating dtype of `dtypes` with the coarsest precision (largest eps: bf16, then fp16, fp32)."""
    floating = {dtype for dtype in dtypes if dtype.is_floating_point}
    return max(floating, key=lambda d: (torch.finfo(d).eps, -d.itemsize), default=None)


def sent_base_fingerprint(metadata: Mapping[str, Any], cast_dtype: torch.dtype | None) -> str | None:
    """The base fingerprint a LoRA update's `metadata` carries for a maker that casts to `cast_dtype`."""
    if cast_dtype is None:
        return metadata.get("base_fingerprint")
    return dict(metadata.get("base_fingerprints") or {}).get(dtype_name(cast_dtype))


def base_model_label(model: nn.Module) -> str | None:
    """Which checkpoint a model was loaded from, for messages: "org/name@<commit>" for a Hub id
    (`from_pretrained` records both in the config), the directory for a local one; None if unknown."""
    config = getattr(model, "config", None)  # a peft model answers with its base model's config
    name = getattr(config, "_name_or_path", None) or None
    commit = getattr(config, "_commit_hash", None)
    if name is None:
        return None
    return f"{name}@{commit[:12]}" if commit else str(name)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the key of a cast base fingerprint)."""
    return str(dtype).removeprefix("torch.")


class BaseCheckedSink:
    """A maker's policy `WeightSink` that refuses LoRA updates computed against another base.

    Wraps the backend's sink (every call goes through) and fingerprints the base keys it serves: exact,
    or, with `casts` (the maker casts incoming weights and cannot hold its trainer's bytes), cast to the
    coarsest dtype it stores them in. The fingerprint is computed on first use and again only after a
    write touched a base key (a full update). `check_update` refuses a "lora" update whose metadata names
    another base with `OffTrainerError`: registering again (a full update) fixes it.
    """

    def __init__(self, sink: WeightSink, keys: Iterable[str], casts: bool = False,
                 base_model: str | None = None) -> None:
        self.sink = sink
        self.base_model = base_model  # `base_model_label` of the served model, named in a refusal
        self._ordered = list(keys)
        self.keys = frozenset(self._ordered)
        layout = sink.layout()
        # A casting maker fingerprints its base cast to its coarsest stored dtype; the trainer casts the same.
        self.cast_dtype = (lowest_precision_dtype(layout[key].dtype for key in self._ordered) if casts
                           else None)
        self._lock = threading.Lock()
        self._base_writes = 0  # writes that touched a base key; the cached fingerprint is of one count
        self._cached: tuple[int, str] | None = None

    @property
    def fingerprint(self) -> str:
        """`base_state_fingerprint` of the base weights served now (cast to `cast_dtype` if set)."""
        with self._lock:
            writes, cached = self._base_writes, self._cached
        if cached is not None and cached[0] == writes:
            return cached[1]
        fingerprint = base_state_fingerprint(self.sink.state(), self._ordered, self.cast_dtype)
        with self._lock:
            if self._base_writes == writes:
                self._cached = (writes, fingerprint)
        return fingerprint

    @property
    def verified_base_keys(self) -> frozenset[str]:
        """The keys a LoRA update may leave out: `check_update` proves the maker holds them
        (`weight_verify.check_complete`)."""
        return self.keys

    def refresh_fingerprint(self) -> str:
        """Fingerprint the base again (after its weights were changed outside the receiver)."""
        self._forget()
        return self.fingerprint

    def check_update(self, kind: str, metadata: Mapping[str, Any]) -> None:
        """The wrapped sink's check, then for a "lora" update: the base it names must be the one served."""
        check = getattr(self.sink, "check_update", None)
        if check is not None:
            check(kind, metadata)
        if kind != "lora":
            return
        expected, held = sent_base_fingerprint(metadata, self.cast_dtype), self.fingerprint
        if expected != held:
            sent_model = metadata.get("base_model")
            raise OffTrainerError(
                f"base fingerprint mismatch: the LoRA update is for base weights {str(expected)[:24]}"
                f"{f' ({sent_model})' if sent_model else ''}, this maker holds {held[:24]}"
                f"{f' ({self.base_model})' if self.base_model else ''}; it needs a full update first"
            )

    def layout(self) -> Mapping[str, TensorLayout]:
        """The wrapped sink's layout."""
        return self.sink.layout()

    def state(self) -> Mapping[str, Tensor]:
        """The wrapped sink's tensors as served."""
        return self.sink.state()

    def stage(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Staged by the wrapped sink."""
        return self.sink.stage(tensors)

    def write(self, tensors: Mapping[str, Tensor]) -> None:
        """Written by the wrapped sink; a write of base keys makes the fingerprint be computed again."""
        touches_base = not self.keys.isdisjoint(tensors)
        if touches_base:
            self._forget()
        try:
            self.sink.write(tensors)
        finally:
            if touches_base:  # a fingerprint computed while the write ran is of neither state
                self._forget()

    def commit(self, update: SinkCommit) -> None:
        """Committed by the wrapped sink."""
        self.sink.commit(update)

    def _forget(self) -> None:
        with self._lock:
            self._base_writes += 1
            self._cached = None
