"""The local Ray cluster that the test modules asking for `ray_cluster` share (tests/conftest.py): started by
the first, handed to the next with what the one before left (named actors, placement groups) removed, and
ended before a test that does not ask for it (it may start a driver of its own) and at the end of the session.

A module that kills actors but not nodes shares it; one that kills nodes or needs other settings starts its
own cluster (tests/test_takeover_cluster.py, tests/test_resources_ray.py). conftest orders the sharing modules
one after another, so the cluster starts once in `make test`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

NAMESPACE = "detached_rl_tests"
CLEAR_TIMEOUT_S = 60.0


class SharedCluster:
    """One local Ray cluster at a time, bound to loopback, its processes carrying `marker`."""

    def __init__(self, root: Path, marker_variable: str, new_marker: Callable[[], str]) -> None:
        self.root = root
        self.marker_variable = marker_variable
        self.new_marker = new_marker  # a fresh marker value for each start
        self.marker: str | None = None  # set while it runs

    @property
    def running(self) -> bool:
        """Whether this process's driver is connected to the shared cluster."""
        return self.marker is not None

    def acquire(self) -> ModuleType:
        """The `ray` module, connected to the running cluster (cleared of the last module's actors and
        placement groups) or to one started now whose processes carry a fresh marker."""
        import ray

        if self.running and ray.is_initialized():
            clear(ray)
        else:
            self.end()
            self._start(self.new_marker())
        return ray

    def _start(self, marker: str) -> None:
        from detached_rl.cli.jobs import init_local_ray

        previous = os.environ.get(self.marker_variable)
        os.environ[self.marker_variable] = marker  # inherited by the GCS, the raylet and their workers
        try:
            init_local_ray(
                NAMESPACE,
                num_cpus=8,  # logical slots: actors here are mostly idle or single-threaded
                include_dashboard=False,
                runtime_env={"env_vars": {"PYTHONPATH": str(self.root), "OMP_NUM_THREADS": "1"}},
                log_to_driver=False,
            )
        finally:
            if previous is None:
                os.environ.pop(self.marker_variable, None)
            else:
                os.environ[self.marker_variable] = previous
        self.marker = marker

    def end(self) -> None:
        """Shut the cluster down, if it runs."""
        if self.marker is None:
            return
        import ray

        self.marker = None
        ray.shutdown()


def clear(ray: ModuleType) -> None:
    """Kill every named actor of every namespace and remove every placement group still held: what one
    module left must not fill the next one's slots or answer to its names."""
    from ray.util.placement_group import PlacementGroup

    for actor in ray.util.list_named_actors(all_namespaces=True):
        with contextlib.suppress(ValueError):  # gone meanwhile
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    deadline = time.monotonic() + CLEAR_TIMEOUT_S
    while (left := ray.util.list_named_actors(all_namespaces=True)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"the shared cluster's actors outlived ray.kill for {CLEAR_TIMEOUT_S} s: {left}"
    for group_id, row in ray.util.placement_group_table().items():
        if row["state"] != "REMOVED":
            with contextlib.suppress(Exception):  # removed meanwhile
                ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))
