"""Plain data (YAML) to typed settings: dataclasses built from nested mappings with every key and value
checked, errors naming the dotted key (`ConfigError`); reading YAML files and laying mappings over each other.

Knows no section of the run config but the three that refuse a `sampling` of their own (`TOP_LEVEL_ONLY`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from detached_rl.algorithms.grpo_config import GRPOConfig
from detached_rl.algorithms.ppo_config import PPOConfig
from detached_rl.maker.config import MakerConfig


class ConfigError(ValueError):
    """A configuration key is unknown or its value is invalid; the message names the dotted key."""


# Keys set once at the top of a RunConfig and refused inside these sections (RunConfig hands them on).
TOP_LEVEL_ONLY: dict[type, frozenset[str]] = {
    MakerConfig: frozenset({"sampling"}), PPOConfig: frozenset({"sampling"}),
    GRPOConfig: frozenset({"sampling"}),
}


def from_data(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from nested plain data, checking keys and value types (`path`: where `data` sits
    in the run config, for the messages); what `data` leaves out takes `cls`'s defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    top_level_only = TOP_LEVEL_ONLY.get(cls, frozenset())
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in top_level_only}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{dotted}: unknown key (known keys: {known})")
        kwargs[key] = _convert(hints[key], value, dotted)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as error:
        # "MakerConfig.push_policy must be ..." -> "maker.push_policy: must be ..."
        message = str(error)
        match = re.match(rf"{cls.__name__}\.(\w+)(?::)? (.*)", message, flags=re.DOTALL)
        if match:
            key = f"{path}.{match.group(1)}" if path else match.group(1)
            raise ConfigError(f"{key}: {match.group(2)}") from None
        # "maker.vllm.dtype must be ..." (a section that names its own dotted keys) ->
        # "maker.vllm.dtype: must be ..."
        match = re.match(rf"({re.escape(path)}\.[\w.]+)(?::)? (.*)", message,
                         flags=re.DOTALL) if path else None
        if match:
            raise ConfigError(f"{match.group(1)}: {match.group(2)}") from None
        raise ConfigError(f"{path or 'config'}: {message}") from None


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None:
            if type(None) in options:
                return None
            raise ConfigError(f"{path}: must not be null")
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, path)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {hint}")
    if dataclasses.is_dataclass(hint):
        return from_data(hint, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_hint, value_hint = typing.get_args(hint)
        return {_convert(key_hint, k, f"{path}.{k}"): _convert(value_hint, v, f"{path}.{k}")
                for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(hint)
        item = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if item is None:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{path}[{i}]")
                         for i, (a, v) in enumerate(zip(args, value, strict=True)))
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):  # no setting means "unlimited" by inf: those take null
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML file's top-level mapping (empty for an empty file); refuses missing files and bad YAML."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {error}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r}: the top level must be a mapping")
    return loaded or {}


def merge_mappings(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` laid over `base`: nested mappings merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_mappings(merged[key], value)
        else:
            merged[key] = value
    return merged
