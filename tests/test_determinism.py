"""Two runs of `detached-rl run` with one maker and fixed seeds (HF backend) give the same samples, the same
metrics and bit-identical adapters: the README's determinism statement, run as a user runs the job. The first
run is the session's tiny run (tests/tiny_run.py, whose artefacts tests/test_run_job.py checks); this module
runs the same command once more."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import lane_device
from tests.tiny_run import STEPS, TinyRun, run_tiny_job

pytestmark = pytest.mark.ray

# What a run's clocks decide: every other figure must agree bit for bit.
TIMING_PREFIXES = ("time/", "perf/", "throughput/", "eval/seconds", "eval/job_seconds",
                   "maker_versions")  # the version each maker held when the row was written


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
def test_two_runs_with_one_maker_and_fixed_seeds_are_bit_identical(tiny_run: TinyRun, tmp_path: Path):
    again = run_tiny_job(tmp_path / "runs", tmp_path / "home")
    first, second = figures(tiny_run.directory), figures(again.directory)
    assert [row["step"] for row in first] == [0, *range(1, STEPS + 1), STEPS]  # before, steps, after
    # the steps trained something: a run that never moves its weights is trivially repeatable
    assert any(row.get("grad_norm/actor", 0.0) > 0 for row in first), first
    for mine, theirs in zip(first, second, strict=True):
        differing = {key for key in mine.keys() | theirs.keys() if mine.get(key) != theirs.get(key)}
        assert not differing, (mine["step"], {key: (mine.get(key), theirs.get(key)) for key in differing})
    assert json.loads((tiny_run.directory / "eval.json").read_text()) == json.loads(
        (again.directory / "eval.json").read_text())  # the same held-out answers, token for token
    ours, theirs = adapter_tensors(tiny_run.directory), adapter_tensors(again.directory)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
