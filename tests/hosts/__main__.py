"""`python -m tests.hosts up|exec|down`, typed in the repository: several hosts with a Ray node each on this
machine (root)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .cluster import Hosts, tear_down, tool_bin
from .network import NetworkError
from .wire import LinkCharacter


def _pairs(values: list[str], convert: type = float) -> dict[int, object]:
    """["1=20", "2=5"] -> {1: 20.0, 2: 5.0}."""
    parsed: dict[int, object] = {}
    for value in values:
        index, _, rest = value.partition("=")
        if not index.isdigit() or not rest:
            raise SystemExit(f"hosts: {value!r} is not HOST=VALUE (e.g. 1=20)")
        parsed[int(index)] = convert(rest)
    return parsed


def _mapping(text: str) -> dict[str, object]:
    """"maker_host:1,gpu_kind:a" -> {"maker_host": "1", ...}."""
    return dict(item.split(":", 1) for item in text.split(",") if item)


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m tests.hosts", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="build N hosts, shape their links, start a Ray node on each")
    up.add_argument("--hosts", type=int, default=2)
    up.add_argument("--rate", action="append", default=[], metavar="HOST=MBIT", help="shape a host's link")
    up.add_argument("--delay", action="append", default=[], metavar="HOST=MS",
                    help="one-way latency of a host's link, each way")
    up.add_argument("--jitter", action="append", default=[], metavar="HOST=MS",
                    help="spread of that latency (uniform, in order)")
    up.add_argument("--loss", action="append", default=[], metavar="HOST=PERCENT",
                    help="frames a host's link loses, each way")
    up.add_argument("--cpus", action="append", default=[], metavar="HOST=N")
    up.add_argument("--resources", action="append", default=[], metavar="HOST=NAME:AMOUNT,...")
    up.add_argument("--labels", action="append", default=[], metavar="HOST=KEY:VALUE,...")
    up.add_argument("--no-token", action="store_true", help="start the cluster without token auth")
    up.add_argument("--no-ray", action="store_true", help="only the hosts and their links, no Ray nodes")
    up.add_argument("--ray-start", action="store_true",
                    help="start the nodes with plain `ray start` instead of `detached-rl node`")
    up.add_argument("--bind-to-address", action="store_true",
                    help="detached-rl node --bind-to-address: the nodes listen on their host's address only")
    run = commands.add_parser("exec", help="run a command on a host: exec WORKDIR HOST -- command ...")
    run.add_argument("workdir", type=Path)
    run.add_argument("host", type=int)
    run.add_argument("args", nargs=argparse.REMAINDER)
    down = commands.add_parser("down", help="stop every process on the hosts and remove them")
    down.add_argument("workdir", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            resources = {i: {k: float(v) for k, v in _mapping(str(t)).items()}
                         for i, t in _pairs(args.resources, str).items()}
            delays, jitters, losses = _pairs(args.delay), _pairs(args.jitter), _pairs(args.loss)
            links = {i: LinkCharacter(float(delays.get(i, 0.0)), float(jitters.get(i, 0.0)),  # type: ignore
                                      float(losses.get(i, 0.0)) / 100.0)  # type: ignore[arg-type]
                     for i in {*delays, *jitters, *losses}}
            hosts = Hosts(args.hosts, _pairs(args.rate), cpus=_pairs(args.cpus),  # type: ignore[arg-type]
                          links=links,
                          resources=resources, token=not args.no_token, bind_to_address=args.bind_to_address,
                          start_with="ray start" if args.ray_start else "detached-rl node",
                          labels={i: _mapping(str(t)) for i, t in _pairs(args.labels, str).items()})
            hosts.up(nodes=not args.no_ray)
            print(json.dumps({"workdir": str(hosts.workdir), "head": hosts.head_address,
                              "client": hosts.client_address,
                              "hosts": [h.address for h in hosts.hosts]}, indent=1))
            print(f"run on host 1: python -m tests.hosts exec {hosts.workdir} 1 -- detached-rl status "
                  f"--address {hosts.head_address}\ntear down:     python -m tests.hosts down "
                  f"{hosts.workdir}")
            return 0
        if args.command == "exec":
            state = json.loads((args.workdir / "network.json").read_text())
            command = args.args[1:] if args.args[:1] == ["--"] else args.args
            if not command:
                raise SystemExit("hosts: exec: no command (exec WORKDIR HOST -- command ...)")
            if not 0 <= args.host < len(state["hosts"]):
                last = len(state["hosts"]) - 1
                raise SystemExit(f"hosts: exec: host {args.host}: there are hosts 0 to {last}")
            anchor = state["hosts"][args.host]["anchor_pid"]
            # this install's scripts first (`detached-rl`, `ray`), as on the hosts of `Hosts.run`
            env = {"PATH": f"{tool_bin()}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                   "HOME": "/tmp/drl-hostfs/home", "LANG": "C.UTF-8", "RAY_USAGE_STATS_ENABLED": "0"}
            if os.environ.get("PYTHONPATH"):  # the same code on every host, as in `Hosts.environment`
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
            if state.get("token"):
                env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=state["token"])
            argv_ = ["nsenter", f"--target={anchor}", "--net", "--mount", "--pid", "--", "env", "-i",
                     "--chdir=/tmp/drl-hostfs/home", *(f"{k}={v}" for k, v in env.items()), *command]
            os.execvp(argv_[0], argv_)
        tear_down(args.workdir)
        print(f"removed {args.workdir}")
        return 0
    except (NetworkError, OSError) as error:  # HostsError is a NetworkError
        print(f"hosts: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
