"""Merge-mode LoRA on a maker: a plain model whose weights are W = W0 + s·B·A, set from kept W0, A, B.

A `LoraMergeTarget` presents the trainer's LoRA state-dict naming (so full and LoRA-only weight
updates apply to it unchanged) over a plain model without LoRA modules (fast generation).
Updates *set* W0, A and B; `refresh` recomputes W from them, so nothing drifts however many
updates arrive (docs/design.md §3.4).

Each key of the LoRA model maps to either the plain model's own tensor (non-adapted weights, all
biases, trainable or not, as they are not part of B·A; peft modules_to_save copies, which the
plain model computes with; a peft `original_module` tied to a tensor the plain model uses), so
copying into it updates the plain model at once; or to a kept tensor (adapted base weights W0,
LoRA A and B, and an untied `original_module`, unused but part of a full update).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import loralib
import torch
from peft.tuners.lora import Linear as PeftLinear
from peft.tuners.lora import LoraLayer as PeftLoraLayer
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from detached_rl.core.weight_sync import parse_dtype, state_fingerprint
from detached_rl.models.lora import lora_backend, lora_config_dict

__all__ = [
    "LoraMergeTarget", "base_fingerprint", "base_keys", "base_state_fingerprint", "fingerprint_cast_dtype",
    "cast_base_fingerprints", "dtype_name", "lowest_precision_dtype", "sent_base_fingerprint",
]

# Common cast targets of makers (`MakerConfig.weight_cast_dtype`): a LoRA trainer puts its base fingerprint
# cast to each of them in every update's metadata, so all its ranks agree on what a casting maker must hold.
CAST_FINGERPRINT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class _Adapted:
    """One adapted module: its W0/A/B keys (trainer naming), plain weight name, scaling and layout."""

    base: str
    lora_a: str
    lora_b: str
    plain: str
    scaling: float
    fan_in_fan_out: bool
    enable: tuple[bool, ...] | None  # loralib MergedLinear: which output parts (e.g. q, k, v) are adapted


class LoraMergeTarget(nn.Module):
    """A plain merged model (`.model`) behind the state-dict keys of the LoRA model it was built from."""

    def __init__(
        self,
        model: nn.Module,
        sources: dict[str, str],
        kept: dict[str, Tensor],
        adapted: list[_Adapted],
        base: list[str],
        config: dict[str, Any],
    ) -> None:
        super().__init__()
        self.model = model
        for name, tensor in kept.items():
            self.register_buffer(name, tensor)
        # LoRA-model key -> key in super().state_dict(): "model.<plain key>" or a kept buffer's name.
        self._sources = sources
        self._adapted = adapted
        self._base_keys = base
        self._config = config

    @classmethod
    def from_lora_model(cls, lora_model: nn.Module) -> LoraMergeTarget:
        """Build a target from a peft or loralib LoRA model (left unchanged), merged as it stands."""
        backend = lora_backend(lora_model)
        if backend is None:
            raise ValueError("model has no LoRA modules")
        config = lora_config_dict(lora_model)
        # The memo maps id(original tensor) -> its copy, which is how plain tensors are matched to keys.
        memo: dict[int, Any] = {}
        twin = copy.deepcopy(lora_model, memo)
        plain = twin.merge_and_unload() if backend == "peft" else _unload_loralib(twin)
        state = lora_model.state_dict(keep_vars=True)
        key_of: dict[int, str] = {}
        for key, tensor in state.items():
            key_of.setdefault(id(tensor), key)
        plain_keys: dict[int, list[str]] = {}
        for key, tensor in plain.state_dict(keep_vars=True).items():
            plain_keys.setdefault(id(tensor), []).append(key)

        adapted = []
        for name, module in lora_model.named_modules():
            if not isinstance(module, PeftLoraLayer | loralib.LoRALayer):
                continue
            weight, a, b, scaling, fan_in_fan_out, enable = _lora_parts(name, module)
            names = plain_keys[id(memo[id(weight)])]
            if len(names) > 1:
                raise ValueError(f"LoRA on {name!r}, whose weight is tied to {names[1:]}, cannot be merged")
            adapted.append(
                _Adapted(*(key_of[id(t)] for t in (weight, a, b)), names[0], scaling, fan_in_fan_out, enable)
            )

        kept_by_key = {key for layer in adapted for key in (layer.base, layer.lora_a, layer.lora_b)}
        sources: dict[str, str] = {}
        kept: dict[str, Tensor] = {}
        kept_of: dict[int, str] = {}  # tied kept tensors stay tied
        for key, tensor in state.items():
            twin_tensor = memo.get(id(tensor))
            names = plain_keys.get(id(twin_tensor), []) if twin_tensor is not None else []
            if names and key not in kept_by_key:
                sources[key] = "model." + names[0]
                continue
            if id(tensor) not in kept_of:
                kept_of[id(tensor)] = f"kept_{len(kept)}"
                kept[kept_of[id(tensor)]] = tensor.detach().clone()
            sources[key] = kept_of[id(tensor)]

        target = cls(plain, sources, kept, adapted, base_keys(lora_model), config)
        target.refresh()
        return target

    @property
    def adapter_config(self) -> dict[str, Any]:
        """`lora_config_dict` of the LoRA model this target was built from."""
        return self._config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the plain model."""
        return self.model(*args, **kwargs)

    def state_dict(
        self, *, destination: dict[str, Any] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, Any]:
        """The tensors of this target under the LoRA model's keys (shared storage, not copies)."""
        own = super().state_dict(keep_vars=keep_vars)
        out: dict[str, Any] = destination if destination is not None else {}
        out.update({prefix + key: own[source] for key, source in self._sources.items()})
        return out

    def refresh(self, names: set[str] | None = None) -> None:
        """Set W = W0 + scaling·(B·A) in the plain model for adapted modules whose W0, A or B is in `names`.

        All adapted modules when `names` is None. It writes the weights generation reads, so call it
        while generation cannot run (the maker holds its generation lock, e.g. `after_swap`).
        """
        state = self.state_dict()
        with torch.no_grad():
            for layer in self._adapted:
                if names is not None and names.isdisjoint((layer.base, layer.lora_a, layer.lora_b)):
                    continue
                a, b = state[layer.lora_a].float(), state[layer.lora_b].float()
                if layer.enable is None:
                    delta = b @ a
                else:
                    # loralib's merge_AB: part g of B times part g of A (a grouped conv1d), zero-padded
                    # into the fused output layout where a part is not enabled.
                    parts = sum(layer.enable)
                    blocks = torch.cat(
                        [bg @ ag for ag, bg in zip(a.chunk(parts), b.chunk(parts), strict=True)]
                    )
                    delta = blocks.new_zeros((len(layer.enable), b.shape[0] // parts, a.shape[1]))
                    delta[[i for i, on in enumerate(layer.enable) if on]] = blocks.view(parts, -1, a.shape[1])
                    delta = delta.flatten(0, 1)
                if layer.fan_in_fan_out:
                    delta = delta.T
                weight = self.model.get_parameter(layer.plain)
                weight.copy_(delta.mul_(layer.scaling).add_(state[layer.base]))


def _lora_parts(
    name: str, module: nn.Module
) -> tuple[Tensor, Tensor, Tensor, float, bool, tuple[bool, ...] | None]:
    """(base weight, A, B, scaling, fan_in_fan_out, enabled parts) of a supported LoRA layer."""
    if isinstance(module, PeftLinear):
        if len(module.active_adapters) != 1:
            raise ValueError(f"{name!r} has active adapters {module.active_adapters}; merge mode needs one")
        adapter = module.active_adapters[0]
        if module.merged or adapter in module.lora_variant or module.lora_bias.get(adapter):
            raise ValueError(f"{name!r} is merged or uses a LoRA variant (DoRA, lora_bias); not supported")
        return (
            module.get_base_layer().weight,
            module.lora_A[adapter].weight,
            module.lora_B[adapter].weight,
            module.scaling[adapter],
            module.fan_in_fan_out,
            None,
        )
    if isinstance(module, loralib.Linear | loralib.MergedLinear) and hasattr(module, "lora_A"):
        if module.merged:
            raise ValueError(f"{name!r} has B·A merged into its weight; not supported")
        enable = tuple(module.enable_lora) if isinstance(module, loralib.MergedLinear) else None
        return module.weight, module.lora_A, module.lora_B, module.scaling, module.fan_in_fan_out, enable
    raise ValueError(f"LoRA layer {name!r} ({type(module).__name__}) is not supported by merge mode")


def _unload_loralib(model: nn.Module) -> nn.Module:
    """Replace loralib layers in `model` by plain Linear / Conv1D modules holding the same weight and bias."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, loralib.Linear | loralib.MergedLinear):
            continue
        # Built without storage, then given the same Parameter objects, so the caller can match them to
        # the LoRA model's keys. apply_lora sets fan_in_fan_out only for a replaced Conv1D ([in, out] weight).
        with torch.device("meta"):
            if module.fan_in_fan_out:
                plain = Conv1D(module.out_features, module.in_features)
            else:
                plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
        plain.weight, plain.bias = module.weight, module.bias
        plain.train(module.training)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, plain)
    return model


def base_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the frozen base: every tensor that is not a trainable
    parameter of the LoRA model."""
    if isinstance(model, LoraMergeTarget):
        return list(model._base_keys)
    if lora_backend(model) is None:
        raise ValueError("model has no LoRA modules")
    return [
        key
        for key, tensor in model.state_dict(keep_vars=True).items()
        if not (isinstance(tensor, nn.Parameter) and tensor.requires_grad)
    ]


def base_fingerprint(model: nn.Module, cast_dtype: torch.dtype | None = None) -> str:
    """Fingerprint of the `base_keys` tensors (LoRA model or target): exact, or cast (see
    `base_state_fingerprint`)."""
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
    """dtype name -> `base_fingerprint(model, dtype)` for each of `dtypes` (what a
    LoRA trainer's updates carry)."""
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
    """The dtype a base fingerprint was cast to ("bfloat16:<digest>" ->
    torch.bfloat16); None for an exact one."""
    name, separator, _ = fingerprint.rpartition(":")
    if not separator:
        return None
    dtype = parse_dtype(name)
    if dtype is None or not dtype.is_floating_point:
        raise ValueError(f"base fingerprint {fingerprint[:48]!r} names {name!r}, which is not a "
                         "floating torch dtype")
    return dtype


def lowest_precision_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The floating dtype of `dtypes` with the coarsest precision (largest eps:
    bf16 before fp16 before fp32)."""
    floating = {dtype for dtype in dtypes if dtype.is_floating_point}
    return max(floating, key=lambda d: (torch.finfo(d).eps, -d.itemsize), default=None)


def sent_base_fingerprint(metadata: Mapping[str, Any], cast_dtype: torch.dtype | None) -> str | None:
    """The base fingerprint a LoRA update's `metadata` carries for a maker that
    fingerprints cast to `cast_dtype`."""
    if cast_dtype is None:
        return metadata.get("base_fingerprint")
    return dict(metadata.get("base_fingerprints") or {}).get(dtype_name(cast_dtype))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the key of a cast base fingerprint)."""
    return str(dtype).removeprefix("torch.")
