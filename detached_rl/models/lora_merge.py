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
from dataclasses import dataclass
from typing import Any

import loralib
import torch
from peft.tuners.lora import Linear as PeftLinear
from peft.tuners.lora import LoraLayer as PeftLoraLayer
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from detached_rl.models.lora import lora_backend, lora_config_dict
from detached_rl.models.lora_backend import base_keys

__all__ = ["LoraMergeTarget"]


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
        self.frozen_base_keys = tuple(base)  # the LoRA model's `base_keys` (what `base_keys(self)` returns)
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
