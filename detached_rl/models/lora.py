"""LoRA for Hugging Face causal LMs through peft (default) or loralib, with only the adapters trainable."""

from __future__ import annotations

import copy
from dataclasses import asdict
from typing import Any

import loralib
import peft
import torch
from peft.tuners.lora import LoraLayer as PeftLoraLayer
from peft.utils import ModulesToSaveWrapper
from torch import nn
from transformers.pytorch_utils import Conv1D

from detached_rl.models.lora_backend import SETTINGS_ATTR, lora_backend, model_bias
from detached_rl.models.lora_config import check_lora_config, check_lora_update, lora_config_dict
from detached_rl.models.lora_settings import ALL_LINEAR, BIAS_MODES, LoraSettings
from detached_rl.models.scalar_heads import Critic, RewardModel

# The LoRA API in one place: detection (`lora_backend`) and the config dict and its
# checks (`lora_config`) too.
__all__ = [
    "LoraSettings",
    "apply_lora",
    "check_lora_config",
    "check_lora_update",
    "count_parameters",
    "default_target_modules",
    "load_lora_state_dict",
    "lora_backend",
    "lora_config_dict",
    "lora_state_dict",
    "mark_only_lora_trainable",
    "merged_model",
]

_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "opt", "gptj"), ("q_proj", "v_proj")
    ),
    "gpt2": ("c_attn",),
    **dict.fromkeys(("bloom", "gpt_neox", "falcon"), ("query_key_value",)),
}


def default_target_modules(model: nn.Module) -> tuple[str, ...]:
    """Return the usual LoRA target module names for the model's architecture."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _DEFAULT_TARGETS:
        raise ValueError(
            f"no default LoRA target modules for model_type {model_type!r}; pass LoraSettings.target_modules"
        )
    return _DEFAULT_TARGETS[model_type]



def all_linear_targets(model: nn.Module) -> tuple[str, ...]:
    """The distinct leaf names of every Linear / Conv1D layer except the output head (peft's "all-linear")."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {name.rpartition(".")[2] for name, module in model.named_modules()
             if isinstance(module, nn.Linear | Conv1D) and module is not output}
    if not names:
        raise ValueError("LoRA target 'all-linear': the model has no Linear layers besides its output head")
    return tuple(sorted(names))


def _name_matches(name: str, targets: tuple[str, ...]) -> bool:
    # Same rule as peft for a list of names: the full name, or a suffix after a dot.
    return any(name == t or name.endswith("." + t) for t in targets)


def _matching_modules(model: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Module]:
    matched = {name: module for name, module in model.named_modules() if _name_matches(name, targets)}
    for target in targets:
        if not any(_name_matches(name, (target,)) for name in matched):
            raise ValueError(f"LoRA target module {target!r} matches no module in the model")
    return matched


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Add LoRA to `model` (modified in place) and leave only the adapters trainable; return the LoRA model.

    `model` is a causal LM (a policy), a transformer body without an LM head (a critic's backbone), or a
    `Critic` / `RewardModel`, whose backbone gets the adapters (its scalar head stays trainable) and which is
    returned itself.
    """
    if lora_backend(model) is not None:
        raise ValueError("model already has LoRA modules")
    if isinstance(model, Critic | RewardModel):
        model.backbone = apply_lora(model.backbone, settings)
        return model
    targets = settings.target_modules or default_target_modules(model)
    if targets == (ALL_LINEAR,):
        targets = all_linear_targets(model)
    matched = _matching_modules(model, targets)
    fan_in_fan_out = settings.fan_in_fan_out
    if fan_in_fan_out is None:
        fan_in_fan_out = any(isinstance(m, Conv1D) for m in matched.values())
    resolved = LoraSettings(
        **{**asdict(settings), "target_modules": targets, "fan_in_fan_out": fan_in_fan_out}
    )

    if resolved.backend == "peft":
        config = peft.LoraConfig(
            task_type=_peft_task_type(model),
            r=resolved.r,
            lora_alpha=resolved.alpha,
            lora_dropout=resolved.dropout,
            target_modules=list(targets),
            bias=resolved.bias,
            modules_to_save=list(resolved.modules_to_save) if resolved.modules_to_save else None,
            fan_in_fan_out=fan_in_fan_out,
        )
        model = peft.get_peft_model(model, config)
    else:
        # Build every replacement before swapping any in, so a bad target leaves the model untouched.
        replacements = {name: _loralib_module(name, module, resolved) for name, module in matched.items()}
        for name, new in replacements.items():
            parent_name, _, child_name = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child_name, new)
        setattr(model, SETTINGS_ATTR, resolved)
    mark_only_lora_trainable(model, bias=resolved.bias)
    return model


def _peft_task_type(model: nn.Module) -> peft.TaskType:
    """CAUSAL_LM for a model that generates; FEATURE_EXTRACTION for a body without an LM head (a critic's
    backbone), which peft's causal-LM wrapper cannot take (it needs `prepare_inputs_for_generation`)."""
    generates = callable(getattr(model, "prepare_inputs_for_generation", None))
    return peft.TaskType.CAUSAL_LM if generates else peft.TaskType.FEATURE_EXTRACTION


def _loralib_module(name: str, module: nn.Module, settings: LoraSettings) -> nn.Module:
    if isinstance(module, nn.Linear):
        is_conv1d, in_features, out_features = False, module.in_features, module.out_features
    elif isinstance(module, Conv1D):
        # Conv1D stores its weight as [in, out]; loralib with fan_in_fan_out=True stores it the same way.
        is_conv1d, (in_features, out_features) = True, module.weight.shape
    else:
        raise ValueError(
            f"LoRA target {name!r} is a {type(module).__name__}; loralib supports Linear and Conv1D"
        )
    if settings.fan_in_fan_out != is_conv1d:
        raise ValueError(
            f"LoraSettings.fan_in_fan_out={settings.fan_in_fan_out} does not fit {name!r} "
            f"({type(module).__name__}); leave it None to choose automatically"
        )
    weight = module.weight
    # merge_weights=False: loralib would otherwise add B·A into the weight on .eval() and subtract it on
    # .train(), so weight sync and checkpoints would depend on the module's mode.
    kwargs: dict[str, Any] = dict(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        fan_in_fan_out=is_conv1d,
        merge_weights=False,
        bias=module.bias is not None,
        device=weight.device,
        dtype=weight.dtype,
    )
    if settings.merged_enable is not None:
        if out_features % len(settings.merged_enable):
            raise ValueError(
                f"LoraSettings.merged_enable has {len(settings.merged_enable)} parts, which do not divide "
                f"the {out_features} outputs of {name!r}"
            )
        new = loralib.MergedLinear(
            in_features, out_features, enable_lora=list(settings.merged_enable), **kwargs
        )
    else:
        new = loralib.Linear(in_features, out_features, **kwargs)
    with torch.no_grad():
        new.weight.copy_(weight)
        if module.bias is not None:
            new.bias.copy_(module.bias)
    new.train(module.training)
    return new


def _adapter_parameters(model: nn.Module, bias: str) -> dict[str, nn.Parameter]:
    """The parameters that make up the adapter: what is trainable and what lora_state_dict holds."""
    if bias not in BIAS_MODES:
        raise ValueError(f"bias must be one of {BIAS_MODES}, got {bias!r}")
    extra: set[int] = set()
    for module in model.modules():
        if bias == "lora_only" and isinstance(module, PeftLoraLayer | loralib.LoRALayer):
            layer_bias = getattr(
                module.get_base_layer() if isinstance(module, PeftLoraLayer) else module, "bias", None
            )
            if isinstance(layer_bias, nn.Parameter):
                extra.add(id(layer_bias))
        if isinstance(module, ModulesToSaveWrapper):
            extra.update(id(p) for p in module.modules_to_save.parameters())
    # Parameters only: a plain "bias" substring test on the state dict (as loralib's helpers do) would also
    # catch buffers such as old GPT-2 attention masks.
    return {
        name: p
        for name, p in model.named_parameters()
        if "lora_" in name or id(p) in extra or (bias == "all" and name.rsplit(".", 1)[-1] == "bias")
    }


def mark_only_lora_trainable(model: nn.Module, bias: str = "none") -> None:
    """Make only the LoRA parameters (plus biases per `bias` and peft modules_to_save) trainable."""
    keep = {id(p) for p in _adapter_parameters(model, bias).values()}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Return detached clones of the adapter tensors, keyed by the model's parameter names."""
    return {name: p.detach().clone() for name, p in _adapter_parameters(model, model_bias(model)).items()}


def load_lora_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set the adapter tensors from `state`; all keys and shapes are checked before anything is copied."""
    params = _adapter_parameters(model, model_bias(model))
    for key in state:
        if key not in params:
            raise ValueError(f"unknown LoRA state key {key!r}")
    for key, p in params.items():
        if key not in state:
            raise ValueError(f"missing LoRA state key {key!r}")
        if tuple(state[key].shape) != tuple(p.shape):
            raise ValueError(
                f"LoRA state key {key!r} has shape {tuple(state[key].shape)}, expected {tuple(p.shape)}"
            )
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(state[key])


def merged_model(model: nn.Module) -> nn.Module:
    """Return a plain copy of the model with the LoRA deltas merged into the weights; `model` is unchanged."""
    backend = lora_backend(model)
    if backend is None:
        raise ValueError("model has no LoRA modules to merge")
    merged = copy.deepcopy(model)
    if backend == "peft":
        if isinstance(merged, peft.PeftModel):
            return merged.merge_and_unload()
        # A critic or reward model: its backbone is the peft model.
        for name, module in list(merged.named_modules()):
            if isinstance(module, peft.PeftModel):
                parent_name, _, child_name = name.rpartition(".")
                setattr(merged.get_submodule(parent_name), child_name, module.merge_and_unload())
        return merged
    for name, module in list(merged.named_modules()):
        if isinstance(module, loralib.LoRALayer):
            parent_name, _, child_name = name.rpartition(".")
            setattr(merged.get_submodule(parent_name), child_name, _plain_module(module))
    for module in merged.modules():
        if hasattr(module, SETTINGS_ATTR):
            delattr(module, SETTINGS_ATTR)
    return merged


def _plain_module(module: nn.Module) -> nn.Module:
    if not isinstance(module, loralib.Linear | loralib.MergedLinear):
        raise ValueError(f"cannot merge loralib module of type {type(module).__name__}")
    weight = module.weight.detach()
    with torch.no_grad():
        if hasattr(module, "lora_A") and not module.merged:
            if isinstance(module, loralib.MergedLinear):
                # merge_AB scatters the enabled q/k/v blocks into a zero-padded delta in the weight's layout.
                delta = module.merge_AB()
            else:
                delta = module.lora_B @ module.lora_A
                delta = delta.T if module.fan_in_fan_out else delta
            weight = weight + delta.to(weight.dtype) * module.scaling
        weight = weight.contiguous().clone()
    # apply_lora only sets fan_in_fan_out for modules that replaced a Conv1D.
    if module.fan_in_fan_out:
        with weight.device:
            plain = Conv1D(module.out_features, module.in_features)
    else:
        plain = nn.utils.skip_init(
            nn.Linear,
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device=weight.device,
            dtype=weight.dtype,
        )
    plain.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
    plain.bias = module.bias
    plain.train(module.training)
    return plain


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """Return (trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
