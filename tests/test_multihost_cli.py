"""The CLI from a host that runs neither job, and security across hosts.

Four hosts: h0 (the head; the trainer job, by custom resource), h1 (the maker job), h2 (the desk: a Ray
node that runs neither job, only the commands typed there) and h3 (a laptop: no Ray node at all). Every
node is started as docs/multi-host.md says, with `detached-rl node`: ports pinned, token authentication on,
Ray's own binding (tests/test_hosts.py runs nodes with `--bind-to-address`). `status`, `inspect`,
`export` and `stop` typed on the desk work through the Ray client (`ray://<h0>:10001`) and through
the head's address (`<h0>:6379`); an export lands on the desk. On the laptop only the Ray client
works, and the direct address is refused saying so. Which sockets the nodes listen on, and a driver
without the token or with a wrong one, are checked too.
"""

from __future__ import annotations

import json
import secrets
import subprocess

import pytest

from detached_rl.node import NodePorts
from detached_rl.node.shim import port_ranges

from .hosts import Hosts
from .multihost import Probe, hosts_fixture, tiny_config_path, wait_for

pytestmark = [pytest.mark.multihost]

TRAINER, MAKER, DESK, LAPTOP = 0, 1, 2, 3
HOME = "/tmp/drl-hostfs/home"
WILDCARDS = {"*", "0.0.0.0", "::"}  # all interfaces, as `ss` writes them
# The ports `detached-rl node` pins on every node (docs/multi-host.md section 6).
PORTS = NodePorts()
hosts = hosts_fixture(4, resources={TRAINER: {"trainer_host": 1}, MAKER: {"maker_host": 1}}, bare={LAPTOP})
NAMESPACE = ["--namespace", "desk_test"]
TINY = ["--config", tiny_config_path(), "--set", "namespace=desk_test"]
SAMPLES = 8  # the maker's 2 batches of 4 prompts, 1 answer each (examples/jobs/tiny.yaml)


def cli(hosts: Hosts, address: str, *args: str, env: dict[str, str] | None = None, check: bool = True,
        on: int = DESK) -> subprocess.CompletedProcess[str]:
    """`detached-rl ...` typed on host `on` (the desk) against `address`."""
    return hosts.run(on, ["detached-rl", *args, "--address", address], env=env, timeout=240, check=check)


def addresses(hosts: Hosts) -> list[str]:
    """The Ray client address and the head's direct address."""
    return [hosts.client_address, hosts.head_address]


def listeners(hosts: Hosts, index: int) -> list[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket on host `index`."""
    shown = subprocess.run(["ip", "netns", "exec", hosts.host(index).namespace, "ss", "-ltnpH"],
                           capture_output=True, text=True, check=True).stdout
    found = []
    for line in shown.splitlines():
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        process = fields[5].split('"')[1] if len(fields) > 5 and '"' in fields[5] else "?"
        found.append((address.strip("[]").removeprefix("::ffff:"), int(port), process))
    return sorted(found, key=lambda row: row[1])


def jobs(hosts: Hosts) -> None:
    """The trainer job typed on h0 and the maker job on h1, at the same time. The maker makes 2 batches (8
    samples) and stops (its job follows it until then); the trainer waits for 16: its buffer keeps those 8
    and the machine goes quiet."""
    trainer = ["detached-rl", "trainer", "--name", "t", "--steps", "5", *TINY, "--set",
               "trainer_group.resources={trainer_host: 1}", "--set", "trainer.train_batch_size=16",
               "--set", "trainer.batch_timeout_s=600", "--address", hosts.head_address]
    maker = ["detached-rl", "maker", "--name", "m", "--trainers", "t", "--batches", "2", "--wait", *TINY,
             "--set", "maker.resources={maker_host: 1}", "--address", hosts.head_address]
    started = [hosts.popen(TRAINER, trainer), hosts.popen(MAKER, maker)]
    for job in started:
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, out


def wait_buffered(hosts: Hosts) -> None:
    """Until the trainer's buffer holds both of the maker's batches, asked through one long-lived driver on h0
    (a `ray://` join per poll would make the head start a client server each time)."""
    probe = Probe(hosts, TRAINER)
    try:
        wait_for("the maker's two batches in the trainer's buffer",
                 lambda: probe.ask("t", "buffer_stats", namespace="desk_test")["size"] >= SAMPLES, 180)
    finally:
        probe.close()


def test_status_inspect_export_and_stop_from_the_desk_through_both_addresses(hosts: Hosts) -> None:
    """A trainer job on h0 and a maker job on h1, typed on their hosts; from the desk, through `ray://`
    and the direct address: status lists both, inspect shows the samples, export writes them on the desk,
    stop ends them."""
    jobs(hosts)
    wait_buffered(hosts)
    for address in addresses(hosts):
        report = json.loads(cli(hosts, address, "inspect", "t", "--json", "--last", "2", *NAMESPACE).stdout)
        stats = report["stats"]
        assert stats["size"] == SAMPLES and stats["accounting_ok"] and "m" in stats["per_maker"], stats
        assert len(report["samples"]) == 2 and all(s["response_text"] is not None for s in report["samples"])
        status = json.loads(cli(hosts, address, "status", "--json", *NAMESPACE).stdout)
        assert {(row["name"], row["role"]) for row in status} == {("t", "trainer"), ("m", "maker")}, status
        # A relative path is the desk's: the file lands in the desk's home, nowhere else.
        name = f"exported-{'client' if address.startswith('ray://') else 'direct'}.jsonl"
        exported = cli(hosts, address, "export", "t", f"out/{name}", *NAMESPACE)
        assert f"wrote {SAMPLES} samples of 't' to out/{name}" in exported.stdout, exported.stdout
        text = hosts.run(DESK, ["cat", f"{HOME}/out/{name}"], check=True).stdout
        rows = [json.loads(line) for line in text.splitlines()]
        assert len(rows) == SAMPLES and all({"prompt_ids", "response_ids"} <= set(row) for row in rows)
        for index in (TRAINER, MAKER):
            assert hosts.run(index, ["test", "-e", f"{HOME}/out"]).returncode != 0
    # stop: the maker through the Ray client, the trainer through the direct address
    stopped = cli(hosts, hosts.client_address, "stop", "m", *NAMESPACE, "--timeout", "60")
    assert "stopped m" in stopped.stdout, stopped.stdout
    stopped = cli(hosts, hosts.head_address, "stop", "t", *NAMESPACE, "--timeout", "60")
    assert "stopped t" in stopped.stdout, stopped.stdout  # none left: the laptop's status below says so


def test_every_node_listens_on_pinned_ports_only_and_its_report_names_what_a_firewall_must_guard(
        hosts: Hosts) -> None:
    """Nodes started with `detached-rl node` (Ray's own binding): every socket open to other hosts, on the
    host's address or on all interfaces, is on a port docs/multi-host.md lists (so a firewall that opens just
    those between the hosts is complete); what the command printed names the ports it found on all
    interfaces (the raylet's among them) and every port a firewall must guard."""
    for index in (TRAINER, MAKER, DESK):
        table = listeners(hosts, index)
        print(f"h{index} listens on: " + ", ".join(f"{a}:{p} ({n})" for a, p, n in table))
        open_to_hosts = [(a, p, n) for a, p, n in table if a not in ("127.0.0.1", "::1")]
        assert {a for a, _, _ in open_to_hosts} <= {hosts.host(index).address, *WILDCARDS}, open_to_hosts
        pinned = PORTS.of_node(head=index == 0)
        unexpected = [row for row in open_to_hosts if row[1] not in pinned]
        assert not unexpected, unexpected
        report = hosts.node_reports[index]
        found = report.split("on all interfaces at ports ", 1)[1].split("\n", 1)[0]
        assert any(int(low) <= PORTS.node_manager <= int(high or low)
                   for low, _, high in (part.partition("-") for part in found.split(","))), report
        assert f"a firewall must let only the cluster's hosts reach ports {port_ranges(pinned)} " in report


def test_on_a_host_without_a_node_the_ray_client_works_and_a_direct_address_is_refused(hosts: Hosts) -> None:
    """The laptop (no Ray node): `status` through `ray://` answers; through the head's address it exits 2
    at once, saying that a direct address needs a node on this host and naming the Ray client address."""
    assert "no detached-rl actors" in cli(hosts, hosts.client_address, "status", *NAMESPACE, on=LAPTOP).stdout
    refused = cli(hosts, hosts.head_address, "status", *NAMESPACE, on=LAPTOP, check=False)
    last = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert f"no Ray node of the cluster at {hosts.head_address} runs on this host" in last, last
    assert f"--address {hosts.client_address}" in last, last


def test_a_driver_without_the_token_or_with_a_wrong_one_is_refused_at_once(hosts: Hosts) -> None:
    """From the desk, without RAY_AUTH_MODE/RAY_AUTH_TOKEN (to the head's address) or with a wrong token
    (through the Ray client): exit 2 and one line naming both variables, before the connect timeout."""
    plain = {k: v for k, v in hosts.environment().items() if not k.startswith("RAY_AUTH")}
    plain["DETACHED_RL_CONNECT_TIMEOUT_S"] = "60"  # Ray's own retries last longer: refused before
    wrong = {**plain, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    for case, env, address, sent in (("no token", plain, hosts.head_address, "no token"),
                                     ("wrong token", wrong, hosts.client_address, "its token")):
        refused = cli(hosts, address, "status", *NAMESPACE, env=env, check=False)
        last = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode == 2, (case, refused.stderr)
        assert f"the Ray cluster at {address} refused this driver, which sent {sent}" in last, (case, last)
        assert "RAY_AUTH_MODE=token" in last and "RAY_AUTH_TOKEN" in last, (case, last)
