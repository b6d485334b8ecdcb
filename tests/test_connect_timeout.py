"""`jobs.connect` waits at most `$DETACHED_RL_CONNECT_TIMEOUT_S` (default 120 s) to join a cluster."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from detached_rl.cli import jobs
from tests.conftest import ROOT


def test_the_default_and_the_variable_set_the_connect_timeout(monkeypatch):
    monkeypatch.delenv(jobs.CONNECT_TIMEOUT_VARIABLE, raising=False)
    assert jobs.connect_timeout() == jobs.DEFAULT_CONNECT_TIMEOUT == 120.0
    monkeypatch.setenv(jobs.CONNECT_TIMEOUT_VARIABLE, " 600 ")
    assert jobs.connect_timeout() == 600.0


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf"])
def test_a_bad_timeout_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(jobs.CONNECT_TIMEOUT_VARIABLE, value)
    with pytest.raises(jobs.JobError, match=f"{jobs.CONNECT_TIMEOUT_VARIABLE}='{value}'"):
        jobs.connect("127.0.0.1:1", "anything")


def test_a_join_that_never_completes_ends_after_the_variables_timeout():
    """A port that accepts connections but is no Ray cluster: the join hangs inside Ray, and the CLI gives up
    after the 4 s the variable allows, with one line naming the variable (not after the default 120 s)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        env = {**os.environ, jobs.CONNECT_TIMEOUT_VARIABLE: "4", "PYTHONPATH": str(ROOT),
               "RAY_AUTH_MODE": "disabled"}
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "detached_rl.cli.main", "status", "--address", address],
                              env=env, capture_output=True, text=True, timeout=110)
        elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    assert f"could not join the Ray cluster at {address} within 4 s" in done.stderr
    assert jobs.CONNECT_TIMEOUT_VARIABLE in done.stderr
    assert elapsed < 100, f"took {elapsed:.0f} s: the variable's 4 s did not apply"
