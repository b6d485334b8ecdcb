"""A swarm: one trainer host behind a thin uplink, K maker hosts on mixed links, the default job.

    .venv/bin/python benchmarks/bench_swarm.py                                   # K = 1, 2, 4 (long)
    .venv/bin/python benchmarks/bench_swarm.py --config examples/jobs/tiny.yaml --makers 1,2,4 --steps 8

Needs root (the multi-host harness, `tests/hosts/`). For each K, fresh hosts: h0 (resource trainer_host: the
trainer and the run's driver) with its link shaped to `--uplink` Mbit/s (20), and h1..hK (resource
maker_host: one maker each), their links cycling through `--maker-rates` (100, 20, 5 Mbit/s) with
`--delay` ms one-way latency (50) and `--loss` % frames lost (0.5) each way (netem where the kernel has
it, else the harness's user-space wire). All hosts share one bridge, so h0's own link is the one every
maker's weights leave through. One `detached-rl run --makers K` typed on h0 per K.

Per K: trainer steps/s (metrics `time/elapsed`, step 1 to the last); bytes out of h0 per version pushed
(h0's link counters over the run / versions 0..last) and its ratio to K = 1's; delivery time per maker
host (from the trainer reaching v to that maker holding v or newer, status polled every 0.5 s: median and
max), with the samples its trainer took from it and the seconds it waited for fresh weights; the staleness
histogram of the samples trained on (`staleness/hist_N` summed over steps); samples
dropped as stale; the run's wall time. JSON to benchmarks/results/swarm.json, a plot with `--plot`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_thin_links import (  # noqa: E402
    WATCH,
    delivery,
    numbers,
    read_json_lines,
    save,
    sent_bytes,
    stop_group,
)

from detached_rl.cli.reporting import EVAL_ROW  # noqa: E402
from tests.hosts import Hosts, LinkCharacter  # noqa: E402  (bench_thin_links put the repository on the path)
from tests.hosts.network import NetworkError, require_tools  # noqa: E402

TRAINER = 0
HOME = "/tmp/drl-hostfs/home"
# Where each maker runs: name -> its node IP, from its own answer (`transfer_progress` names its host).
PLACEMENT = """
import json, sys, ray
ray.init(address=sys.argv[1], namespace="detached_rl", log_to_driver=False)
found = {}
for name in sys.argv[2].split(","):
    try:
        found[name] = ray.get(ray.get_actor(name).transfer_progress.remote(), timeout=20)["host"]
    except Exception:
        pass
print(json.dumps(found))
"""


def maker_links(count: int, rates: list[float], character: LinkCharacter) -> tuple[dict, dict]:
    """Rates and link characters of hosts 1..count: rates cycle through `rates`."""
    return ({index: rates[(index - 1) % len(rates)] for index in range(1, count + 1)},
            {index: character for index in range(1, count + 1)} if not character.plain else {})


def staleness_histogram(rows: list[dict[str, Any]]) -> dict[int, int]:
    """Samples trained on, by staleness (versions behind), summed over the steps."""
    histogram: dict[int, int] = {}
    for row in rows:
        for key, value in row.items():
            if key.startswith("staleness/hist_"):
                lag = int(key.rsplit("_", 1)[1])
                histogram[lag] = histogram.get(lag, 0) + int(value)
    return dict(sorted(histogram.items()))


def run_swarm(args: argparse.Namespace, makers: int, logs: Path) -> dict[str, Any]:
    """Fresh hosts for `makers` makers, one run: its figures, or {"error": ...}."""
    rates, links = maker_links(makers, args.maker_rates, LinkCharacter(args.delay, 0.0, args.loss / 100))
    name = f"swarm-{makers}"
    resources = {TRAINER: {"trainer_host": 1}, **{i: {"maker_host": 1} for i in range(1, makers + 1)}}
    started = time.monotonic()
    with Hosts(1 + makers, rates_mbit={TRAINER: args.uplink, **rates}, links=links, resources=resources,
               cpus={TRAINER: 3, **{i: 1 for i in range(1, makers + 1)}}) as hosts:
        emulation = hosts.network.emulation or "no"
        print(f"K={makers}: hosts up in {time.monotonic() - started:.0f} s ({emulation} link emulation), "
              f"maker links {rates} Mbit/s", flush=True)
        output = f"{HOME}/swarm"
        command = ["detached-rl", "run", "--address", hosts.head_address, "--makers", str(makers), "--steps",
                   str(args.steps), "--name", name, "--output", output, "--no-progress"]
        command += ["--config", str(Path(args.config).resolve())] if args.config else []
        for value in ["trainer_group.resources={trainer_host: 1}", "maker.resources={maker_host: 1}",
                      "run.examples=0", f"run.timeout_s={args.timeout:.0f}", *args.set]:
            command += ["--set", value]
        names = [f"{name}-trainer", *(f"{name}-maker-{i}" for i in range(makers))]
        watcher = hosts.popen(TRAINER, [sys.executable, "-c", WATCH, hosts.head_address, "detached_rl",
                                        ",".join(names), str(args.timeout + 60)], log=logs / f"{name}.watch")
        run = None
        begin = time.monotonic()
        try:
            before = hosts.counters(TRAINER)
            run = hosts.popen(TRAINER, command, log=logs / f"{name}.log")
            placement: dict[str, str] = {}
            while run.poll() is None and time.monotonic() - begin < args.timeout + 120:
                if len(placement) < len(names) - 1:
                    try:  # makers still starting (the default job's load their models) may not answer yet
                        asked = hosts.run(TRAINER, [sys.executable, "-c", PLACEMENT, hosts.head_address,
                                                    ",".join(names[1:])], timeout=90)
                    except subprocess.TimeoutExpired:
                        continue
                    if asked.returncode == 0 and asked.stdout.strip():
                        found = json.loads(asked.stdout.strip().splitlines()[-1])
                        placement.update({k: v for k, v in found.items() if k in names})
                time.sleep(2)
            if run.poll() is None:
                return {"makers": makers, "error": f"no end within {args.timeout + 120:.0f} s"}
            after = hosts.counters(TRAINER)
            wall = time.monotonic() - begin
            if run.returncode != 0:
                tail = (logs / f"{name}.log").read_text().strip().splitlines()[-3:]
                return {"makers": makers, "error": f"run exited {run.returncode}: {' | '.join(tail)}"}
            with contextlib.suppress(subprocess.TimeoutExpired):
                watcher.wait(timeout=30)
            metrics = hosts.run(TRAINER, ["cat", f"{output}/{name}/metrics.jsonl"], check=True).stdout
            (logs / f"{name}.metrics.jsonl").write_text(metrics)
            rows = sorted((r for r in read_json_lines(metrics) if r.get("kind") != EVAL_ROW),
                          key=lambda r: r["step"])
            events = read_json_lines((logs / f"{name}.watch").read_text())
            return figures(rows, events, after["sent"] - before["sent"], name, makers, rates, placement,
                           hosts, wall)
        finally:
            for process in (run, watcher):
                if process is not None:
                    stop_group(process)


def figures(rows: list[dict[str, Any]], events: list[dict[str, Any]], out_bytes: int, name: str,
            makers: int, rates: dict[int, float], placement: dict[str, str], hosts: Hosts,
            wall: float) -> dict[str, Any]:
    """One K's figures (see the module docstring)."""
    span = rows[-1]["time/elapsed"] - rows[0]["time/elapsed"] if len(rows) > 1 else float("nan")
    versions = 1 + int(max(row.get("policy_version", 0.0) for row in rows))
    address_rate = {hosts.host(i).address: rate for i, rate in rates.items()}
    per_host = {}
    for index in range(makers):
        maker = f"{name}-maker-{index}"
        waits = delivery(events, f"{name}-trainer", [maker], int(rows[-1]["step"]))
        host = placement.get(maker, "?")
        last = next((e for e in reversed(events) if e.get("name") == maker and "accepted" in e), {})
        per_host[maker] = {"host": host, "rate_mbit": address_rate.get(host),
                           "samples_accepted": last.get("accepted"),
                           "waited_for_weights_s": last.get("waited_s"),
                           "delivery_s_median": statistics.median(waits) if waits else float("nan"),
                           "delivery_s_max": max(waits, default=float("nan"))}
    return {"makers": makers, "steps": len(rows),
            "steps_per_s": (len(rows) - 1) / span if span else float("nan"),
            "versions_pushed": versions, "uplink_out_bytes": out_bytes,
            "uplink_out_per_version": out_bytes / versions,
            "update_bytes": statistics.median(sent_bytes(r) for r in rows if "weight_sync/bytes" in r),
            "per_maker": per_host, "staleness_histogram": staleness_histogram(rows),
            "dropped_stale": max((row.get("buffer/dropped_stale", 0.0) for row in rows), default=0.0),
            "wall_s": wall}


def report(table: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The table; bytes out per version as a ratio of K = 1's."""
    job = args.config or "the default job (SmolLM2-135M + LoRA, vLLM makers)"
    print(f"\n{job}; trainer uplink {args.uplink:g} Mbit/s; maker links {args.maker_rates} Mbit/s, "
          f"{args.delay:g} ms, {args.loss:g} % loss; {platform.machine()}, {os.cpu_count()} cores (shared)")
    one = next((c["uplink_out_per_version"] for c in table if c.get("makers") == 1 and "steps" in c), None)
    for cell in table:
        if "error" in cell:
            print(f"K={cell['makers']}: failed: {cell['error'][:300]}")
            continue
        ratio = cell["uplink_out_per_version"] / one if one else float("nan")
        cell["uplink_ratio_to_one"] = ratio
        versus = f"{ratio:.2f}x K=1" if one else "K=1 not run"
        hosts = "; ".join(f"{m['rate_mbit']} Mbit/s {m['delivery_s_median']:.1f}/{m['delivery_s_max']:.1f} s "
                          f"({m['samples_accepted']} samples taken, {m['waited_for_weights_s']} s waiting)"
                          for m in cell["per_maker"].values())
        print(f"K={cell['makers']}: {cell['steps_per_s']:.3f} steps/s; out of h0 "
              f"{cell['uplink_out_per_version'] / 1e6:.2f} MB/version ({versus}; one update "
              f"{cell['update_bytes'] / 1e6:.2f} MB); delivery median/max {hosts}; staleness "
              f"{cell['staleness_histogram']}; dropped stale {cell['dropped_stale']:.0f}; "
              f"{cell['wall_s']:.0f} s")


def plot(table: list[dict[str, Any]], path: Path) -> None:
    """Bytes out of the trainer's host per version, and steps/s, against K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in table if "steps" in c]
    fig, (size, speed) = plt.subplots(1, 2, figsize=(9, 3.5))
    size.plot([c["makers"] for c in cells], [c["uplink_out_per_version"] / 1e6 for c in cells], "o-",
              label="out of the trainer's host")
    size.plot([c["makers"] for c in cells], [c["update_bytes"] / 1e6 for c in cells], "x:",
              label="one update")
    speed.plot([c["makers"] for c in cells], [c["steps_per_s"] for c in cells], "o-")
    size.set_ylabel("MB per version")
    speed.set_ylabel("trainer steps/s")
    for axis in (size, speed):
        axis.set_xlabel("maker hosts K")
        axis.set_ylim(bottom=0)
    size.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def add_link_arguments(parser: argparse.ArgumentParser) -> None:
    """The swarm's links (the trainer's uplink; the maker hosts' rates, delay and loss) and more overrides."""
    parser.add_argument("--uplink", type=float, default=20.0, help="Mbit/s of the trainer host's link")
    parser.add_argument("--maker-rates", type=numbers, default=[100.0, 20.0, 5.0],
                        help="Mbit/s of the maker hosts' links, cycled")
    parser.add_argument("--delay", type=float, default=50.0, help="one-way ms of each maker host's link")
    parser.add_argument("--loss", type=float, default=0.5, help="percent of frames a maker link loses")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another override")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="job config (default: none, the default job)")
    parser.add_argument("--makers", default="1,2,4", help="K values: maker hosts, one maker each")
    parser.add_argument("--steps", type=int, default=8)
    add_link_arguments(parser)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "swarm.json")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=Path(__file__).parent / "results" / "swarm-logs")
    args = parser.parse_args()
    counts = [int(k) for k in numbers(args.makers)]
    if not counts or min(counts) < 1:
        parser.error(f"--makers: give K >= 1, got {args.makers!r}")
    try:
        require_tools()
    except NetworkError as error:
        sys.exit(f"bench_swarm: {error}")
    args.logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    table = []
    for makers in counts:
        try:
            cell = run_swarm(args, makers, args.logs)
        except Exception as error:  # noqa: BLE001 - a failed K is reported, the next one runs
            cell = {"makers": makers, "error": f"{type(error).__name__}: {error}"}
        table.append(cell)
        print(json.dumps(cell, default=str), flush=True)
    report(table, args)
    print(f"benchmark wall time {time.monotonic() - started:.0f} s")
    save(args, table, plot)


if __name__ == "__main__":
    main()
