"""Two runs of `detached-rl run` with one maker and fixed seeds (HF backend) give the same samples, the same
metrics and bit-identical adapters: the README's determinism statement, run as a user runs the job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import CLUSTER_MARKER, ROOT, new_cluster_marker
from tests.helpers import gpu_overrides, lane_device, set_flags

pytestmark = pytest.mark.ray

STEPS = 6
# What a run's clocks decide: every other figure must agree bit for bit.
TIMING_PREFIXES = ("time/", "perf/", "throughput/", "eval/seconds", "eval/job_seconds",
                   "maker_versions")  # the version each maker held when the row was written


def run_job(output: Path, name: str) -> subprocess.CompletedProcess:
    """The tiny job with one maker, `maker.seed` and `trainer.max_staleness=0`, from a plain environment.

    The addition task with 24-token answers: the tiny random model writes a number in most answers, so the
    steps have non-zero gradients (the word problems' answers would all score 0 and train nothing)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), CLUSTER_MARKER: new_cluster_marker()}
    command = [sys.executable, "-m", "detached_rl.cli.main", "run", "--model", "tiny", "--steps", str(STEPS),
               "--makers", "1", "--name", name, "--output", str(output), "--no-progress",
               "--set", "maker.seed=0", "--set", "trainer.max_staleness=0", "--set", "task.name=addition",
               "--set", "sampling.max_new_tokens=24", "--set", "task.eval_size=16",
               "--set", "run.eval_every=3",
               *set_flags(gpu_overrides(run_command=True))]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)


def figures(directory: Path) -> list[dict]:
    """The training steps' rows and the before/after evaluations' without the figures that clocks decide.

    Curve points are left out: one is graded while training goes on, by whichever weights the maker serves
    then, and a step that passes between two polls of the driver has none."""
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line]
    rows = [row for row in rows if not str(row.get("eval/label", "")).startswith("step ")]
    return [{key: value for key, value in row.items()
             if not key.startswith(TIMING_PREFIXES) and not key.endswith("_s")} for row in rows]


def adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The exported adapter's tensors."""
    from safetensors.torch import load_file

    return load_file(directory / "adapter" / "adapter_model.safetensors")


@pytest.mark.skipif(lane_device().type == "cuda", reason="the statement is for the CPU lane")
def test_two_runs_with_one_maker_and_fixed_seeds_are_bit_identical(tmp_path):
    runs = [run_job(tmp_path, name) for name in ("first", "second")]
    for done in runs:
        assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    first, second = figures(tmp_path / "first"), figures(tmp_path / "second")
    assert [row["step"] for row in first] == [0, *range(1, STEPS + 1), STEPS]  # before, steps, after
    # the steps trained something: a run that never moves its weights is trivially repeatable
    assert any(row.get("grad_norm/actor", 0.0) > 0 for row in first), first
    for mine, theirs in zip(first, second, strict=True):
        differing = {key for key in mine.keys() | theirs.keys() if mine.get(key) != theirs.get(key)}
        assert not differing, (mine["step"], {key: (mine.get(key), theirs.get(key)) for key in differing})
    assert json.loads((tmp_path / "first" / "eval.json").read_text()) == json.loads(
        (tmp_path / "second" / "eval.json").read_text())  # the same held-out answers, token for token
    ours, theirs = adapter_tensors(tmp_path / "first"), adapter_tensors(tmp_path / "second")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
