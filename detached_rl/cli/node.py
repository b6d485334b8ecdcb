"""`detached-rl node`: start a Ray node of a multi-host cluster (the head, or a worker joining it) with token
authentication on and every port pinned; `--bind-to-address` also binds its sockets to the node's address
(docs/multi-host.md section 2)."""

from __future__ import annotations

import argparse
import json
import sys

from detached_rl.cli.arguments import EXIT_ERROR, int_at_least, non_negative_float
from detached_rl.node import NodeError, NodePorts, NodeSpec, start_node

PORT = int_at_least(1, 65535)
DEFAULT_PORTS = NodePorts()  # the one source of the node's default ports (node/start.py)


def _mapping(text: str, option: str) -> dict[str, str]:
    """"key=value,key2=value2" -> dict; refuses naming the option."""
    pairs = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, equals, value = item.partition("=")
        if not equals or not key:
            raise NodeError(f"{option}: {item!r} is not KEY=VALUE")
        pairs[key] = value
    return pairs


def _resources(text: str) -> dict[str, float]:
    """--resources as `ray start` takes it (a JSON object of amounts)."""
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as error:
        raise NodeError(f"--resources is not JSON ({error.msg}): e.g. '{{\"maker_host\": 1}}'") from error
    amounts = parsed.values() if isinstance(parsed, dict) else ()
    if not isinstance(parsed, dict) or not all(isinstance(v, int | float) and v >= 0 for v in amounts):
        raise NodeError("--resources must map names to non-negative amounts, e.g. '{\"maker_host\": 1}'")
    return {str(key): float(value) for key, value in parsed.items()}


def add_node_command(commands: argparse._SubParsersAction) -> None:
    """Register `detached-rl node`."""
    node = commands.add_parser(
        "node", help="start a Ray node of a multi-host cluster: token auth required, ports pinned",
        description="Start the head (--head) or a worker node (--address HEAD:PORT) with `ray start`: token "
                    "authentication required, ports pinned (docs/multi-host.md section 6), then report which "
                    "of them listen on all interfaces (Ray's own binding) and what a firewall must guard. "
                    "--bind-to-address binds them to --node-ip-address and 127.0.0.1 instead (a preloaded "
                    "bind shim, built once with the C compiler). More `ray start` options after `--`; stop "
                    "the node with `ray stop`.")
    where = node.add_mutually_exclusive_group(required=True)
    where.add_argument("--head", action="store_true", help="start the head node")
    where.add_argument("--address", default=None, help="join the head at HOST:PORT (its GCS)")
    node.add_argument("--node-ip-address", required=True,
                      help="this host's address, the one the other hosts reach it at")
    node.add_argument("--port", type=PORT, default=DEFAULT_PORTS.gcs,
                      help=f"the head's GCS port (default {DEFAULT_PORTS.gcs})")
    node.add_argument("--ray-client-server-port", type=PORT, default=DEFAULT_PORTS.client,
                      help=f"the head's Ray client port (default {DEFAULT_PORTS.client})")
    node.add_argument("--resources", default=None, help="custom resources, JSON: '{\"maker_host\": 1}'")
    node.add_argument("--labels", default=None, help="node labels: role=maker,zone=a")
    node.add_argument("--num-cpus", type=non_negative_float, default=None)
    node.add_argument("--num-gpus", type=non_negative_float, default=None)
    node.add_argument("--dashboard", action="store_true",
                      help="start the dashboard on the head (127.0.0.1:8265; needed by `ray job submit`)")
    node.add_argument("--bind-to-address", action="store_true",
                      help="bind the node's ports to --node-ip-address and 127.0.0.1, none to all interfaces "
                           "(preloads a bind shim into Ray's processes; needs a C compiler once)")
    node.add_argument("--listen-on-all-interfaces", action="store_true", help=argparse.SUPPRESS)
    node.add_argument("--no-token", action="store_true", help="start without token authentication")
    node.add_argument("ray_start", nargs=argparse.REMAINDER,
                      help="-- then more `ray start` options (e.g. -- --object-store-memory=2000000000)")
    node.set_defaults(handler=run_node)


def run_node(args: argparse.Namespace) -> int:
    """Handler of `detached-rl node`."""
    extra = list(args.ray_start)
    if extra and extra[0] == "--":
        extra = extra[1:]
    try:
        if args.listen_on_all_interfaces:
            raise NodeError("--listen-on-all-interfaces is gone: Ray's own binding is the default now (drop "
                            "the option; --bind-to-address binds the node's ports to its address)")
        spec = NodeSpec(node_ip_address=args.node_ip_address,
                        head_address=None if args.head else args.address,
                        resources=_resources(args.resources) if args.resources else None,
                        labels=_mapping(args.labels, "--labels") if args.labels else None,
                        num_cpus=args.num_cpus, num_gpus=args.num_gpus, dashboard=args.dashboard,
                        bind_to_address=args.bind_to_address,
                        require_token=not args.no_token, extra=extra,
                        ports=NodePorts(gcs=args.port, client=args.ray_client_server_port))
        print(start_node(spec))
    except NodeError as error:
        print(f"detached-rl: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    return 0
