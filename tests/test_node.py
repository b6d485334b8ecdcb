"""`detached-rl node` without Ray: the bind shim of `--bind-to-address` (built with the real compiler,
preloaded into a real child process), the listening-socket table, the checks and `ray start` command the node
is started with, and the socket audit after the start (a report by default, a failure with the shim)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from detached_rl.cli.main import build_parser, main
from detached_rl.node import NodeError, NodePorts, NodeSpec, build_bind_shim, listening_sockets, start_node
from detached_rl.node.listening import parse_table
from detached_rl.node.shim import ADDRESS_VARIABLE, PORTS_VARIABLE, preloaded
from detached_rl.node.start import check_node_address, check_token, describe, ray_start_command

PROBE = """
import json, os, socket
node, other = (int(port) for port in os.environ["PROBE_PORTS"].split(","))
bound = {}
four = socket.socket(); four.bind(("", node)); bound["ipv4 wildcard"] = four.getsockname()[0]
four.close()
both = socket.socket(socket.AF_INET6); both.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
both.bind(("::", node)); bound["dual-stack wildcard"] = both.getsockname()[0]
only6 = socket.socket(socket.AF_INET6); only6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
only6.bind(("::", other)); bound["ipv6-only wildcard, not a node port"] = only6.getsockname()[0]
only6.close()
only6 = socket.socket(socket.AF_INET6); only6.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
only6.bind(("::", node + 1)); bound["ipv6-only wildcard"] = only6.getsockname()[0]
given = socket.socket(); given.bind(("127.0.0.1", node + 2)); bound["explicit"] = given.getsockname()[0]
elsewhere = socket.socket(); elsewhere.bind(("", other))
bound["not a node port"] = elsewhere.getsockname()[0]
ephemeral = socket.socket(); ephemeral.bind(("", 0)); bound["ephemeral"] = ephemeral.getsockname()[0]
print(json.dumps(bound))
"""
STORE = """
import datetime, os, torch.distributed as dist
port = int(os.environ["PROBE_PORTS"].split(",")[1])
server = dist.TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=20), wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=20))
client.set("key", "value")
print(server.get("key").decode())
"""


def free_ports(count: int) -> list[int]:
    """`count` ports free on loopback and wildcard now, each with its next two free too, and none within
    two of another (a test's node ports are `port..port+2`: another port inside them is a node port)."""
    found: list[int] = []
    while len(found) < count:
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            port = probe.getsockname()[1]
        apart = all(abs(port - other) > 2 for other in found)
        if apart and port + 2 < 65536 and all(_free(port + step) for step in (1, 2)):
            found.append(port)
    return found


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shim, built once for the module with this machine's compiler."""
    return build_bind_shim(tmp_path_factory.mktemp("shim"))


def in_child(code: str, environment: dict[str, str]) -> str:
    """What a child Python running `code` in `environment` prints."""
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_the_shim_binds_wildcards_on_node_ports_to_the_node_address_and_leaves_the_rest(shim: Path) -> None:
    """Preloaded with an address (127.0.0.2: on the loopback interface of every Linux host) and the node's
    ports, a child's wildcard binds on those ports land on the address (IPv4-mapped for a dual-stack socket,
    ::1 for an IPv6-only one); an explicit address, another port and an ephemeral one are kept; without
    the address nothing changes."""
    node, other = free_ports(2)
    base = {"PATH": os.environ["PATH"], "PROBE_PORTS": f"{node},{other}"}
    bound = json.loads(in_child(PROBE, preloaded(base, shim, "127.0.0.2", range(node, node + 3))))
    assert bound == {"ipv4 wildcard": "127.0.0.2", "dual-stack wildcard": "::ffff:127.0.0.2",
                     "ipv6-only wildcard, not a node port": "::", "ipv6-only wildcard": "::1",
                     "explicit": "127.0.0.1", "not a node port": "0.0.0.0", "ephemeral": "0.0.0.0"}
    every_port = json.loads(in_child(PROBE, preloaded(base, shim, "127.0.0.2")))
    assert every_port["not a node port"] == "127.0.0.2" and every_port["ephemeral"] == "127.0.0.2"
    without_address = json.loads(in_child(PROBE, {**base, "LD_PRELOAD": str(shim)}))
    assert without_address["ipv4 wildcard"] == "0.0.0.0" and without_address["dual-stack wildcard"] == "::"


def test_a_torch_store_on_loopback_works_in_a_nodes_process(shim: Path) -> None:
    """A TCPStore (vLLM's and torch's rendezvous) binds all interfaces and is reached on 127.0.0.1: on a
    port that is not the node's it keeps working under the shim (with every port taken, it could not)."""
    node, other = free_ports(2)
    base = {"PATH": os.environ["PATH"], "PROBE_PORTS": f"{node},{other}"}
    assert in_child(STORE, preloaded(base, shim, "127.0.0.2", [node])).strip() == "value"


def test_the_shim_is_built_once_and_kept_with_other_preloads(shim: Path, tmp_path: Path) -> None:
    """A second build returns the same file untouched; the shim goes first in LD_PRELOAD, the user's stay."""
    before = shim.stat().st_mtime_ns
    assert build_bind_shim(shim.parent) == shim and shim.stat().st_mtime_ns == before
    environment = preloaded({"LD_PRELOAD": "/usr/lib/other.so"}, shim, "10.0.0.5", {6379, 6380, 6381, 10001})
    assert environment["LD_PRELOAD"] == f"{shim} /usr/lib/other.so"
    assert environment[ADDRESS_VARIABLE] == "10.0.0.5" and environment[PORTS_VARIABLE] == "6379-6381,10001"


def test_without_a_compiler_the_build_is_refused_naming_the_way_out(tmp_path: Path) -> None:
    """No CC and no cc/gcc on PATH: a NodeError that says what to install and how to do without."""
    with pytest.raises(NodeError, match="--bind-to-address needs a C compiler") as refused:
        build_bind_shim(tmp_path, environment={"PATH": str(tmp_path)})
    assert "leave out --bind-to-address" in str(refused.value) and "gcc" in str(refused.value)


def test_listening_sockets_are_read_from_proc_with_their_addresses() -> None:
    """Sockets this process listens on appear with their address and port; wildcard ones as 0.0.0.0/::."""
    with socket.socket() as local, socket.socket() as wide:
        local.bind(("127.0.0.1", 0))
        local.listen()
        wide.bind(("0.0.0.0", 0))
        wide.listen()
        table = listening_sockets()
        assert ("127.0.0.1", local.getsockname()[1]) in table
        assert ("0.0.0.0", wide.getsockname()[1]) in table


def test_the_proc_table_parser_reads_mapped_ipv6_and_skips_other_states() -> None:
    """A tcp6 row of ::ffff:10.213.0.1:6379 (LISTEN) reads as 10.213.0.1; an established row is skipped."""
    header = "  sl  local_address                         remote_address                        st\n"
    mapped = "0000000000000000FFFF00000100D50A"  # ::ffff:10.213.0.1, 32-bit words little-endian
    rows = (f"   0: {mapped}:18EB 00000000000000000000000000000000:0000 0A\n"
            f"   1: 00000000000000000000000000000000:2711 00000000000000000000000000000000:0000 0A\n"
            f"   2: {mapped}:18EC 0000000000000000FFFF00000200D50A:9C40 01\n")
    assert parse_table(header + rows) == [("10.213.0.1", 6379), ("::", 10001)]


def test_a_node_address_must_be_one_of_this_host() -> None:
    """Wildcards, non-addresses and addresses of other hosts are refused, naming the option; an IPv6 address
    only with --bind-to-address (the shim binds IPv4)."""
    for address, reason in (("0.0.0.0", "means every interface"), ("eth0", "is not an IP address"),
                            ("192.0.2.77", "is not an address of this host"),
                            ("::1", "--bind-to-address does not support an IPv6 node address")):
        with pytest.raises(NodeError, match=reason) as refused:
            check_node_address(address, bind_to_address=True)
        assert "--node-ip-address" in str(refused.value)
    check_node_address("127.0.0.1", bind_to_address=True)
    if socket.has_ipv6 and Path("/proc/net/if_inet6").exists():
        check_node_address("::1", bind_to_address=False)


def test_a_node_needs_token_authentication_unless_told_otherwise(tmp_path: Path) -> None:
    """Without RAY_AUTH_MODE=token, or with it and no token anywhere: refused, naming the variables."""
    with pytest.raises(NodeError, match="RAY_AUTH_MODE is not 'token'.*--no-token"):
        check_token({"HOME": str(tmp_path)}, head=True)
    with pytest.raises(NodeError, match="neither RAY_AUTH_TOKEN nor .*ray get-auth-token --generate"):
        check_token({"HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}, head=True)
    check_token({"HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "a" * 64}, head=False)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("b" * 64)
    check_token({"HOME": str(tmp_path), "RAY_AUTH_MODE": "token"}, head=False)


def test_ray_start_gets_every_port_pinned_and_the_users_options_last() -> None:
    """The head: GCS, client, dashboard off and every pinned port; a worker: the head's address. Options
    after `--` come last, and a port given there is the one the node is checked on."""
    head = ray_start_command(NodeSpec("10.0.0.5", resources={"trainer_host": 1}, labels={"role": "trainer"}))
    for expected in ("--head", "--port=6379", "--ray-client-server-port=10001", "--include-dashboard=false",
                     "--node-manager-port=6380", "--object-manager-port=6381", "--min-worker-port=11000",
                     "--max-worker-port=11099", "--metrics-export-port=6385", "--labels=role=trainer",
                     '--resources={"trainer_host": 1}', "--node-ip-address=10.0.0.5"):
        assert expected in head, expected
    worker = ray_start_command(NodeSpec("10.0.0.6", head_address="10.0.0.5:6379", extra=["--num-gpus=1"]))
    assert "--address=10.0.0.5:6379" in worker and "--head" not in worker and worker[-1] == "--num-gpus=1"
    ports = NodePorts().overridden(["--node-manager-port", "7000", "--max-worker-port=12000"])
    assert ports.node_manager == 7000 and 12000 in ports.of_node(head=False)
    assert 6379 not in ports.of_node(head=False)
    with pytest.raises(NodeError, match="--object-manager-port takes a port number"):
        NodePorts().overridden(["--object-manager-port=any"])


class FakeRayStart:
    """A stand-in for `ray start` that opens one socket on all interfaces (as Ray's own binding does) and
    keeps the environment it was given; the real `ray start` runs in the multi-host tests."""

    def __init__(self) -> None:
        self.opened: list[socket.socket] = []
        self.environment: dict[str, str] = {}

    def __call__(self, command: list[str], **options: object) -> subprocess.CompletedProcess[str]:
        self.environment = dict(options["env"])  # type: ignore[call-overload]
        wide = socket.socket()
        wide.bind(("0.0.0.0", 0))
        wide.listen()
        self.opened.append(wide)
        return subprocess.CompletedProcess(command, 0, "", "")

    def port(self) -> int:
        """The port of the socket it opened."""
        return self.opened[0].getsockname()[1]

    def close(self) -> None:
        """Close what it opened."""
        for wide in self.opened:
            wide.close()


# every port is the node's, so the stand-in's socket is on one of them
EVERY_PORT = ["--min-worker-port=1", "--max-worker-port=65535"]


def in_ranges(port: int, ranges: str) -> bool:
    """Whether `port` is in "6379-6381,10001"."""
    bounds = [part.partition("-") for part in ranges.split(",")]
    return any(int(low) <= port <= int(high or low) for low, _, high in bounds)


def test_by_default_a_node_needs_no_compiler_and_its_wildcard_listeners_are_reported(tmp_path: Path) -> None:
    """Without --bind-to-address: no shim is built (no compiler on PATH) or preloaded; the node's port found
    on all interfaces is reported, not refused, with the ports a firewall must guard."""
    ray_start = FakeRayStart()
    spec = NodeSpec("127.0.0.1", require_token=False, extra=EVERY_PORT)
    try:
        report = start_node(spec, {"PATH": str(tmp_path), "HOME": str(tmp_path)}, runner=ray_start)
        port = ray_start.port()
    finally:
        ray_start.close()
    assert "LD_PRELOAD" not in ray_start.environment and ADDRESS_VARIABLE not in ray_start.environment
    assert not list(tmp_path.iterdir())  # nothing built
    first, second = report.splitlines()[:2]
    assert "with Ray's own binding: on all interfaces at ports" in first
    assert in_ranges(port, first.rpartition("ports ")[2]), (port, first)
    assert "a firewall must let only the cluster's hosts reach ports 1-65535" in second
    assert "--bind-to-address" in second
    guarded = NodeSpec("10.0.0.5")
    assert ("reach ports 6379-6385,10001,11000-11099,44217,44227 "
            in describe(guarded, [("0.0.0.0", 6379)]))


def test_with_bind_to_address_a_node_found_listening_on_all_interfaces_is_refused(tmp_path: Path) -> None:
    """With --bind-to-address the shim is preloaded, and a node port on 0.0.0.0 after `ray start` (the shim
    did not take) fails `start_node`, naming the socket."""
    ray_start = FakeRayStart()
    spec = NodeSpec("127.0.0.1", require_token=False, bind_to_address=True, extra=EVERY_PORT)
    try:
        with pytest.raises(NodeError, match=r"listens on all interfaces at 0\.0\.0\.0:\d+"):
            start_node(spec, {**os.environ, "DETACHED_RL_CACHE_DIR": str(tmp_path)}, runner=ray_start)
    finally:
        ray_start.close()
    assert ray_start.environment[ADDRESS_VARIABLE] == "127.0.0.1"
    assert ray_start.environment["LD_PRELOAD"].startswith(str(tmp_path))


def test_the_command_refuses_bad_options_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`detached-rl node` with a wildcard address or malformed resources: exit 2, the option named."""
    assert main(["node", "--head", "--node-ip-address", "0.0.0.0", "--no-token"]) == 2
    assert "--node-ip-address 0.0.0.0 means every interface" in capsys.readouterr().err
    assert main(["node", "--head", "--node-ip-address", "127.0.0.1", "--resources", "{maker"]) == 2
    assert "--resources is not JSON" in capsys.readouterr().err
    assert main(["node", "--head", "--node-ip-address", "127.0.0.1", "--labels", "role"]) == 2
    assert "--labels: 'role' is not KEY=VALUE" in capsys.readouterr().err
    assert main(["node", "--head", "--node-ip-address", "127.0.0.1", "--listen-on-all-interfaces"]) == 2
    assert "--listen-on-all-interfaces is gone: Ray's own binding is the default" in capsys.readouterr().err


def test_the_commands_default_ports_are_the_nodes() -> None:
    """`detached-rl node`'s --port and --ray-client-server-port default to NodePorts' (one source)."""
    args = build_parser().parse_args(["node", "--head", "--node-ip-address", "127.0.0.1"])
    assert (args.port, args.ray_client_server_port) == (NodePorts().gcs, NodePorts().client)
    assert not args.bind_to_address
