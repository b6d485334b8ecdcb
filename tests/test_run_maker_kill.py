"""`detached-rl run` survives a maker SIGKILL: Ray restarts the maker from inline constructor arguments, it
re-attaches and takes the newest weights, and the run ends with its evaluation, summary and export."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from ray import cloudpickle

from detached_rl.actors.launch import INLINE_ARGUMENT_BYTES, check_inline_arguments, maker_arguments
from detached_rl.cli.run import run_config
from tests.conftest import CLUSTER_MARKER, ROOT, marked_processes, new_cluster_marker
from tests.helpers import gpu_overrides, set_flags

STEPS = 8
MAKER_PROCESS = "ray::MakerShell"  # the process title of a maker's worker


def test_every_maker_constructor_argument_travels_inline():
    """Over Ray's inlining limit an argument lives in the object store, and a
    restarted maker dies reading it."""
    config = run_config(model="tiny", makers=2)
    arguments = maker_arguments(config, "m-0", ["t"], shard=(1, 2), state_path="/tmp/state")
    for name, value in arguments.items():
        assert len(cloudpickle.dumps(value)) <= INLINE_ARGUMENT_BYTES, name
    # The maker builds its own prompt shard: the same prompts, in the same order, as the driver's.
    assert arguments["prompts"]().items == config.prompts(1, 2).items


def test_an_argument_over_the_inlining_limit_is_refused_naming_it():
    with pytest.raises(ValueError, match="constructor argument 'prompts' is .* bytes"):
        check_inline_arguments("maker 'm'", {"name": "m", "prompts": "x" * (INLINE_ARGUMENT_BYTES + 1)})


def maker_processes(marker: str) -> list[psutil.Process]:
    """The maker worker processes of the cluster carrying `marker`."""
    found = []
    for proc in marked_processes(marker):
        try:
            if proc.cmdline()[:1] and proc.cmdline()[0].startswith(MAKER_PROCESS):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.mark.ray
def test_run_survives_a_maker_killed_during_training(tmp_path):
    marker = new_cluster_marker()
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), CLUSTER_MARKER: marker}
    command = [sys.executable, "-m", "detached_rl.cli.main", "run", "--model", "tiny", "--steps", str(STEPS),
               "--name", "kill-test", "--output", str(tmp_path), "--namespace", "detached_rl_run_kill_test",
               "--set", "task.eval_size=8", "--set", "sampling.max_new_tokens=8", "--set", "run.examples=0",
               "--set", "run.progress=false", *set_flags(gpu_overrides(run_command=True))]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           cwd=ROOT)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(job.stdout), daemon=True)
    reader.start()
    killed = None
    try:
        # Training starts right after the evaluation before it: kill one maker then.
        deadline = time.monotonic() + 600
        while killed is None and job.poll() is None and time.monotonic() < deadline:
            if any("held-out before training" in line for line in output):
                makers = maker_processes(marker)
                if makers:
                    killed = makers[0].pid
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.1)
        job.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if job.poll() is None:
            job.kill()
        reader.join(timeout=10)
    text = "".join(output)
    assert killed is not None, text
    assert job.returncode == 0, text[-4000:]

    directory = tmp_path / "kill-test"
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["steps"] == STEPS
    makers = {row["name"]: row for row in summary["makers"]}
    # The killed maker came back (exactly one restarted), re-attached and took the newest weights; none died.
    assert sorted(row["restarted"] for row in makers.values()) == [False, True], makers
    assert all(row["state"] == "stopped" and row["policy_version"] == STEPS
               for row in makers.values()), makers
    evaluation = json.loads((directory / "eval.json").read_text())
    assert {r["policy_version"] for r in evaluation["after"]} == {STEPS}
    assert (directory / "adapter" / "adapter_config.json").is_file()
    assert (directory / "merged").is_dir()
    assert "issues/53727" not in text  # Ray's warning: a maker's constructor arguments in the object store
    left_over_deadline = time.monotonic() + 60
    while maker_processes(marker) and time.monotonic() < left_over_deadline:
        time.sleep(0.5)
    assert maker_processes(marker) == []
