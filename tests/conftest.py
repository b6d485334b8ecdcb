"""Shared fixtures: one local Ray cluster per test module that asks for it."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Set to a fresh value in the environment of every Ray cluster or job a test starts: their processes (GCS,
# raylet, workers, client servers) inherit it, so a test counts and ends only its own, never another
# cluster's on the same machine (a CI box may run several).
CLUSTER_MARKER = "DETACHED_RL_TEST_CLUSTER"

# Keep Ray quiet and self-contained: no token auth prompts from a stray ~/.ray/auth_token,
# no dashboard, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # lets a local cluster bind to 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def new_cluster_marker() -> str:
    """A value for `CLUSTER_MARKER` that no other cluster on this machine carries."""
    return uuid.uuid4().hex


def marked_processes(marker: str) -> list[psutil.Process]:
    """Live processes (other than this one) whose environment has `CLUSTER_MARKER=marker`."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        with contextlib.suppress(psutil.Error):  # gone, a zombie, or not ours to read
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(CLUSTER_MARKER) == marker:
                found.append(proc)
    return found


@pytest.fixture(scope="module")
def cluster_marker() -> str:
    """The `CLUSTER_MARKER` value of this module's cluster."""
    return new_cluster_marker()


@pytest.fixture(scope="module")
def ray_cluster(cluster_marker):
    """A local Ray cluster shared by one test module, shut down after it; its processes carry `cluster_marker`."""
    import ray

    from detached_rl.cli.jobs import init_local_ray

    marker = cluster_marker
    previous = os.environ.get(CLUSTER_MARKER)
    os.environ[CLUSTER_MARKER] = marker  # inherited by the GCS and raylet this starts, and by their workers
    try:
        init_local_ray(
            "detached_rl_tests",
            num_cpus=8,  # logical slots: actors here are mostly idle or single-threaded
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
            log_to_driver=False,
        )
    finally:
        if previous is None:
            os.environ.pop(CLUSTER_MARKER, None)
        else:
            os.environ[CLUSTER_MARKER] = previous
    yield ray
    ray.shutdown()
