"""A swarm on namespace hosts (issue 37): one trainer host behind a 20 Mbit/s uplink, three maker hosts
behind links of 100, 20 and 5 Mbit/s, every node started with plain `ray start` and every job typed on its
own host as a user does (tiny config, relays on by default).

In order, sharing the run: versions cross the trainer's uplink about once (the makers relay them to one
another); the relay at the root of the tree vanishes with its node and is named in `status` within 30 s
while its children take the trainer's own updates; a fresh host joins with a maker job that generates with
the current weights; the trainer is stopped and the ledger adds up, per maker and in all.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .deadlines import scaled
from .multihost import Probe, hosts_fixture, tiny_config_path, wait_for

pytestmark = [pytest.mark.multihost]

TRAINER, JOINER = 0, 4
MAKERS = (1, 2, 3)
hosts = hosts_fixture(5, rates_mbit={TRAINER: 20, 1: 100, 2: 20, 3: 5, JOINER: 100}, start_with="ray start",
                      resources={TRAINER: {"trainer_host": 1}},
                      labels={index: {"host": f"h{index}"} for index in range(5)}, bare={JOINER})
UPDATES_MEASURED = 10  # versions the fan-out is measured over, once every maker has registered


def start_maker(hosts: Any, index: int) -> Any:
    """`detached-rl maker --name m<index>` typed on host `index`, its maker placed there (by label)."""
    return hosts.popen(index, ["detached-rl", "maker", "--name", f"m{index}", "--trainers", "sw", "--address",
                               hosts.head_address, "--config", tiny_config_path(),
                               "--set", f"maker.label_selector={{host: h{index}}}"])


def test_versions_cross_the_uplink_about_once_a_vanished_relay_is_named_a_joiner_serves_the_ledger_adds_up(
        hosts: Any) -> None:
    jobs = [hosts.popen(TRAINER, ["detached-rl", "trainer", "--name", "sw", "--steps", "100000", "--address",
                                  hosts.head_address, "--config", tiny_config_path(),
                                  "--set", "trainer_group.resources={trainer_host: 1}",
                                  # the tiny model's 0.55 MB updates are relayed too (by default from 2 MiB)
                                  "--set", "trainer.weight_relay_min_bytes=0"])]
    jobs += [start_maker(hosts, index) for index in MAKERS]
    probe = Probe(hosts, TRAINER)
    try:
        for job in jobs:
            assert job.communicate(timeout=300)[0] is not None and job.returncode == 0, job.args

        def status() -> dict[str, Any]:
            return probe.ask("sw", "status")

        def registered() -> dict[str, Any] | None:
            row = status()
            return row if len(row["makers"]) == 3 and row["policy_version"] >= 2 else None

        # 1. Fan-out: bytes out of h0 over UPDATES_MEASURED versions, every maker registered.
        first = wait_for("3 makers registered and v2 trained", registered, 300)
        sent = hosts.counters(TRAINER)["sent"]
        last = wait_for(f"{UPDATES_MEASURED} more versions", lambda: (row := status())["policy_version"]
                        >= first["policy_version"] + UPDATES_MEASURED and row, 300)
        out = hosts.counters(TRAINER)["sent"] - sent
        versions = last["policy_version"] - first["policy_version"]
        update = max(row.get("weight_sync/bytes/wire", 0) or row.get("weight_sync/bytes", 0)
                     for row in probe.ask("sw", "metrics"))
        push = last["weight_push"]
        print(f"swarm: {out / versions / 1e6:.2f} MB out of h0 per version ({versions} versions), one "
              f"update {update / 1e6:.2f} MB: {out / versions / update:.2f} copies; relay tree "
              f"{push['relay_tree']}, {push['relayed']} relayed, {push['relay_fallbacks']} fallbacks")
        assert push["relay_tree"] and push["relayed"] > 0, push
        assert out / versions <= 1.3 * update, (out, versions, update, push)

        # 2. The root relay's node dies: named within 30 s; its children fall back to the trainer's updates.
        tree = push["relay_tree"]
        root = next(parent for parent in tree.values() if parent not in tree)
        victim = MAKERS[[f"m{index}" for index in MAKERS].index(root)]
        before_kill = probe.ask(root, "status")["push"]["per_trainer"]["sw"]["accepted"]
        hosts.kill_node(victim)
        killed = time.monotonic()
        named = wait_for(f"{root} named in the trainer's status",
                         lambda: (row := status()).get("makers_silent", {}).get(root)
                         or row.get("makers_lost", {}).get(root), 60, poll=0.5)
        named_after = time.monotonic() - killed
        print(f"swarm: {root} (h{victim}) named {named_after:.1f} s after its node died: {named}")
        assert named_after <= scaled(30.0), named  # 30 s on the idle reference box
        # 3. A fresh host joins: its maker job generates with current weights, and the run goes on.
        killed_at = joined_at = status()["policy_version"]  # the version once the root's death was named
        hosts.start_node(JOINER)
        joiner = start_maker(hosts, JOINER)
        out, _ = joiner.communicate(timeout=300)
        assert joiner.returncode == 0, out[-3000:]
        wait_for("the joiner's samples in the buffer", lambda: probe.ask("sw", "buffer_stats")["per_maker"]
                 .get(f"m{JOINER}", {}).get("received", 0) > 0, 240)
        survivors = [f"m{index}" for index in (*MAKERS, JOINER) if index != victim]
        joined = probe.ask(f"m{JOINER}", "status")
        assert joined["first_batch_version"] >= joined_at, joined  # generated with the weights it joined to

        # 4. Stop: every sample the trainer took is trained, in the buffer or dropped with its reason.
        probe.ask("sw", "stop")
        stopping = time.monotonic()
        try:
            wait_for("the trainer stopped", lambda: status()["state"] == "stopped", 180)
        except BaseException:
            row = status()
            print(f"the trainer's status: {row}")
            dump = subprocess.run([str(Path(sys.executable).with_name("py-spy")), "dump", "--pid",
                                   str(row["pid"])], capture_output=True, text=True, timeout=60)
            print(dump.stdout[-20000:], dump.stderr[-2000:])
            raise
        print(f"swarm: the trainer stopped {time.monotonic() - stopping:.0f} s after it was asked to")
        wait_for("the makers stopped", lambda: all(
            probe.ask(name, "status")["state"] == "stopped" for name in survivors), 120)
        buffer = probe.ask("sw", "buffer_stats")
        assert buffer["accounting_ok"], buffer
        assert buffer["received"] == buffer["sampled"] + buffer["in_buffer"] + sum(buffer["dropped"].values())
        for name in survivors:
            pushed = probe.ask(name, "status")["push"]
            taken = pushed["per_trainer"]["sw"]["accepted"] + pushed["dropped_stale_by_trainer"]
            assert buffer["per_maker"][name]["received"] == taken, (name, pushed, buffer["per_maker"])
        # the vanished maker: what it was told was taken is there (pushes after that are lost with its host)
        assert buffer["per_maker"][root]["received"] >= before_kill, buffer["per_maker"]
        final = status()
        print(f"swarm: ledger {buffer['received']} received = {buffer['sampled']} trained + "
              f"{buffer['in_buffer']} in buffer + {buffer['dropped']} dropped; push {final['weight_push']}")
        # The root's children went on taking versions (its relayed copies failed over to the trainer's own,
        # or a new tree left the silent root out, whichever came first) and it relays for none.
        children = [child for child, parent in tree.items() if parent == root]
        assert children and all(final["weight_push"]["acked"][child] > killed_at for child in children), final
        assert root not in final["weight_push"]["relay_tree"].values(), final["weight_push"]["relay_tree"]
    finally:
        probe.close()
        hosts.run(TRAINER, ["detached-rl", "stop", "--force", "--address", hosts.head_address], check=False,
                  timeout=120)
        for job in jobs:
            if job.poll() is None:
                job.kill()
