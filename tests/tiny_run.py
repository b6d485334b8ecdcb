"""One tiny `detached-rl run`, typed as a user types it, that several test modules read
(tests/test_run_job.py checks its artefacts and sockets, tests/test_determinism.py runs it once more and
compares): the settings that make it repeatable bit for bit and still train something.

One maker, `maker.seed`, `trainer.max_staleness=0`, the addition task with 24-token answers: the tiny random
model writes a number in most answers, so the steps have non-zero gradients (the word problems' answers would
all score 0 and train nothing). Two makers under `run` are tests/test_run_maker_kill.py's.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import CLUSTER_MARKER, new_cluster_marker
from tests.helpers import gpu_overrides, set_flags
from tests.test_run_sockets import console_script, plain_environment, stop_tree, watch_sockets

STEPS = 4
EVAL_EVERY = 2
EVAL_SIZE = 16
NAME = "tiny-test"
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class TinyRun:
    """A finished run: its directory, its output, the `CLUSTER_MARKER` every process it started carries, and
    every socket its processes listened on while it ran ((kind, address, port) -> process name)."""

    directory: Path
    stdout: str
    marker: str
    sockets: dict[tuple[str, str, int], str]


def command(output: Path) -> list[str]:
    """The console script's command line of the tiny run, writing to `output`/NAME."""
    return [*console_script(), "run", "--model", "tiny", "--steps", str(STEPS), "--makers", "1",
            "--name", NAME, "--output", str(output), "--namespace", "detached_rl_run_test",
            "--set", "maker.seed=0", "--set", "trainer.max_staleness=0", "--set", "task.name=addition",
            "--set", "sampling.max_new_tokens=24", "--set", f"task.eval_size={EVAL_SIZE}",
            "--set", f"run.eval_every={EVAL_EVERY}", "--set", "run.poll_interval_s=0.2",
            *set_flags(gpu_overrides(run_command=True))]  # GPU shares with --device cuda


def run_tiny_job(output: Path, home: Path) -> TinyRun:
    """Run the console script once from a plain shell (its own embedded Ray cluster, none of the suite's
    settings) on a token-auth cluster (driver, GCS, raylet and every actor), following its sockets; fails
    with its output unless it exits 0. The marker is inert to Ray: it only lets the tests find the run's
    processes."""
    marker = new_cluster_marker()
    env = {**plain_environment(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           CLUSTER_MARKER: marker}
    output.mkdir(parents=True, exist_ok=True)
    home.mkdir(parents=True, exist_ok=True)
    log, errors = output / "run.out", output / "run.err"
    with log.open("w") as out, errors.open("w") as err:
        run = subprocess.Popen(command(output), env=env, cwd=home, stdout=out, stderr=err,
                               start_new_session=True)
    seen: dict = {}
    sockets: dict = {}
    try:
        seen, sockets = watch_sockets(run, timeout=RUN_TIMEOUT_S)
    finally:
        # Timed out (or the watch failed): end it. A finished run's leftovers are for the tests to find.
        if run.poll() is None:
            stop_tree(run, seen)
    stdout = log.read_text(errors="replace")
    assert run.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{errors.read_text(errors='replace')[-4000:]}"
    return TinyRun(output / NAME, stdout, marker, sockets)
