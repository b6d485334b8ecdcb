"""Shared fixtures: one local Ray cluster per test module that asks for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Keep Ray quiet and self-contained: no token auth prompts from a stray ~/.ray/auth_token,
# no dashboard, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # lets a local cluster bind to 127.0.0.1
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster shared by one test module, shut down after it."""
    import ray

    from detached_rl.cli.jobs import init_local_ray

    init_local_ray(
        "detached_rl_tests",
        num_cpus=8,  # logical slots: actors here are mostly idle or single-threaded
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()
