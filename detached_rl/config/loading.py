"""Turn YAML and `key.sub=value` overrides into a validated `RunConfig`, laid over the main job's recipe;
unknown keys and bad values name the dotted key."""

from __future__ import annotations

import os
from typing import Any

import yaml

# The conversion's names, importable from here too (where they were defined before).
from detached_rl.config.convert import ConfigError, from_data, merge_mappings, read_yaml
from detached_rl.config.schema import RunConfig, main_job

__all__ = ["ConfigError", "dump_config", "from_dict", "load_config", "merge_mappings", "parse_override",
           "read_yaml"]


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from nested plain data, checking keys and value types; a `RunConfig`'s data is
    laid over the main job's recipe (`main_job`), so a section given in part keeps the rest of the recipe."""
    if cls is RunConfig and isinstance(data, dict):
        data = merge_mappings(main_job(), data)
    return from_data(cls, data, path)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key.path=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(f"override {key}: cannot parse value {raw!r}: {error}") from None
    return key.strip().split("."), value


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    base: str | os.PathLike | None = None,
) -> RunConfig:
    """Read a YAML config (laid over the `base` YAML, if any, and the defaults), apply overrides, validate."""
    data: dict[str, Any] = read_yaml(base) if base is not None else {}
    if path is not None:
        data = merge_mappings(data, read_yaml(path))
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {'.'.join(keys[: depth + 1])}: is not a mapping")
            node = child
        node[keys[-1]] = value
    return from_dict(RunConfig, data)


def dump_config(config: RunConfig) -> str:
    """The config as YAML (tuples as lists)."""
    return yaml.safe_dump(_plain(config.to_dict()), sort_keys=False)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
