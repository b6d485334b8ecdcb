"""Shared fixtures: one local Ray cluster per test module that asks for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Keep Ray quiet and self-contained: no token auth prompts from a stray ~/.ray/auth_token,
# no dashboard, no usage stats.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster shared by one test module, shut down after it."""
    import ray

    ray.init(
        num_cpus=8,  # logical slots: actors here are mostly idle or single-threaded
        include_dashboard=False,
        namespace="detached_rl_tests",
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}},
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()
