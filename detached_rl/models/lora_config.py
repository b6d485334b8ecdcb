"""A LoRA model's configuration as a JSON dict, and the check that a weight
update's adapter config fits it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from detached_rl.models.lora_backend import lora_backend, loralib_settings, peft_config


def lora_config_dict(model: nn.Module) -> dict[str, Any]:
    """Return the model's LoRA configuration as a JSON-serialisable dict."""
    backend = lora_backend(model)
    if backend == "peft":
        config = peft_config(model)
        if config is None:
            raise ValueError("peft LoRA model has no peft_config")
        targets = config.target_modules
        return {
            "backend": backend,
            "r": config.r,
            "alpha": config.lora_alpha,
            "scaling": config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r),
            "target_modules": [targets] if isinstance(targets, str) else sorted(targets),
            "fan_in_fan_out": config.fan_in_fan_out,
            "bias": config.bias,
            "modules_to_save": sorted(config.modules_to_save) if config.modules_to_save else None,
        }
    settings = loralib_settings(model)
    if backend is None or settings is None:
        raise ValueError("model has no LoRA added by apply_lora")
    return {
        "backend": backend,
        "r": settings.r,
        "alpha": settings.alpha,
        "scaling": settings.scaling,
        "target_modules": sorted(settings.target_modules),
        "fan_in_fan_out": settings.fan_in_fan_out,
        "bias": settings.bias,
        "modules_to_save": None,
    }


# The `lora_config_dict` fields an update's adapter config must match: they fix what B·A means (the backend
# only names the implementation; a different one shows up as unknown keys anyway).
CHECKED_LORA_FIELDS = ("r", "alpha", "scaling", "target_modules", "fan_in_fan_out", "bias", "modules_to_save")


def check_lora_config(expected: Mapping[str, Any], sent: Any, where: str) -> None:
    """Raise ValueError naming the field where `sent` (a `lora_config_dict`) differs from `expected`."""
    if not isinstance(sent, Mapping):
        raise ValueError(f"{where}: the LoRA config is a {type(sent).__name__}, not a mapping")
    for field in CHECKED_LORA_FIELDS:
        if field not in sent:
            raise ValueError(f"{where}: the LoRA config lacks {field!r}")
        mine, theirs = expected.get(field), sent[field]
        if field == "target_modules" and theirs is not None and not isinstance(theirs, str):
            mine, theirs = sorted(mine or ()), sorted(theirs)
        if field in ("alpha", "scaling") and isinstance(theirs, int | float) and not isinstance(theirs, bool):
            same = math.isclose(float(mine), float(theirs), rel_tol=1e-6)
        else:
            same = mine == theirs
        if not same:
            raise ValueError(f"{where}: LoRA {field} is {sent[field]!r} in the update, "
                             f"{expected.get(field)!r} here")


def check_lora_update(expected: Mapping[str, Any], kind: str, metadata: Mapping[str, Any],
                      where: str) -> None:
    """Check an update's `metadata["lora"]` against `expected`; a "lora" update
    must carry it, a full one may."""
    sent = metadata.get("lora")
    if sent is None:
        if kind == "lora":
            raise ValueError(f"{where}: a LoRA update must carry its adapter config in metadata['lora']")
        return
    check_lora_config(expected, sent, where)
