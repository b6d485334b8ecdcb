"""Which LoRA a model carries (peft or loralib) and where its settings are kept.

Imports neither peft nor loralib: a model can hold their layers only once its process has imported them,
so a process without LoRA (a scorer, a maker of a full-weights run) never pays for their import.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from torch import nn

from detached_rl.models.lora_settings import LoraSettings

if TYPE_CHECKING:
    import peft

# apply_lora keeps the resolved LoraSettings of a loralib model here (peft keeps its own peft_config).
SETTINGS_ATTR = "_detached_rl_lora_settings"


def lora_backend(model: nn.Module) -> str | None:
    """Return "peft" or "loralib" for the LoRA implementation in `model`, or None if it has no LoRA."""
    modules = list(model.modules())
    if "peft" in sys.modules:
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer as PeftLoraLayer

        if isinstance(model, PeftModel) or any(isinstance(m, PeftLoraLayer) for m in modules):
            return "peft"
    if "loralib" in sys.modules:
        from loralib import LoRALayer

        if any(isinstance(m, LoRALayer) for m in modules):
            return "loralib"
    return None


def _lora_holder(model: nn.Module, attribute: str) -> nn.Module:
    """The module that carries `attribute` (peft's `peft_config`, loralib's settings): `model`, else the first
    submodule that does (a critic's backbone); `model` when none does."""
    if getattr(model, attribute, None):
        return model
    return next((m for m in model.modules() if getattr(m, attribute, None)), model)


def loralib_settings(model: nn.Module) -> LoraSettings | None:
    """The resolved settings `apply_lora` kept on a loralib model (or its
    backbone); None for peft or no LoRA."""
    return getattr(_lora_holder(model, SETTINGS_ATTR), SETTINGS_ATTR, None)


def peft_config(model: nn.Module) -> peft.LoraConfig | None:
    """The active adapter's `peft.LoraConfig` of a peft model (or its backbone); None without one."""
    holder = _lora_holder(model, "peft_config")
    configs = getattr(holder, "peft_config", None)
    if not configs:
        return None
    adapter = getattr(holder, "active_adapter", None)
    return configs[adapter] if adapter in configs else next(iter(configs.values()))


def model_bias(model: nn.Module) -> str:
    """The LoRA bias mode the model was made with ("none", "all", "lora_only")."""
    backend = lora_backend(model)
    if backend == "peft":
        config = peft_config(model)
        return config.bias if config is not None else "none"
    settings = loralib_settings(model)
    return settings.bias if settings is not None else "none"


def base_keys(model: nn.Module) -> list[str]:
    """State-dict keys of the frozen base: every tensor that is no trainable parameter of the LoRA model."""
    # A merge-mode target (`LoraMergeTarget`) keeps the keys of the LoRA model it was built from.
    frozen = getattr(model, "frozen_base_keys", None)
    if frozen is not None:
        return list(frozen)
    if lora_backend(model) is None:
        raise ValueError("model has no LoRA modules")
    return [
        key
        for key, tensor in model.state_dict(keep_vars=True).items()
        if not (isinstance(tensor, nn.Parameter) and tensor.requires_grad)
    ]
