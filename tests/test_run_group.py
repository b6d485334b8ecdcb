"""`detached-rl run` with a trainer group: the ranks `trainer_group` asks for train,
through the one launch path, each on its own samples (one maker feeds both)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import CLUSTER_MARKER, ROOT, marked_processes, new_cluster_marker

pytestmark = pytest.mark.ray

STEPS = 2


def test_run_trains_with_every_rank_of_a_ddp_group_and_leaves_nothing_behind(tmp_path):
    marker = new_cluster_marker()
    env = {**os.environ, "PYTHONPATH": str(ROOT), CLUSTER_MARKER: marker}
    # On the CPU, whatever the lane: two DDP ranks on one GPU's shares would not form a NCCL group.
    command = [sys.executable, "-m", "detached_rl.cli.main", "run", "--model", "tiny", "--steps", str(STEPS),
               "--name", "grp", "--output", str(tmp_path), "--namespace", "detached_rl_run_group_test",
               "--no-progress", "--makers", "1", "--set", "trainer_group.world_size=2",
               "--set", "trainer_group.strategy=ddp", "--set", "task.eval_size=8",
               "--set", "sampling.max_new_tokens=8", "--set", "run.gpus=manual", "--set", "run.examples=0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert "a trainer group of 2 ranks (ddp)" in done.stdout
    assert "grp-trainer_0, grp-trainer_1" in done.stdout
    summary = json.loads((tmp_path / "grp" / "summary.json").read_text())
    ranks = summary["trainers"]
    assert [(r["name"], r["rank"], r["world_size"]) for r in ranks] == [("grp-trainer_0", 0, 2),
                                                                       ("grp-trainer_1", 1, 2)]
    assert all(r["steps"] == STEPS and r["state"] == "done" and r["samples_trained"] > 0 for r in ranks)
    assert ranks[0]["samples_trained"] == ranks[1]["samples_trained"]  # DDP: every rank a full batch a step
    # A step's metrics count both ranks' samples ("samples" is summed over the ranks).
    rows = [json.loads(line) for line in (tmp_path / "grp" / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row.get("kind") != "eval"]
    assert [row["step"] for row in steps] == list(range(1, STEPS + 1))
    assert sum(row["samples"] for row in steps) == sum(r["samples_trained"] for r in ranks)
    assert summary["steps"] == STEPS and (tmp_path / "grp" / "merged").is_dir()
    deadline = time.monotonic() + 60  # the driver has exited; a loaded machine may take a while to reap
    while (left_over := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left_over == []
