"""Jobs across hosts: trainer and maker jobs placed by node labels and custom resources, `detached-rl run`
with its actors on other hosts than its driver, and what each of them keeps on which host.

Three hosts: h0 (the head, role=trainer, resource trainer_host), h1 (role=maker, resource maker_host; its
link shaped to 20 Mbit/s) and h2 (role=desk: a node where the user types; nothing is placed there). Each
host's /tmp/drl-hostfs is its own, so where a file lands shows on which host the code that wrote it ran.
Every node is started with plain `ray start` (Ray's own ports and binding, token auth on), as KubeRay or a
Slurm script starts one: the jobs need nothing of `detached-rl node` (tests/test_multihost_cli.py runs on
nodes it started).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from .helpers import assert_mismatch_gated
from .hosts import Hosts
from .multihost import hosts_fixture, tiny_config_path
from .test_your_task import example

pytestmark = [pytest.mark.multihost]

TRAINER, MAKER, DESK = 0, 1, 2
hosts = hosts_fixture(3, rates_mbit={MAKER: 20}, start_with="ray start",
                      resources={TRAINER: {"trainer_host": 1}, MAKER: {"maker_host": 1}},
                      labels={TRAINER: {"role": "trainer"}, MAKER: {"role": "maker"}, DESK: {"role": "desk"}})
HOME = "/tmp/drl-hostfs/home"  # every host's home: the same path, different files on each host
ON_TRAINER_HOST = "trainer_group.label_selector={role: trainer}"
ON_MAKER_HOST = "maker.label_selector={role: maker}"

# Polls the namespace's actors from inside the cluster until `trainer` ends (or the time is up): where each
# actor runs (its node's address), when a maker first served weights, and the trainer's last row.
WATCH = """
import json, sys, time, ray
from detached_rl.cli.inspection import all_status
address, namespace, trainer, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
ray.init(address=address, namespace=namespace, log_to_driver=False)
print("watching", flush=True)
start, seen = time.monotonic(), {"placement": {}, "first_update_s": None, "trainer": {}, "engines": {}}

def placements():
    # Ray's actor table: where each actor was placed (a dead actor keeps its last address, so a short run's
    # makers are found even when they came and went between two polls)
    for actor in ray._private.state.actors().values():
        if actor.get("Name") and actor["Address"]["IPAddress"]:
            seen["placement"][actor["Name"]] = actor["Address"]["IPAddress"]

while time.monotonic() - start < timeout:
    placements()
    rows = {row["name"]: row for row in all_status(namespace)}
    for name, row in rows.items():
        version = row.get("policy_version")
        if row.get("engine"):
            seen["engines"][name] = row["engine"]
        if (row.get("role") == "maker" and isinstance(version, int) and version >= 0
                and seen["first_update_s"] is None):
            seen["first_update_s"] = round(time.monotonic() - start, 1)
    if trainer not in rows and seen["trainer"]:
        break  # removed (a run's actors go when it ends): its last row stays
    seen["trainer"] = {k: v for k, v in rows.get(trainer, {}).items() if isinstance(v, (int, float, str))}
    if seen["trainer"].get("state") in ("done", "failed", "dead", "idle"):
        break
    time.sleep(1.0)
placements()
try:  # the trainer's per-step metrics and push counters, while its actor is there (a trainer job's stays)
    handle = ray.get_actor(trainer, namespace=namespace)
    rows = ray.get(handle.metrics.remote(), timeout=30)
    seen["weight_bytes"] = [row.get("weight_sync/bytes") for row in rows]
    seen["wire_bytes"] = [row.get("weight_sync/bytes/wire/bfloat16") for row in rows]
    seen["weight_push"] = ray.get(handle.status.remote(), timeout=30).get("weight_push")
    gated = ("mismatch/", "provenance/", "staleness/")
    seen["mismatch"] = [{k: v for k, v in row.items() if k.startswith(gated)} for row in rows]
except Exception as error:  # a run's trainer is gone by now
    seen["weight_bytes"], seen["wire_bytes"], seen["weight_push"] = [], [], repr(error)
print(json.dumps(seen))
"""


def watch(hosts: Hosts, trainer: str, timeout: float, namespace: str = "detached_rl",
          then: Callable[[], object] = lambda: None) -> dict:
    """Follow trainer `trainer` from the desk until it ends (`then` is called once the watch is connected):
    placement, first update, its last status row."""
    args = [sys.executable, "-c", WATCH, hosts.head_address, namespace, trainer, str(timeout)]
    watcher = hosts.popen(DESK, args)
    try:
        lines = []
        while not lines or lines[-1].strip() != "watching":
            lines.append(watcher.stdout.readline())
            assert lines[-1] or watcher.poll() is None, "".join(lines)[-3000:]
        then()
        out, _ = watcher.communicate(timeout=timeout + 120)
    finally:
        if watcher.poll() is None:
            watcher.kill()
    assert watcher.returncode == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def placed(seen: dict, expected: dict[str, int], hosts: Hosts) -> None:
    """Assert that each actor of `expected` (name -> host index) ran on that host."""
    found = {name: seen["placement"].get(name) for name in expected}
    assert found == {name: hosts.host(index).address for name, index in expected.items()}, seen


def exists(hosts: Hosts, index: int, path: str) -> bool:
    """Whether `path` exists on host `index`."""
    return hosts.run(index, ["test", "-e", path]).returncode == 0


def cli(hosts: Hosts, index: int, *args: str, timeout: float = 300.0, check: bool = True):
    """`detached-rl ...` typed on host `index` against the cluster's head."""
    return hosts.run(index, ["detached-rl", *args, "--address", hosts.head_address], timeout=timeout,
                     check=check)


# The user's task, written on the desk only: docs/your-task.md's reward module and data, verbatim, and a
# second reward (weight 0) that leaves a mark, with an answer it was handed, on the host where it grades.
MARKS = f"""
def leave_mark(prompts, completions, answer, **metadata):
    with open("{HOME}/graded-here", "a") as marks:
        marks.write(f"{{len(completions)}} {{answer[0]}}\\n")
    return [0.0] * len(completions)
"""
USER_TASK = ["--set", "task.dataset=questions.jsonl",
             "--set", "task.rewards=[{fn: my_rewards:score}, {fn: marks:leave_mark, weight: 0}]"]


def test_tiny_jobs_placed_by_labels_keep_checkpoints_and_state_on_their_hosts(hosts: Hosts) -> None:
    """Trainer and maker jobs typed on the desk run on the hosts their labels name, across h1's 20 Mbit/s
    link; relative --checkpoint-dir and --state-dir are on the actors' hosts; --resume-from is checked
    there. The maker grades with docs/your-task.md's reward module and data, which exist only on the desk."""
    assert all("Ray runtime started" in report for report in hosts.node_reports.values())  # plain ray start
    tiny = ["--config", tiny_config_path()]
    files = {**example()[0], "marks.py": MARKS}
    hosts.python(DESK, f"import pathlib; home = pathlib.Path({HOME!r}); "
                       f"[(home / name).write_text(text) for name, text in {files!r}.items()]", check=True)
    cli(hosts, DESK, "trainer", "--name", "t", "--steps", "6", *tiny, "--set", ON_TRAINER_HOST,
        "--checkpoint-every", "3", "--checkpoint-dir", "checkpoints")
    cli(hosts, DESK, "maker", "--name", "m", "--trainers", "t", *tiny, "--set", ON_MAKER_HOST,
        "--state-dir", "maker-state", *USER_TASK)
    seen = watch(hosts, "t", timeout=240)
    assert seen["trainer"].get("state") == "done" and seen["trainer"].get("policy_version") == 6, seen
    placed(seen, {"t": TRAINER, "m": MAKER}, hosts)
    # The rewards ran on the maker's host (a reward that could not be imported there would have had every
    # sample refused, and the trainer would not have reached step 6), from the copies the job shipped: the
    # modules and the data are not on that host.
    marks = hosts.run(MAKER, ["cat", f"{HOME}/graded-here"], check=True).stdout.split()
    assert marks[1::2] and {int(a) for a in marks[1::2]} <= {5, 11, 3, 16, 4, 13}, marks  # the doc's answers
    assert not any(exists(hosts, MAKER, f"{HOME}/{name}") for name in files)
    assert not exists(hosts, DESK, f"{HOME}/graded-here")
    # Relative paths are taken from where the command ran (the desk's home) and live on the actor's host.
    assert exists(hosts, TRAINER, f"{HOME}/checkpoints/rank_0")
    assert not exists(hosts, DESK, f"{HOME}/checkpoints")
    assert exists(hosts, MAKER, f"{HOME}/maker-state/m") and not exists(hosts, DESK, f"{HOME}/maker-state")
    cli(hosts, DESK, "stop", "--force")

    # --resume-from names a directory on the trainer's host, not on the host the command runs on.
    refused = cli(hosts, MAKER, "trainer", "--name", "t2", "--steps", "8", *tiny, "--set", ON_TRAINER_HOST,
                  "--resume-from", f"{HOME}/no-such-checkpoint", check=False)
    assert refused.returncode == 2, refused.stderr
    assert (f"--resume-from '{HOME}/no-such-checkpoint': no such directory on the host of trainer rank 0"
            in refused.stderr), refused.stderr
    resumed = cli(hosts, MAKER, "trainer", "--name", "t2", "--steps", "8", *tiny, "--set", ON_TRAINER_HOST,
                  "--resume-from", f"{HOME}/checkpoints", check=False)
    assert not exists(hosts, MAKER, f"{HOME}/checkpoints")
    assert resumed.returncode == 0, resumed.stderr
    status = json.loads(cli(hosts, DESK, "status", "--json").stdout)
    # resumed at step 6 (it may train on the buffer its checkpoint kept), not started from 0
    assert [row["name"] for row in status] == ["t2"] and status[0]["policy_version"] >= 6, status
    cli(hosts, DESK, "stop", "--force")


def test_labels_no_alive_node_carries_are_refused_at_once(hosts: Hosts) -> None:
    """A job asking for node labels no node has exits non-zero at once, naming the labels; nothing is left."""
    tiny = ["--config", tiny_config_path()]
    cases = {"role=gpu": ["maker", "--name", "mx", "--trainers", "t", *tiny, "--set",
                          "maker.label_selector={role: gpu}"],
             "role=!desk, zone=east": ["trainer", "--name", "tg", *tiny, "--world-size", "2", "--strategy",
                                       "ddp", "--set",
                                       'trainer_group.label_selector={role: "!desk", zone: east}'],
             "role=in(gpu,tpu)": ["run", *tiny, "--name", "rx", "--no-progress", "--output", "runs", "--set",
                                  'maker.label_selector={role: "in(gpu,tpu)"}']}
    for labels, args in cases.items():
        refused = cli(hosts, DESK, *args, timeout=120, check=False)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        assert f"with labels {labels}; no alive node carries them" in refused.stderr, refused.stderr
    assert "no detached-rl actors" in cli(hosts, DESK, "status").stdout


def test_run_on_the_cluster_places_its_actors_and_writes_its_directory_on_the_drivers_host(
        hosts: Hosts, tmp_path: Path) -> None:
    """`detached-rl run --address` typed on the desk: trainer on h2, both makers on h1 (by labels); the run
    directory, with the adapter and merged model, is on the desk and nowhere else."""
    log = tmp_path / "run.log"
    started = []
    args = ["detached-rl", "run", "--config", tiny_config_path(), "--address", hosts.head_address, "--steps",
            "3", "--makers", "2", "--name", "r1", "--output", "runs", "--no-progress",
            "--set", ON_TRAINER_HOST, "--set", ON_MAKER_HOST]
    try:
        seen = watch(hosts, "r1-trainer", timeout=240, then=lambda: started.append(hosts.popen(DESK, args,
                                                                                               log=log)))
        run = started[0]
        run.wait(timeout=240)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
    assert run.returncode == 0, log.read_text()[-3000:]
    placed(seen, {"r1-trainer": TRAINER, "r1-maker-0": MAKER, "r1-maker-1": MAKER}, hosts)
    directory = f"{HOME}/runs/r1"
    for name in ("config.yaml", "metrics.jsonl", "eval.json", "summary.json", "adapter", "merged"):
        assert exists(hosts, DESK, f"{directory}/{name}"), name
    assert not exists(hosts, TRAINER, f"{HOME}/runs") and not exists(hosts, MAKER, f"{HOME}/runs")
    metrics = hosts.run(DESK, ["cat", f"{directory}/metrics.jsonl"]).stdout.splitlines()
    assert len(metrics) >= 3, metrics


@pytest.mark.slow
@pytest.mark.e2e
def test_the_default_job_across_a_20_mbit_link_sends_only_adapters(hosts: Hosts) -> None:
    """The default job (no --config: SmolLM2 + LoRA, vLLM makers): trainer on h0 (by custom resource), maker
    on h1 (by label) behind a 20 Mbit/s link, started as separate jobs on those hosts, trains 4 steps; the
    maker loads its base on its own host, so the link carries the adapters and never the model (540 MB): at
    most 1.2x the adapter's bytes per version sent, read from the link's counters. The adapters cross in the
    dtype its vLLM engine serves: bf16 where the CPU computes bf16 natively (9.8 MB a version instead of the
    trainer's 19.5 MB in fp32), float32 elsewhere (`maker.vllm.dtype: auto`)."""
    before = hosts.counters(MAKER)
    start = time.monotonic()
    try:
        cli(hosts, TRAINER, "trainer", "--name", "big", "--steps", "4", "--set",
            "trainer_group.resources={trainer_host: 1}", timeout=600)
        cli(hosts, MAKER, "maker", "--name", "big-maker", "--trainers", "big", "--set", ON_MAKER_HOST,
            timeout=600)
        seen = watch(hosts, "big", timeout=600)
        after = hosts.counters(MAKER)
    finally:
        cli(hosts, TRAINER, "stop", "--force", check=False)
    assert seen["trainer"].get("state") == "done" and seen["trainer"].get("policy_version") == 4, \
        json.dumps(seen["trainer"])
    received, sent = after["received"] - before["received"], after["sent"] - before["sent"]
    adapter = max(seen["weight_bytes"], default=0)
    # versions that crossed: the registration's answer (version 0) and every push sent to the maker
    versions = 1 + seen["weight_push"]["sent"]
    print(f"default job across 20 Mbit/s: {time.monotonic() - start:.0f} s, first weights served "
          f"{seen['first_update_s']} s after the maker job started; h1's link: {received / 1e6:.1f} MB in, "
          f"{sent / 1e6:.1f} MB out; adapter {adapter / 1e6:.1f} MB (fp32), "
          f"{max((size for size in seen['wire_bytes'] if size), default=0) / 1e6:.1f} MB (bf16, sent) x "
          f"{versions} versions; link / fp32 adapter bytes = {received / (adapter * versions):.2f}")
    placed(seen, {"big": TRAINER, "big-maker": MAKER}, hosts)
    assert 15e6 < adapter < 25e6, seen["weight_bytes"]  # LoRA r=16 on every linear layer of SmolLM2, fp32
    assert seen["engines"].get("big-maker") in ("vllm:bfloat16", "vllm:float32"), seen["engines"]
    if seen["engines"]["big-maker"] == "vllm:bfloat16":
        wire = max((size for size in seen["wire_bytes"] if size), default=0)
        assert abs(wire - adapter / 2) < 0.01 * adapter, seen["wire_bytes"]  # the adapter in bf16, as served
    else:
        wire = adapter  # served in float32: no narrower variant is sent
        assert not any(seen["wire_bytes"]), seen["wire_bytes"]
    assert received <= 1.2 * wire * versions, (received, wire, versions)
    assert_mismatch_gated(seen["mismatch"], seen["engines"]["big-maker"])
