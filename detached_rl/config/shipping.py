"""The user's task travels with the actors that need it: reward modules and data in the job's runtime_env.

Makers and reward scorers may run on hosts that have neither the user's reward module nor their dataset.
`task_shipment` names, for Ray's `py_modules`, each reward module that is the user's own (a .py file or a
package directory; detached-rl's and installed packages are on every host already) and a staged package
holding the dataset (and a held-out file), whose path in the actors' config becomes
`shipped:<package>/<name>` (`core.task_data.resolve_data_path`). The CLI's jobs (`run`, `maker`, `scorers`)
join Ray with it as their job's runtime_env (Ray uploads local paths only at the job level): Ray uploads each
once, by content hash, to the cluster's store and unpacks it on every node that starts one of the job's
actors, detached ones too, also when it restarts one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from detached_rl.config.schema import RunConfig
from detached_rl.core.task_data import SHIPPED
from detached_rl.rewards.specs import resolve, shipped_path

# Ray keeps a package in its object store (GCS): far below its limit, with the models' weights beside it.
MAX_SHIPPED_BYTES = 256 * 1024 * 1024
_STAGED: dict[tuple[str, ...], Path] = {}


def _size(path: Path) -> int:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files)


def _digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        for item in sorted([path] if path.is_file() else (p for p in path.rglob("*") if p.is_file())):
            digest.update(str(item.relative_to(path.parent)).encode())
            digest.update(item.read_bytes())
    return digest.hexdigest()[:16]


def _stage(paths: list[Path]) -> Path:
    """A package `detached_rl_task_<digest>` holding copies of `paths` (files or directories)."""
    key = tuple(str(p) for p in paths)
    if key in _STAGED and _STAGED[key].exists():
        return _STAGED[key]
    total = sum(_size(p) for p in paths)
    if total > MAX_SHIPPED_BYTES:
        raise ValueError(f"task.dataset: {', '.join(map(str, paths))} is {total / 2**20:.0f} MiB, over the "
                         f"{MAX_SHIPPED_BYTES // 2**20} MiB shipped with the actors; put it at the same path "
                         "on every maker host instead (task.prompt_file)")
    package = Path(tempfile.mkdtemp(prefix="drl-ship-")) / f"detached_rl_task_{_digest(paths)}"
    package.mkdir()
    (package / "__init__.py").write_text('"""A dataset shipped with detached-rl actors."""\n')
    for path in paths:
        (shutil.copytree if path.is_dir() else shutil.copy2)(path, package / path.name)
    _STAGED[key] = package
    return package


def _is_split(dataset: str, name: str) -> bool:
    """Whether `name` is a split of the `DatasetDict` saved at `dataset` (the loader takes a split name before
    a path of the same name)."""
    index = Path(dataset) / "dataset_dict.json"
    return index.is_file() and name in json.loads(index.read_text()).get("splits", [])


def shipped_config(config: RunConfig) -> tuple[RunConfig, Path | None]:
    """The config the actors read their dataset with (`shipped:<package>/<file>`) and the staged package
    holding it (None without a dataset); the package is on this driver's path too: it reads the same copy."""
    task = config.task
    if task.dataset is None:
        return config, None
    data = [Path(task.dataset).resolve()]
    held_out = task.held_out
    if isinstance(held_out, str) and Path(held_out).exists() and not _is_split(task.dataset, held_out):
        data.append(Path(held_out).resolve())
    package = _stage(data)
    if str(package.parent) not in sys.path:
        sys.path.append(str(package.parent))
    moved = {"dataset": f"{SHIPPED}{package.name}/{data[0].name}"}
    if len(data) > 1:
        moved["held_out"] = f"{SHIPPED}{package.name}/{data[1].name}"
    return dataclasses.replace(config, task=dataclasses.replace(task, **moved)), package


def task_shipment(config: RunConfig) -> tuple[RunConfig, dict[str, Any] | None]:
    """(the config makers and scorers are built from, the runtime_env that brings the user's reward modules
    and dataset to their hosts; None when the task is all detached-rl's own). Imports each reward here: one
    that cannot be imported is refused now (`RewardSpecError`), not on a far host."""
    task = config.task
    modules: list[str] = []
    for index, spec in enumerate(task.reward_specs):
        resolve(spec, "task.reward" if task.reward is not None else f"task.rewards[{index}].fn")
        path = shipped_path(spec)
        if path is not None and str(path) not in modules:
            modules.append(str(path))
    config, package = shipped_config(config)
    if package is not None:
        modules.append(str(package))
    return config, ({"py_modules": modules} if modules else None)
