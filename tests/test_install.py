"""A plain `pip install .` (no extras) into a fresh venv runs the main job to the end and writes every
artefact.

Minutes, not seconds (venv, torch, the project and its dependencies, then a 2-step run on the tiny model):
part of `make test-e2e`; `make test` checks in seconds what the wheel ships (tests/test_package_contents.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import pytest

from tests.conftest import CLUSTER_MARKER, ROOT, marked_processes, new_cluster_marker
from tests.helpers import plotted_panels

pytestmark = [pytest.mark.install, pytest.mark.e2e]

STEPS = 2
RUN = "install-check"
PIP_TIMEOUT_S = 1200
RUN_TIMEOUT_S = 900
# What `pip install .` reads from the checkout; the rest (.venv, caches, run outputs) stays behind.
NOT_COPIED = shutil.ignore_patterns(".git", ".venv", "build", "runs", "*.egg-info", "__pycache__",
                                    ".pytest_cache",
                                   ".ruff_cache", ".hypothesis", "results")


def pinned_torch() -> str:
    """The `torch==…` requirement of pyproject.toml (installed first: pip finds that build on disk)."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d for d in dependencies if re.match(r"torch\s*==", d)).replace(" ", "")


def step(command: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run one setup or job command; fail with its output when it fails."""
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (f"{' '.join(command)} exited {done.returncode}\n"
                                  f"stdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}")
    return done


@pytest.fixture(scope="module")
def installed_run():
    """Install the project into a fresh venv in a temporary directory and run the main job there (from outside
    the checkout, so only the installed package can be imported); yields the run directory, the job's output,
    the venv, the job's process marker and the seconds each phase took. Everything is removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix="drl-install-"))
    try:
        # Only the environment a user has: no PYTHONPATH to the checkout, no active venv.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                    "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        source = work / "source"
        shutil.copytree(ROOT, source, ignore=NOT_COPIED)
        venv = work / "venv"
        # --no-compile: no .pyc for all of torch and ray (minutes of install and of clean-up on 2 cores).
        python = venv / "bin" / "python"
        pip = [str(python), "-m", "pip", "install", "--quiet", "--no-compile"]
        seconds: dict[str, float] = {}

        start = time.monotonic()
        # The same Python as this test (a venv made from a venv is based on the base interpreter).
        step([sys.executable, "-m", "venv", str(venv)], work, env, 300)
        # first: else pip resolves a multi-GB CUDA build
        step([*pip, pinned_torch()], work, env, PIP_TIMEOUT_S)
        step([*pip, "."], source, env, PIP_TIMEOUT_S)
        seconds["install"] = time.monotonic() - start

        marker = new_cluster_marker()
        start = time.monotonic()
        job = step([str(venv / "bin" / "detached-rl"), "run", "--model", "tiny", "--steps", str(STEPS),
                    "--makers",
                    "1", "--name", RUN, "--output", str(work / "runs"), "--namespace",
                    "detached_rl_install_test",
                    "--no-progress", "--set", "task.eval_size=4", "--set", "sampling.max_new_tokens=8",
                    "--set", "run.examples=1"],
                   work, {**env, CLUSTER_MARKER: marker}, RUN_TIMEOUT_S)
        seconds["run"] = time.monotonic() - start
        print(f"fresh venv: install {seconds['install']:.0f} s, run {seconds['run']:.0f} s")
        yield {"directory": work / "runs" / RUN, "stdout": job.stdout, "venv": venv, "python": python,
               "env": env, "work": work, "marker": marker, "seconds": seconds}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_the_installed_package_is_the_one_that_ran_and_its_requirements_hold(installed_run):
    venv, env, work = installed_run["venv"], installed_run["env"], installed_run["work"]
    where = step([str(installed_run["python"]), "-c", "import detached_rl; print(detached_rl.__file__)"],
                 work, env, 120).stdout.strip()
    assert Path(where).is_relative_to(venv / "lib"), where  # site-packages, not the checkout
    step([str(installed_run["python"]), "-m", "pip", "check"], work, env, 300)


def test_the_installed_package_ships_and_builds_the_bind_shim_of_detached_rl_node(installed_run):
    """`detached-rl node` needs bind_shim.c (package data): the installed package builds it."""
    work, env = installed_run["work"], installed_run["env"]
    built = step([str(installed_run["python"]), "-c", "import sys; from pathlib import Path; "
                  "from detached_rl.node import build_bind_shim; print(build_bind_shim(Path(sys.argv[1])))",
                  str(work / "shim")], work, env, 180).stdout.strip()
    assert Path(built).is_file() and Path(built).parent == work / "shim", built


def test_the_job_reports_and_writes_config_metrics_and_results(installed_run):
    directory, stdout = installed_run["directory"], installed_run["stdout"]
    assert "held-out before training: accuracy" in stdout and "held-out after training: accuracy" in stdout
    assert f"{STEPS} steps" in stdout and "not written" not in stdout
    assert "grpo" in (directory / "config.yaml").read_text()
    rows = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    training = [row for row in rows if row.get("kind") != "eval"]
    assert [row["step"] for row in training] == list(range(1, STEPS + 1))
    assert all("reward/mean" in row for row in training)
    # the held-out evaluations are rows too: before (step 0) and after (the last step)
    evaluations = [row for row in rows if row.get("kind") == "eval"]
    assert [(row["step"], row["eval/label"]) for row in evaluations] == [(0, "before training"),
                                                                          (STEPS, "after training")]
    evaluation = json.loads((directory / "eval.json").read_text())
    assert len(evaluation["before"]) == len(evaluation["after"]) == 4
    assert {r["policy_version"] for r in evaluation["after"]} == {STEPS}
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert set(summary["files"]) == {"adapter", "merged", "metrics", "plot", "tensorboard"}


def test_the_plot_and_tensorboard_events_are_written_without_extras(installed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory = installed_run["directory"]
    # Every row carries reward/mean and GRPO reports response_length/mean: both panels draw their series.
    panels = plotted_panels(directory / "metrics.png")
    assert panels[0] and panels[2], panels
    events = EventAccumulator(str(directory / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == list(range(1, STEPS + 1))


def test_the_adapter_and_the_merged_model_are_exported(installed_run):
    from safetensors import safe_open

    directory = installed_run["directory"]
    adapter = json.loads((directory / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 16
    with safe_open(directory / "adapter" / "adapter_model.safetensors", "pt") as weights:
        adapter_tensors = weights.keys()
    assert any("lora_A" in name for name in adapter_tensors)
    merged = json.loads((directory / "merged" / "config.json").read_text())
    assert merged["model_type"] == "llama"
    with safe_open(directory / "merged" / "model.safetensors", "pt") as weights:
        merged_tensors = weights.keys()
    assert merged_tensors and not any("lora" in name for name in merged_tensors)


def test_the_job_leaves_no_process_behind(installed_run):
    deadline = time.monotonic() + 60  # the job has exited; a loaded machine may take a while to reap
    while (left_over := marked_processes(installed_run["marker"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left_over == []
