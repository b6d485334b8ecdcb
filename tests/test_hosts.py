"""The multi-host harness itself (tests/hosts): teardown after a failing body, each host's own files, links
that carry what is sent and are shaped both ways, an unplugged link, the node commands, and `python -m
tests.hosts`.

Mostly without Ray (`Hosts(...).up(nodes=False)`); one test starts Ray nodes with `detached-rl node
--bind-to-address`, sees them listen on their hosts' addresses only, and sees them torn down.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from detached_rl.node import NodePorts
from detached_rl.node.listening import WILDCARDS, parse_table

from .conftest import ROOT
from .hosts import Hosts, HostsError, LinkCharacter
from .hosts.cluster import tear_down
from .hosts.network import HOST_ROOT, RAY_TMP, NetworkError, require_tools

pytestmark = [pytest.mark.multihost]

SHAPED = 1  # host 1's link is shaped; host 0's is not
FAR = 2  # host 2's link has a character: delay (and loss, set by its test)
DELAY_MS = 40.0
RATE_MBIT = 20
PAYLOAD = 2 * 2**20  # bytes sent each way: about 0.8 s at 20 Mbit/s
PORT = 7001

# Host 1 answers on PORT: reads a length and that many bytes, sends as many back, prints what it received.
ECHO_SERVER = f"""
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", {PORT}))
server.listen()
print("ready", flush=True)
while True:
    connection, _ = server.accept()
    with connection:
        size = int.from_bytes(connection.recv(8, socket.MSG_WAITALL), "big")
        got = len(connection.recv(size, socket.MSG_WAITALL))
        connection.sendall(bytes(got))
        print(got, flush=True)
"""

# Sends argv[2] bytes to argv[1]:PORT and reads them back; exits 3 when it cannot connect within 2 s.
ECHO_CLIENT = f"""
import socket, sys
size = int(sys.argv[2])
try:
    connection = socket.create_connection((sys.argv[1], {PORT}), timeout=2.0)
except OSError as error:
    print(f"no connection: {{error}}")
    sys.exit(3)
connection.settimeout(60)
connection.sendall(size.to_bytes(8, "big") + bytes(size))
back = 0
while back < size:
    chunk = connection.recv(1 << 16)
    if not chunk:
        break
    back += len(chunk)
print(back)
"""


def tools_or_fail() -> None:
    """Fail (not skip) where the harness cannot run: CI runs these as root."""
    try:
        require_tools()
    except NetworkError as error:
        pytest.fail(str(error), pytrace=False)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Three hosts without Ray, host 1's link shaped to RATE_MBIT, host 1 running the echo server, host 2's
    link DELAY_MS long each way."""
    tools_or_fail()
    built = Hosts(3, rates_mbit={SHAPED: RATE_MBIT}, links={FAR: LinkCharacter(DELAY_MS)}).up(nodes=False)
    with built:
        server = built.popen(SHAPED, [sys.executable, "-c", ECHO_SERVER])
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield built
    server.wait(timeout=30)


def echo(hosts: Hosts, size: int = PAYLOAD) -> subprocess.CompletedProcess[str]:
    """Send `size` bytes from host 0 to host 1's echo server and read them back."""
    return hosts.run(0, [sys.executable, "-c", ECHO_CLIENT, hosts.host(SHAPED).address, str(size)],
                     timeout=120)


def namespace_inodes(names: list[str]) -> set[int]:
    """Inodes of the named network namespaces (they identify a namespace even after its name is removed)."""
    return {os.stat(f"/run/netns/{name}").st_ino for name in names}


def live_namespace_inodes() -> set[int]:
    """Inodes of the network namespaces some process on this machine is in."""
    inodes = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                inodes.add(os.stat(f"/proc/{entry.name}/ns/net").st_ino)
            except OSError:
                continue
    return inodes


def alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def qdisc(namespace: str, device: str) -> dict:
    """The root qdisc of `device` in `namespace`, with its statistics."""
    shown = subprocess.run(["tc", "-n", namespace, "-s", "-j", "qdisc", "show", "dev", device],
                           capture_output=True, text=True, check=True).stdout
    return json.loads(shown)[0]


def listening(hosts: Hosts, index: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket on host `index`, read from its /proc/net."""
    found = []
    for table in ("tcp", "tcp6"):
        found += parse_table(hosts.run(index, ["cat", f"/proc/net/{table}"], check=True).stdout)
    return found


def test_bound_nodes_listen_on_their_address_and_all_is_gone_after_the_body_raises() -> None:
    """Nodes started with `detached-rl node --bind-to-address` (the bind shim preloaded into every Ray
    process) listen on their host's address, none of their ports on all interfaces. Then a test body raising
    inside `with Hosts(...)`: its namespaces (with their veths), anchors, Ray nodes and a process the test
    started on a host are all gone, and so is the work directory."""
    tools_or_fail()
    built = Hosts(2, rates_mbit={1: 50}, cpus={0: 1, 1: 1}, object_store_mb=100, bind_to_address=True)
    with pytest.raises(RuntimeError, match="the test failed"), built:
        for index in (0, 1):
            address, ports = built.host(index).address, NodePorts().of_node(head=index == 0)
            table = listening(built, index)
            assert [row for row in table if row[1] in ports and row[0] in WILDCARDS] == [], table
            assert (address, NodePorts().node_manager) in table, table
            assert f"listening on {address} and 127.0.0.1 only" in built.node_reports[index]
        assert (built.host(0).address, NodePorts().gcs) in listening(built, 0)
        # The hosts' namespaces live while a process is in them; the switch's has none, only its name.
        names = [host.namespace for host in built.hosts] + [built.network.switch]
        inodes = namespace_inodes(names[:-1])
        assert inodes <= live_namespace_inodes()
        stray = built.popen(1, ["sleep", "600"])
        pids = [pid for host in built.hosts for pid in host.pids()]
        raylets = [built.raylet_pid(0), built.raylet_pid(1)]
        assert None not in raylets and set(raylets) <= set(pids)
        assert len(pids) > 10  # anchors, GCS, raylets, agents, workers, the stray
        raise RuntimeError("the test failed")
    assert stray.wait(timeout=10) < 0  # killed by a signal
    assert [pid for pid in pids if alive(pid)] == []
    assert not inodes & live_namespace_inodes()  # the namespaces, and the veths in them, are destroyed
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [name for name in names if name in listed]
    assert not built.workdir.exists()


def test_a_node_is_started_with_detached_rl_node_or_plain_ray_start(tmp_path: Path) -> None:
    """The harness's node commands (nothing started): `detached-rl node` with the token required and
    `--bind-to-address` when asked, the `ray start` options after `--`; plain `ray start` with the same
    address, head ports, CPUs, resources and labels and nothing of detached-rl's. A starter it does not know,
    or the shim with plain `ray start`, is refused naming the field."""
    layout = {"cpus": {1: 3}, "resources": {1: {"maker_host": 1.0}}, "labels": {1: {"role": "maker"}}}
    ours = Hosts(2, workdir=tmp_path / "a", bind_to_address=True, **layout)  # type: ignore[arg-type]
    plain = Hosts(2, workdir=tmp_path / "b", start_with="ray start", **layout)  # type: ignore[arg-type]
    head, worker = ours.node_command(0), ours.node_command(1)
    first, second = ours.host(0).address, ours.host(1).address
    assert head[1:3] == ["node", f"--node-ip-address={first}"] and "--head" in head
    assert "--bind-to-address" in worker and "--no-token" not in worker
    assert worker.index("--") < worker.index("--disable-usage-stats")
    plain_head, plain_worker = plain.node_command(0), plain.node_command(1)
    assert Path(plain_head[0]).name == "ray" and plain_head[1:3] == ["start", f"--node-ip-address={first}"]
    assert {"--head", "--port=6379", "--ray-client-server-port=10001"} <= set(plain_head)
    assert {f"--address={first}:6379", f"--node-ip-address={second}", "--num-cpus=3",
            '--resources={"maker_host": 1.0}', "--labels=role=maker"} <= set(plain_worker)
    assert not {"--", "--bind-to-address", "--no-token"} & set(plain_worker)
    assert not [arg for arg in plain_worker if arg.startswith(("--node-manager-port", "--min-worker-port"))]
    with pytest.raises(HostsError, match="start_with='kuberay'"):
        Hosts(2, workdir=tmp_path / "c", start_with="kuberay")
    with pytest.raises(HostsError, match="bind_to_address=True .* not with start_with='ray start'"):
        Hosts(2, workdir=tmp_path / "d", start_with="ray start", bind_to_address=True)


def test_each_host_sees_its_own_files(hosts: Hosts) -> None:
    """The same path names a different file on each host (HOME and /tmp/ray included); none in the root."""
    name = f"who-{uuid.uuid4().hex[:8]}"
    for index in (0, 1):
        for directory in (HOST_ROOT / "home", RAY_TMP):
            hosts.run(index, ["sh", "-c", f"echo h{index} > {directory}/{name}"], check=True)
    for index in (0, 1):
        for directory in (HOST_ROOT / "home", RAY_TMP):
            assert hosts.run(index, ["cat", f"{directory}/{name}"], check=True).stdout.strip() == f"h{index}"
        home = hosts.run(index, ["sh", "-c", "echo $HOME; pwd"]).stdout.split()
        assert home == [str(HOST_ROOT / "home")] * 2
        assert (hosts.host(index).directory / "home" / name).read_text().strip() == f"h{index}"
        assert (hosts.host(index).directory / "ray" / name).read_text().strip() == f"h{index}"
    assert not (HOST_ROOT / "home" / name).exists() and not (RAY_TMP / name).exists()


def test_a_link_carries_what_is_sent_and_is_shaped_both_ways(hosts: Hosts) -> None:
    """Host 1's link counts the bytes sent each way and its tbf (on the host's end and on the switch's end)
    holds packets back at the set rate; host 0's link has no tbf."""
    shaped = hosts.host(SHAPED)
    ends = ((shaped.namespace, "eth0"), (hosts.network.switch, shaped.port))  # uploads, downloads
    for namespace, device in ends:
        root = qdisc(namespace, device)
        assert root["kind"] == "tbf" and root["options"]["rate"] == RATE_MBIT * 10**6 // 8, root
    assert qdisc(hosts.host(0).namespace, "eth0")["kind"] != "tbf"
    before = [hosts.counters(0), hosts.counters(SHAPED)]
    held_before = [qdisc(*end)["overlimits"] for end in ends]
    done = echo(hosts)
    assert done.returncode == 0 and int(done.stdout) == PAYLOAD, done.stdout + done.stderr
    after = [hosts.counters(0), hosts.counters(SHAPED)]
    for index, direction in ((0, "sent"), (0, "received"), (1, "sent"), (1, "received")):
        assert after[index][direction] - before[index][direction] >= PAYLOAD, (index, direction, after)
    # A burst over the rate is held back by both buckets (overlimits count the packets held back).
    assert all(qdisc(*end)["overlimits"] > held for end, held in zip(ends, held_before, strict=True))
    hosts.shape(SHAPED, None)
    try:
        assert all(qdisc(*end)["kind"] != "tbf" for end in ends)
    finally:
        hosts.shape(SHAPED, RATE_MBIT)


def test_an_unplugged_link_carries_nothing_until_plugged_back(hosts: Hosts) -> None:
    """With host 1's cable out nothing crosses its link either way; plugged back, the same exchange works."""
    hosts.link(SHAPED, False)
    try:
        before = hosts.counters(SHAPED)
        refused = echo(hosts)
        out = hosts.run(SHAPED, [sys.executable, "-c", ECHO_CLIENT, hosts.host(0).address, "1000"],
                        timeout=60)
        assert refused.returncode == 3 and out.returncode == 3, refused.stdout + out.stdout
        assert hosts.counters(SHAPED) == before
    finally:
        hosts.link(SHAPED, True)
    done = echo(hosts, 1000)
    assert done.returncode == 0 and int(done.stdout) == 1000, done.stdout + done.stderr
    assert hosts.counters(SHAPED)["received"] > before["received"]


# From host 0: the time a TCP connection to a closed port of argv[1] takes to be refused (one round trip),
# `count` times; prints the median in ms.
ROUND_TRIP = """
import socket, statistics, sys, time
times = []
for _ in range(int(sys.argv[2])):
    start = time.monotonic()
    try:
        socket.create_connection((sys.argv[1], 7999), timeout=5).close()
    except ConnectionRefusedError:
        times.append((time.monotonic() - start) * 1000)
print(statistics.median(times))
"""
# On host 2: counts the UDP datagrams that reach port 7002 until 3 s pass without one.
UDP_COUNTER = """
import socket
receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
receiver.bind(("0.0.0.0", 7002))
print("ready", flush=True)
receiver.settimeout(30)
count = 0
try:
    while True:
        receiver.recv(64)
        count += 1
        receiver.settimeout(3)
except socket.timeout:
    print(count, flush=True)
"""
UDP_SENDER = """
import socket, sys, time
sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for _ in range(int(sys.argv[2])):
    sender.sendto(b"x" * 32, (sys.argv[1], 7002))
    time.sleep(0.0005)
"""


def test_a_link_delays_and_loses_as_its_character_says(hosts: Hosts) -> None:
    """Host 2's link holds each frame DELAY_MS each way (netem where the kernel has it, else the user-space
    wire): a round trip from host 0 takes twice that; host 1's plain link does not. Given 20 % loss while it
    runs, about 20 % of 3000 datagrams are lost (binomial: within 6 standard deviations)."""
    far, near = hosts.host(FAR).address, hosts.host(SHAPED).address
    assert hosts.network.emulation in ("netem", "wire")
    far_ms = float(hosts.run(0, [sys.executable, "-c", ROUND_TRIP, far, "9"], check=True).stdout)
    near_ms = float(hosts.run(0, [sys.executable, "-c", ROUND_TRIP, near, "9"], check=True).stdout)
    print(f"round trip to h2 {far_ms:.1f} ms, to h1 {near_ms:.1f} ms ({hosts.network.emulation})")
    assert 2 * DELAY_MS <= far_ms < 2 * DELAY_MS + 500 and near_ms < DELAY_MS, (far_ms, near_ms)

    sent, loss = 3000, 0.2
    hosts.set_link_character(FAR, LinkCharacter(loss=loss))
    try:
        counter = hosts.popen(FAR, [sys.executable, "-c", UDP_COUNTER])
        assert counter.stdout is not None and counter.stdout.readline().strip() == "ready"
        hosts.run(0, [sys.executable, "-c", UDP_SENDER, far, str(sent)], check=True, timeout=60)
        received = int(counter.communicate(timeout=60)[0])
    finally:
        hosts.set_link_character(FAR, LinkCharacter(DELAY_MS))
    spread = 6 * (sent * loss * (1 - loss)) ** 0.5
    print(f"h2's link at {loss:.0%} loss: {received} of {sent} datagrams arrived")
    assert abs(received - sent * (1 - loss)) <= spread, received


def test_the_script_builds_hosts_runs_commands_on_them_and_removes_them(tmp_path: Path) -> None:
    """`python -m tests.hosts up`, `exec` (from a shell whose PATH lacks this install: it still finds
    detached-rl) and `down`, as a person types them in the repository."""
    tools_or_fail()
    script = [sys.executable, "-m", "tests.hosts"]
    in_repository = functools.partial(subprocess.run, cwd=ROOT)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    up = in_repository([*script, "up", "--hosts", "2", "--no-ray", "--rate", "1=30"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert up.returncode == 0, up.stderr
    layout = json.loads(up.stdout[:up.stdout.index("\n}") + 2])
    workdir = Path(layout["workdir"])
    try:
        assert layout["hosts"] == ["10.213.0.1", "10.213.0.2"] and layout["head"] == "10.213.0.1:6379"
        assert f"python -m tests.hosts down {workdir}" in up.stdout
        address = in_repository([*script, "exec", str(workdir), "1", "--", "ip", "-4", "-o", "addr", "show",
                                 "dev", "eth0"], capture_output=True, text=True, timeout=60, env=env)
        assert "10.213.0.2/24" in address.stdout, address.stdout + address.stderr
        version = in_repository([*script, "exec", str(workdir), "0", "--", "detached-rl", "--version"],
                                capture_output=True, text=True, timeout=120, env=env)
        assert version.returncode == 0 and version.stdout.startswith("detached-rl "), version.stderr
        # Only the first "--" separates; the command's own arguments are passed as typed.
        echoed = in_repository([*script, "exec", str(workdir), "1", "--", "echo", "a", "--", "b"],
                               capture_output=True, text=True, timeout=60, env=env)
        assert echoed.stdout.strip() == "a -- b", echoed.stdout + echoed.stderr
        wrong = in_repository([*script, "exec", str(workdir), "2", "--", "true"], capture_output=True,
                              text=True, timeout=60, env=env)
        assert wrong.returncode != 0 and "there are hosts 0 to 1" in wrong.stderr, wrong.stderr
        state = json.loads((workdir / "network.json").read_text())
        names = [host["namespace"] for host in state["hosts"]] + [state["switch"]]
        inodes = namespace_inodes(names[:-1])
        anchors = [host["anchor_pid"] for host in state["hosts"]]
        assert qdisc(names[1], "eth0")["kind"] == "tbf"
        down = in_repository([*script, "down", str(workdir)], capture_output=True, text=True, timeout=120,
                             env=env)
        assert down.returncode == 0, down.stderr
        assert not workdir.exists() and not inodes & live_namespace_inodes()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not [name for name in names if name in listed]
        assert [pid for pid in anchors if alive(pid)] == []
    finally:
        if workdir.exists():
            tear_down(workdir)
