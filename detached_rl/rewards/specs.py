"""Rewards named by import path (`my_rewards:score`), by file (`path/to/rewards.py:score`, verl's convention)
or by built-in name, with weights and metric labels."""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detached_rl.rewards.builtin import BUILTIN_REWARDS

_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_FILE = re.compile(r"(?P<file>[^:]+\.py):(?P<attribute>[A-Za-z_][\w.]*)")
_LABEL = re.compile(r"[A-Za-z0-9_.-]+")


class RewardSpecError(ValueError):
    """A reward that cannot be named or imported: one line naming the config field."""


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a task: where its function is (`module:name` or a built-in name), its weight in the
    total and the label its metric has (`reward/<label>_mean`)."""

    fn: str
    weight: float = 1.0
    label: str = ""

    def __post_init__(self) -> None:
        file = _FILE.fullmatch(self.fn) if isinstance(self.fn, str) else None
        if file is not None and Path(file["file"]).is_file():  # absolute: the actors run elsewhere
            object.__setattr__(self, "fn", f"{Path(file['file']).resolve()}:{file['attribute']}")
        elif file is None and not (isinstance(self.fn, str)
                                   and (self.fn in BUILTIN_REWARDS or _PATH.fullmatch(self.fn))):
            raise RewardSpecError(f"fn: {self.fn!r} is neither 'module:function', 'path/to/file.py:function' "
                                  f"nor a built-in reward ({', '.join(sorted(BUILTIN_REWARDS))})")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int | float) \
                or not math.isfinite(self.weight):
            raise RewardSpecError(f"weight: must be a finite number, got {self.weight!r}")
        if self.label and not _LABEL.fullmatch(str(self.label)):
            raise RewardSpecError(f"label: letters, digits, '_', '.' and '-' only, got {self.label!r}")
        if not self.label:
            object.__setattr__(self, "label", self.fn.rsplit(":", 1)[-1].rsplit(".", 1)[-1])
        object.__setattr__(self, "weight", float(self.weight))

    @property
    def target(self) -> str:
        """The import path of the function (built-in names expanded)."""
        if self.fn in BUILTIN_REWARDS:
            return f"detached_rl.rewards.builtin:{self.fn}"
        if self.fn.startswith("detached_rl:") and self.fn.split(":", 1)[1] in BUILTIN_REWARDS:
            return f"detached_rl.rewards.builtin:{self.fn.split(':', 1)[1]}"
        return self.fn

    @property
    def module(self) -> str:
        """The module the function lives in."""
        return self.target.split(":", 1)[0]

    @property
    def file(self) -> Path | None:
        """The reward's .py file when it is named by file (it may exist only on the driver's host)."""
        return Path(self.module) if self.module.endswith(".py") else None

    @property
    def builtin(self) -> bool:
        """Whether the function ships with detached-rl."""
        return self.file is None and self.module.split(".")[0] == "detached_rl"


def reward_specs(reward: str | None, rewards: Sequence[RewardSpec] = (),
                 field: str = "task") -> list[RewardSpec]:
    """The task's rewards: `task.reward` (one, weight 1) or `task.rewards`; nothing imported. Refused with
    the field named when both are set or two share a label."""
    if reward is not None and rewards:
        raise RewardSpecError(f"{field}.reward and {field}.rewards are both set: give one")
    if reward is not None:
        try:
            return [RewardSpec(reward)]
        except RewardSpecError as error:
            raise RewardSpecError(f"{field}.reward: {str(error).split(': ', 1)[1]}") from None
    labels = [spec.label for spec in rewards]
    duplicated = sorted({label for label in labels if labels.count(label) > 1})
    if duplicated:
        raise RewardSpecError(f"{field}.rewards: label(s) {duplicated} used twice: give each a `label`")
    return list(rewards)


def import_reward_module(module: str) -> Any:
    """The module of a reward: an import path, or a .py file, loaded from the file where it lies on this host,
    else the copy shipped with the job (`config.shipping`: importable by the file's name)."""
    if not module.endswith(".py"):
        return importlib.import_module(module)
    path = Path(module)
    if not path.is_file():
        return importlib.import_module(path.stem)
    loaded = sys.modules.get(path.stem)
    if loaded is not None and getattr(loaded, "__file__", None) and Path(loaded.__file__).resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} cannot be loaded as a Python module")
    found = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = found  # as an import would: the module's own imports of itself find it
    try:
        spec.loader.exec_module(found)
    except BaseException:
        sys.modules.pop(path.stem, None)
        raise
    return found


def resolve(spec: RewardSpec, where: str = "task.reward") -> Callable[..., Any]:
    """The function `spec` names, imported (RewardSpecError naming `where` when it cannot be)."""
    module_name, _, attribute = spec.target.partition(":")
    try:
        found: Any = import_reward_module(module_name)
    except Exception as error:  # noqa: BLE001 - the user's module may raise anything at import
        raise RewardSpecError(f"{where}: cannot import module {module_name!r} ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else ''})") from error
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise RewardSpecError(f"{where}: module {module_name!r} has no {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise RewardSpecError(f"{where}: {spec.fn!r} is a {type(found).__name__}, not a function")
    return found


def shipped_path(spec: RewardSpec) -> Path | None:
    """Where the module of a user's reward lies on this machine (a .py file, or its top-level package's
    directory), for shipping to other hosts; None for detached-rl's own and for installed packages (each
    host has those already)."""
    if spec.builtin:
        return None
    if spec.file is not None:
        return spec.file if spec.file.is_file() else None
    top = spec.module.split(".")[0]
    module = sys.modules.get(top) or importlib.import_module(top)
    location = getattr(module, "__file__", None)
    if location is None:
        return None
    path = Path(location).resolve()
    if any(part in ("site-packages", "dist-packages") for part in path.parts):
        return None
    return path.parent if path.name == "__init__.py" else path
