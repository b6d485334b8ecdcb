"""Joining a `ray start` cluster with token auth on: the right token joins, a wrong one is refused by Ray.

A whole `detached-rl run` on a token-auth cluster is tests/test_run_job.py (its embedded cluster has token
auth on).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .conftest import CLUSTER_MARKER, ROOT, marked_processes, new_cluster_marker
from .test_cli_cluster import free_port

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def token_cluster():
    """A head node on 127.0.0.1 started with RAY_AUTH_MODE=token; its address and the
    environment with the token."""
    # short: Ray's socket paths have a length limit
    directory = tempfile.mkdtemp(prefix="drl-tok-", dir="/tmp")
    marker = new_cluster_marker()
    token = secrets.token_hex(32)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": token,
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), CLUSTER_MARKER: marker, "HOME": directory}
    port = free_port()
    subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         f"--temp-dir={directory}", "--include-dashboard=false", "--num-cpus=6", "--disable-usage-stats"],
        env=env, check=True, capture_output=True, timeout=TIMEOUT_S,
    )
    try:
        yield f"127.0.0.1:{port}", env
    finally:
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)
        for proc in marked_processes(marker):
            proc.kill()


def detached_rl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """Run the console entry point with `env`."""
    return subprocess.run([sys.executable, "-m", "detached_rl.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, cwd=ROOT)


def test_a_wrong_token_is_refused_by_ray(token_cluster):
    address, env = token_cluster
    # Ray retries a refused join for about 30 s; the connect timeout ends it sooner, naming the token too.
    wrong = {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32), "DETACHED_RL_CONNECT_TIMEOUT_S": "8"}
    done = detached_rl(wrong, "status", "--address", address, "--namespace", "token_auth_test")
    assert done.returncode == 2
    assert "InvalidAuthToken" in done.stderr and "RAY_AUTH_TOKEN" in done.stderr.splitlines()[-1]
    right = detached_rl({**env, "DETACHED_RL_CONNECT_TIMEOUT_S": "120"}, "status", "--address", address,
                        "--namespace", "token_auth_test")
    assert right.returncode in (0, 1), right.stderr[-2000:]  # 1: nothing running in the namespace any more
