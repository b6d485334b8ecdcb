"""Checkpoints survive a kill at every point of a save: the loader finds the new or the previous checkpoint,
leftovers are removed by the next save or load, and everything is fsynced before it is renamed into place.

A kill is real: the save runs in a forked child that SIGKILLs itself at the chosen point (no `finally` runs).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from detached_rl.core import checkpoint
from detached_rl.core.checkpoint import (
    STAGING_MARK,
    has_checkpoint,
    load_state,
    previous_checkpoint,
    remove_stale_staging,
    save_atomic,
)

CHILD_TIMEOUT_S = 60.0


def kill_during(save: Callable[[], object], point: str) -> None:
    """Run `save` in a forked child that is SIGKILLed at `point`: "writing" (tensors written, state.json not),
    "rename_1" or "rename_2" (just after that rename of the swap)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
            if point == "writing":
                real_save_file = checkpoint.save_file
                checkpoint.save_file = lambda *args, **kwargs: (real_save_file(*args, **kwargs), die())
            else:
                real_rename, renames = os.rename, []

                def rename(*args: object, **kwargs: object) -> None:
                    real_rename(*args, **kwargs)
                    renames.append(args)
                    if len(renames) == int(point.removeprefix("rename_")):
                        die()

                os.rename = rename
            save()
        finally:
            os._exit(1)  # the kill point was not reached
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while (status := os.waitpid(pid, os.WNOHANG)[1]) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if status == 0:  # a forked child stuck on a lock another thread held: fail instead of hanging
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the save in the forked child did not reach {point!r} within {CHILD_TIMEOUT_S:.0f}s")
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"the save finished ({status})"


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(("point", "survivor"), [("writing", 1), ("rename_1", 1), ("rename_2", 2)])
def test_a_save_killed_at_any_point_leaves_a_loadable_checkpoint_and_the_next_save_cleans_up(
    tmp_path, caplog, point, survivor
):
    target = tmp_path / "rank_0"
    save_atomic({"step": 1, "w": torch.ones(3)}, target)
    kill_during(lambda: save_atomic({"step": 2, "w": torch.full((3,), 2.0)}, target), point)
    left = names(tmp_path)
    staging = [n for n in left if n.startswith(f".rank_0{STAGING_MARK}")]
    expected = {"writing": ["rank_0"], "rename_1": [".rank_0.old"],
                "rename_2": [".rank_0.old", "rank_0"]}[point]
    assert sorted(set(left) - set(staging)) == expected and len(staging) == (point != "rename_2")

    assert has_checkpoint(target)
    with caplog.at_level(logging.INFO, logger=checkpoint.__name__):
        state = load_state(target)
    assert state["step"] == survivor and torch.equal(state["w"], torch.full((3,), float(survivor)))
    fell_back = "loading the previous checkpoint" in caplog.text
    assert fell_back == (point == "rename_1") and (".rank_0.old" in caplog.text) == fell_back
    assert not any(n.startswith(f".rank_0{STAGING_MARK}") for n in names(tmp_path))  # the load removed it

    save_atomic({"step": 3}, target)
    assert names(tmp_path) == ["rank_0"] and load_state(target) == {"step": 3}


def test_a_first_save_killed_before_its_rename_leaves_no_checkpoint_and_nothing_behind(tmp_path):
    target = tmp_path / "ckpt"
    kill_during(lambda: save_atomic({"step": 1}, target), "writing")
    assert len(names(tmp_path)) == 1 and not has_checkpoint(target)
    with pytest.raises(FileNotFoundError, match="not a detached-rl checkpoint"):
        load_state(target)
    assert names(tmp_path) == []


def test_a_next_save_cleans_up_after_a_kill_between_the_renames(tmp_path):
    target = tmp_path / "ckpt"
    save_atomic({"step": 1}, target)
    kill_during(lambda: save_atomic({"step": 2}, target), "rename_1")
    save_atomic({"step": 3}, target)  # no load in between
    assert names(tmp_path) == ["ckpt"] and load_state(target) == {"step": 3}


def test_only_staging_directories_of_gone_processes_or_of_no_save_of_this_one_are_removed(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True,
                          check=True)
    prefix = f".ckpt{STAGING_MARK}"
    dead, mine, alive = (tmp_path / f"{prefix}{pid}-x1" for pid in (int(gone.stdout), os.getpid(), 1))
    others = [tmp_path / f".other{STAGING_MARK}{int(gone.stdout)}-x2", tmp_path / "ckpt-notes",
              tmp_path / ".ckpt.old"]
    for path in (dead, mine, alive, *others):
        path.mkdir()
    assert sorted(remove_stale_staging(tmp_path / "ckpt")) == sorted([dead, mine])
    assert alive.exists() and all(p.exists() for p in others)

    seen = {}

    def write(staging: Path) -> None:  # a load of the same checkpoint in the middle of a save
        remove_stale_staging(tmp_path / "ckpt")
        seen["kept"] = staging.exists()
        (staging / "file").write_text("x")

    checkpoint.write_directory_atomically(tmp_path / "ckpt", write)
    assert seen == {"kept": True} and (tmp_path / "ckpt" / "file").read_text() == "x"


def test_files_and_directories_are_fsynced_before_and_after_each_rename(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    save_atomic({"step": 1}, target)
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(descriptor: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    def rename(source: os.PathLike, destination: os.PathLike) -> None:
        events.append(("rename", Path(destination).name))
        real_rename(source, destination)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    save_atomic({"step": 2, "w": torch.ones(2)}, target)
    parent = ("fsync", str(tmp_path))
    first_rename = events.index(("rename", ".ckpt.old"))
    staged = {Path(path).name for kind, path in events[:first_rename] if kind == "fsync"}
    assert {"state.json", "tensors.safetensors"} <= staged
    assert any(name.startswith(f".ckpt{STAGING_MARK}") for name in staged)  # the staging directory itself
    assert events[first_rename + 1] == parent
    assert events[first_rename + 2] == ("rename", "ckpt") and events[first_rename + 3] == parent
    assert events[-1] == parent  # after removing the retired checkpoint
    assert previous_checkpoint(target).exists() is False
