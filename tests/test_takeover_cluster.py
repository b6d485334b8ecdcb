"""A maker's node is lost and a maker job takes its name over, on a `ray.cluster_utils.Cluster` of local
nodes (`make test`'s cheap form of tests/test_multihost_faults.py, whose real hosts, outages and node death
run in `make test-e2e`).

The trainer job and two maker jobs are typed as a user types them (`detached-rl trainer`, `detached-rl
maker`, each placed on the node that offers its resource); one maker's node is removed: the trainer trains on
with the other and reports the lost one while Ray restarts it; a new maker job under its name removes the
restarting actor, waits for a node, and once one joins it serves the trainer, which no longer reports it
lost.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import CLUSTER_MARKER, ROOT, new_cluster_marker, stop_marked
from .deadlines import scaled
from .helpers import wait_for

pytestmark = pytest.mark.ray

NAMESPACE = "takeover_test"
BIN = Path(sys.executable).parent
CONFIG = str(ROOT / "examples" / "jobs" / "tiny.yaml")
MAKER = ["--set", "maker.resources={maker_host: 1}"]
# Ray's health checks declare a removed node dead after `failure_threshold` missed checks (by default 5 every
# 3 s: 15 s); a weight push to the maker then fails and the trainer names it lost. Checked every second here:
# a removed node's raylet refuses at once, a live one answers within the default 10 s timeout even on a busy
# box. Generous bounds: the box may be 2x slower and busy.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}
LOST_WITHIN_S = 240
JOB_TIMEOUT_S = 480


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    """A head (the trainer's node, `trainer_host`) and a maker node (`maker_host`) on 127.0.0.1; every
    process it starts carries a fresh `CLUSTER_MARKER` and is ended by it."""
    import ray
    from ray.cluster_utils import Cluster

    marker = new_cluster_marker()
    previous = os.environ.get(CLUSTER_MARKER)
    os.environ[CLUSTER_MARKER] = marker
    temp = tempfile.mkdtemp(prefix="drl-", dir="/tmp")  # short: Ray's socket paths have a length limit
    try:
        simulated = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "resources": {"trainer_host": 1}, "include_dashboard": False,
            "node_ip_address": "127.0.0.1", "temp_dir": temp, "_system_config": HEALTH_CHECKS})
        # the node of the maker that stays: it too offers maker_host, which its maker holds, so a maker job
        # asking for maker_host while the other node is gone can be placed later (not refused at once)
        local = "127.0.0.1"
        simulated.add_node(num_cpus=2, resources={"maker_host": 1, "steady_host": 1}, node_ip_address=local)
        maker_node = simulated.add_node(num_cpus=2, resources={"maker_host": 1}, node_ip_address=local)
        simulated.wait_for_nodes()
    finally:
        if previous is None:
            os.environ.pop(CLUSTER_MARKER, None)
        else:
            os.environ[CLUSTER_MARKER] = previous
    env = {**os.environ, CLUSTER_MARKER: marker, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    ray.init(address=simulated.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield {"cluster": simulated, "maker_node": maker_node, "env": env, "address": simulated.address}
    finally:
        ray.shutdown()
        simulated.shutdown()
        stop_marked(marker)
        shutil.rmtree(temp, ignore_errors=True)


def job(cluster: dict[str, Any], *args: str) -> subprocess.Popen:
    """`detached-rl <args>` against the cluster, as a user types it (the tiny config, this namespace)."""
    command = [str(BIN / "detached-rl"), *args, "--address", cluster["address"], "--config", CONFIG,
               "--set", f"namespace={NAMESPACE}"]
    return subprocess.Popen(command, env=cluster["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def finished(process: subprocess.Popen) -> str:
    """The output of a job that must exit 0."""
    output, _ = process.communicate(timeout=JOB_TIMEOUT_S)
    assert process.returncode == 0, output[-4000:]
    return output


def status(name: str) -> dict[str, Any]:
    """`name`'s status, asked through this test's driver."""
    import ray

    return ray.get(ray.get_actor(name, namespace=NAMESPACE).status.remote(), timeout=60)


def maker_rows() -> list[Any]:
    """The actor table's rows of the maker `m` (the table `detached-rl` reads to place and take over)."""
    from detached_rl.cli.placing import actor_rows

    return [row for row in actor_rows(NAMESPACE) or [] if row.name == "m"]


def waited(what: str, condition: Any, timeout: float) -> Any:
    """`condition()`'s first true value, polled every second; fails naming `what` after `timeout` s on the
    idle reference box, scaled to this machine (`tests/deadlines.py`)."""
    return wait_for(condition, what, scaled(timeout), 1.0)


def test_a_maker_job_takes_over_the_name_of_a_maker_lost_with_its_node(cluster: dict[str, Any]) -> None:
    finished(job(cluster, "trainer", "--name", "t", "--steps", "100000",
                 "--set", "trainer_group.resources={trainer_host: 1}"))
    # the maker that keeps the trainer training (and pushing weights, which finds m lost) while m is gone;
    # first, so that m takes the other node's maker_host
    finished(job(cluster, "maker", "--name", "k", "--trainers", "t",
                 "--set", "maker.resources={maker_host: 1, steady_host: 1}"))
    finished(job(cluster, "maker", "--name", "m", "--trainers", "t", *MAKER))
    first = waited("the maker's first batch", lambda: (row := status("m"))["batches"] > 0 and row, 300)
    waited("two training steps", lambda: status("t")["steps"] >= 2, 300)

    cluster["cluster"].remove_node(cluster["maker_node"], allow_graceful=False)
    lost = waited("the trainer reports m lost", lambda: status("t")["makers_lost"].get("m"), LOST_WITHIN_S)
    print(f"m lost: {lost}")
    assert status("t")["state"] == "training"

    # Once Ray has declared the node dead it restarts m (and `detached-rl status` says so); no node offers
    # maker_host now: a maker job under m's name removes the restarting m and waits to be placed.
    waited("Ray restarts m", lambda: any(row.state == "RESTARTING" for row in maker_rows()), LOST_WITHIN_S)
    takeover = job(cluster, "maker", "--name", "m", "--trainers", "t", *MAKER)

    def new_m_waits() -> bool:
        assert takeover.poll() is None, takeover.communicate()[0][-4000:]  # it waits to be placed
        return any(row.state == "PENDING_CREATION" for row in maker_rows())

    waited("the new m waits for a node", new_m_waits, JOB_TIMEOUT_S)
    cluster["cluster"].add_node(num_cpus=2, resources={"maker_host": 1}, node_ip_address="127.0.0.1")
    output = finished(takeover)
    assert "takes its name over" in output, output[-4000:]
    steps = status("t")["steps"]
    served = waited("the new m's first batch", lambda: (row := status("m"))["batches"] > 0 and row, 300)
    assert not served["restarted"] and served["pid"] != first["pid"]
    waited("the trainer no longer reports m lost", lambda: "m" not in status("t")["makers_lost"], 120)
    waited("the trainer trains on with the new m", lambda: status("t")["steps"] > steps, 300)

    stop = [str(BIN / "detached-rl"), "stop", "--address", cluster["address"], "--namespace", NAMESPACE,
            "--timeout", "60"]
    stopped = subprocess.run(stop, env=cluster["env"], capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert stopped.returncode == 0, stopped.stderr
    assert {"k", "m", "t"} <= set(stopped.stdout.replace(",", " ").split()), stopped.stdout
