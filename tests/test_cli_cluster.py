"""The CLI against a real `ray start --head` cluster on loopback: separate processes attach only by name.

What the tests assert on comes from `detached-rl` commands; the waits in between poll through one driver, this
test process's (`cluster`), not a new `detached-rl` process per poll."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from detached_rl.cli.inspection import all_status, inspect
from detached_rl.core.checkpoint import load_state

from .conftest import CLUSTER_MARKER, ROOT, new_cluster_marker, stop_marked
from .helpers import gpu_overrides, set_flags, wait_for

pytestmark = pytest.mark.ray

BIN = Path(sys.executable).parent
# Sized for 2 loaded cores, where one Ray client join (the head starts a server process for it) has taken
# over 120 s: every CLI call may join for this long, and gets this much more to do its work.
CONNECT_TIMEOUT_S = 300
COMMAND_TIMEOUT_S = CONNECT_TIMEOUT_S + 180
CONFIG = """
namespace: cli_test
model: {policy: tiny}
task: {train_size: 32}
sampling: {max_new_tokens: 6}
maker: {experience_batch_size: 4}
trainer: {train_batch_size: 8, batch_timeout_s: 120}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """A head node bound to 127.0.0.1 in a temporary directory; torn down by PID, its own processes only
    (they carry a fresh `CLUSTER_MARKER`, another cluster on the machine does not)."""
    directory = tempfile.mkdtemp(prefix="drl-", dir="/tmp")  # short: Ray's socket paths have a length limit
    marker = new_cluster_marker()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), CLUSTER_MARKER: marker,
           "DETACHED_RL_CONNECT_TIMEOUT_S": str(CONNECT_TIMEOUT_S),
           # On 2 busy cores the per-client server of the Ray client can take longer than the default 30 s; a
           # third of the join's budget leaves `connect` two more tries when one server never comes up.
           "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": str(CONNECT_TIMEOUT_S // 3)}
    port, client_port = free_port(), free_port()
    subprocess.run(
        [str(BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
         f"--ray-client-server-port={client_port}", f"--temp-dir={directory}", "--include-dashboard=false",
         "--num-cpus=6", "--disable-usage-stats"],
        env=env, check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S,
    )
    import ray

    try:
        ray.init(address=f"127.0.0.1:{port}", namespace="cli_test", log_to_driver=False)
        yield {"address": f"127.0.0.1:{port}", "client": f"ray://127.0.0.1:{client_port}", "env": env,
               "directory": directory}
    finally:
        ray.shutdown()
        stop_marked(marker)
        shutil.rmtree(directory, ignore_errors=True)


def cli(cluster, *args, timeout=COMMAND_TIMEOUT_S, check=True):
    result = subprocess.run([str(BIN / "detached-rl"), *args], env=cluster["env"], capture_output=True,
                            text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"detached-rl {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def test_separate_jobs_attach_by_name_inspect_from_a_client_and_stop(cluster, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    address = ["--address", cluster["address"]]
    # The maker starts first: it waits for its trainer by name.
    gpus = set_flags(gpu_overrides())  # GPU shares with --device cuda
    out = cli(cluster, "maker", "--config", str(config), "--name", "maker_0", "--trainers", "trainer_0",
              *address,
              *gpus)
    assert "maker 'maker_0' started" in out.stdout
    assert "no trainer named 'trainer_0' is running in namespace 'cli_test' yet" in out.stderr
    out = cli(cluster, "trainer", "--config", str(config), "--name", "trainer_0", "--steps", "100000",
              *address,
              *gpus)
    assert "trainer 'trainer_0' started" in out.stdout

    # Both outlive the processes that started them. Wait on the direct address (the Ray client's turn comes
    # below, once the machine is quiet: each client join makes the head start a server process of its own).
    wait_for(lambda: inspect("trainer_0", "cli_test", 3, None, None)["stats"]["sampled"] >= 16,
             "16 samples trained", 300, 1.0)
    deadline = time.monotonic() + 120
    while True:
        report = json.loads(cli(cluster, "inspect", "trainer_0", "--json", "--last", "3", *address,
                                "--namespace", "cli_test").stdout)
        # Makers are paced to what the trainer can use: wait for a moment the buffer holds samples too.
        if len(report["samples"]) == 3 or time.monotonic() > deadline:
            break
        time.sleep(1)
    stats = report["stats"]
    assert stats["sampled"] >= 16 and stats["accounting_ok"] and "maker_0" in stats["per_maker"]
    assert len(report["samples"]) == 3 and all(s["response_text"] is not None for s in report["samples"])

    # Exported while the maker feeds the buffer (the call below ends that).
    # Makers are paced to what the trainer can use, so its buffer may be empty at a given moment: export again
    # until it held something.
    exported = tmp_path / "buffer.jsonl"
    deadline = time.monotonic() + 120
    while True:
        cli(cluster, "export", "trainer_0", str(exported), *address, "--namespace", "cli_test")
        rows = [json.loads(line) for line in exported.read_text().splitlines()]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(1)
    if not rows:  # say why: the trainer's and the maker's own account (CI once saw an empty buffer for 120 s)
        status = cli(cluster, "status", "--json", *address, "--namespace", "cli_test").stdout
        stats = json.loads(cli(cluster, "inspect", "trainer_0", "--json", *address,
                               "--namespace", "cli_test").stdout)["stats"]
        pytest.fail(f"the buffer held nothing for 120 s; status: {status[-3000:]}; buffer: {stats}")
    assert {"prompt_ids", "response_ids", "log_probs", "policy_version", "response_text"} <= set(rows[0])

    # Inspection answers while the trainer's compute group runs a long call: another driver ends the
    # background training (`start_fit` runs it in a thread of its own) and calls `fit` itself, then exits at
    # once: the call goes on in the detached actor. Its maker was stopped with the first fit, so this one
    # trains on what is buffered and then waits for a batch (trainer.batch_timeout_s =
    # 120 s), all in `compute`.
    refit = ("import ray, time; ray.init(address='{address}', namespace='cli_test', log_to_driver=False); "
             "trainer = ray.get_actor('trainer_0'); ray.get(trainer.stop.remote(), timeout=60); "
             "deadline = time.monotonic() + 60\n"
             "while ray.get(trainer.status.remote(), timeout=60)['state'] == 'training':\n"
             "    assert time.monotonic() < deadline, 'the background fit did not stop'; time.sleep(0.2)\n"
             "trainer.fit.remote(100000); time.sleep(1)")
    subprocess.run([sys.executable, "-c", refit.format(address=cluster["address"])], env=cluster["env"],
                   check=True, timeout=120, capture_output=True)
    # The fit never ends (100000 steps, no maker): had status or inspect queued behind it, they would
    # time out; they answer, and report the trainer still training.
    status = json.loads(cli(cluster, "status", "--json", *address, "--namespace", "cli_test").stdout)
    inspected = cli(cluster, "inspect", "trainer_0", *address, "--namespace", "cli_test")
    roles = {row["name"]: row for row in status}
    assert roles["trainer_0"]["role"] == "trainer" and roles["trainer_0"]["state"] == "training"
    assert roles["maker_0"]["role"] == "maker" and roles["maker_0"]["policy_version"] >= 1
    assert "staleness" in inspected.stdout and "maker_0" in inspected.stdout

    # The same trainer, inspected through the Ray client from outside the cluster (its fit still runs, and
    # may have trained on what was buffered: the counts only grow).
    report = json.loads(cli(cluster, "inspect", "trainer_0", "--json", "--last", "3",
                            "--address", cluster["client"], "--namespace", "cli_test").stdout)
    assert report["stats"]["sampled"] >= stats["sampled"] and report["stats"]["accounting_ok"]
    assert "maker_0" in report["stats"]["per_maker"]
    assert all(s["response_text"] is not None for s in report["samples"])

    out = cli(cluster, "stop", *address, "--namespace", "cli_test", "--timeout", "60")
    assert "maker_0" in out.stdout and "trainer_0" in out.stdout
    assert "no detached-rl actors" in cli(cluster, "status", *address, "--namespace", "cli_test").stdout


def placement_groups() -> dict[str, str]:
    """The cluster's placement groups' states by name."""
    import ray

    return {table["name"]: table["state"] for table in ray.util.placement_group_table().values()}


def test_a_two_rank_ddp_trainer_group_from_the_cli_starts_and_stops_with_its_placement_group(
        cluster, tmp_path):
    """The trainer job's `--world-size 2`: both ranks placed in the group's placement group, named in
    `status`, stopped with it. The ranks' training is tests/test_run_group.py's (the same launch path under
    `run`) and tests/test_actors_ray.py's (two makers feeding the group)."""
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    address = ["--address", cluster["address"]]
    out = cli(cluster, "trainer", "--config", str(config), "--name", "grp", "--world-size", "2", "--strategy",
              "ddp", "--steps", "2", *address)
    assert "ranks grp_0, grp_1 (ddp, PACK" in out.stdout
    rows = {r["name"]: r for r in json.loads(cli(cluster, "status", "--json", *address,
                                                 "--namespace", "cli_test").stdout)}
    ranks = [rows.get("grp_0", {}), rows.get("grp_1", {})]
    assert [(r.get("rank"), r.get("world_size"), r.get("policy_version")) for r in ranks] == [(0, 2, 0),
                                                                                             (1, 2, 0)], rows
    assert placement_groups()["grp-placement"] == "CREATED"

    out = cli(cluster, "stop", *address, "--namespace", "cli_test", "--timeout", "60")
    assert {"grp_0", "grp_1"} <= set(out.stdout.replace(",", " ").split())
    # asked together, the ranks (which step together) drain: none is left to the deadline and killed
    assert "still running after" not in out.stderr and "did not" not in out.stderr, out.stderr
    assert placement_groups()["grp-placement"] == "REMOVED"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "nobody"], "no actor named 'nobody'"),
        (["trainer", "--name", "t", "--set", "trainer.train_batch_size=oops"], "trainer.train_batch_size"),
        (["maker", "--name", "m", "--trainers", "t", "--set", "maker.bogus=1"], "maker.bogus: unknown key"),
        (["trainer", "--name", "t", "--world-size", "2"],
         "trainer_group.world_size: must be 1 with strategy 'naive'"),
        (["trainer", "--name", "z", "--world-size", "2", "--strategy", "colossalai_zero2", "--set",
          "model.policy=tiny"], "strategy 'colossalai_zero2' needs CUDA GPUs"),
        (["status", "--address", "127.0.0.1:1"], "cannot reach a Ray cluster at 127.0.0.1:1"),
        (["status", "--address", "ray://127.0.0.1:1"], "cannot reach a Ray cluster at ray://127.0.0.1:1"),
    ],
)
def test_errors_are_one_line_without_traceback(cluster, args, message):
    if "--address" not in args:
        args = [*args, "--address", cluster["address"]]
    result = cli(cluster, *args, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr


def _status_rows(cluster) -> dict:
    """`detached-rl status --json`'s rows by name, read through this test's driver (the same function)."""
    return {row["name"]: row for row in all_status("cli_test")}


def _wait_rows(cluster, predicate, what: str, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        rows = _status_rows(cluster)
        if predicate(rows):
            return rows
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {rows}"
        time.sleep(3)


# Steps the resumed trainer trains: enough to show it trains on with the maker that fed the first one (each
# step's batch comes from it), not so many that the test spends its time training.
RESUMED_STEPS = 4


def test_a_trainer_job_killed_and_resumed_from_its_checkpoint_trains_on_with_the_maker_that_fed_it(
        cluster, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    checkpoints = str(tmp_path / "checkpoints")
    address = ["--address", cluster["address"]]
    gpus = set_flags(gpu_overrides())
    trainer_job = ["trainer", "--config", str(config), "--name", "resumed", "--checkpoint-every", "2",
                   "--checkpoint-dir", checkpoints, *address, *gpus]
    cli(cluster, "maker", "--config", str(config), "--name", "feeder", "--trainers", "resumed", *address,
        *gpus)
    cli(cluster, *trainer_job, "--steps", "100000")
    rows = _wait_rows(cluster, lambda r: r.get("resumed", {}).get("policy_version", 0) >= 4,
                      "4 training steps")
    os.kill(rows["resumed"]["pid"], signal.SIGKILL)  # the trainer's worker process, of this test's cluster
    _wait_rows(cluster, lambda r: r.get("resumed", {}).get("state") == "dead",
               "the trainer to be reported dead")

    # The same job again, resumed; the maker job that fed the first one is still running and attached.
    resumed_at = load_state(Path(checkpoints) / "rank_0")["policy_version"]
    assert resumed_at >= 2
    out = cli(cluster, *trainer_job, "--steps", str(resumed_at + RESUMED_STEPS), "--resume-from", checkpoints)
    assert "trainer 'resumed' started" in out.stdout
    rows = _wait_rows(cluster, lambda r: r["resumed"]["state"] in ("done", "failed"), "the resumed trainer")
    trainer, maker = rows["resumed"], rows["feeder"]
    assert trainer["state"] == "done" and trainer["policy_version"] == resumed_at + RESUMED_STEPS, \
        trainer["last_error"]
    import ray

    history = ray.get(ray.get_actor("resumed", namespace="cli_test").metrics.remote(), timeout=60)
    # It picked up from the first trainer's checkpoint (not from scratch) and trained on with the same maker.
    resumed_steps = range(resumed_at + 1, resumed_at + RESUMED_STEPS + 1)
    assert [m["policy_version"] for m in history] == list(resumed_steps)
    assert not maker["restarted"] and maker["trainer_run"] == trainer["trainer_run"]
    cli(cluster, "stop", *address, "--namespace", "cli_test", "--timeout", "60")
