"""Thin links: the default job, trainer on one host and 2 makers on another, per link rate and update mode.

    .venv/bin/python benchmarks/bench_thin_links.py                          # every rate and mode (long)
    .venv/bin/python benchmarks/bench_thin_links.py --rates 20 --modes lora  # make bench: one cell + baseline
    .venv/bin/python benchmarks/bench_thin_links.py --config examples/jobs/tiny.yaml --rates 100,20  # quick

Needs root (the multi-host harness, `tests/hosts/`: network namespaces, `tc tbf`). Two hosts: h0
(label role=trainer) and h1 (role=maker), h1's link shaped to each rate in turn. Each cell is one
`detached-rl run --address <head> --makers 2` typed on h0 with `trainer_group.label_selector={role:
trainer}` and `maker.label_selector={role: maker}`: trainer and driver on h0, both makers on h1. The
baseline, measured in the same run on the same cluster, is the same job with its makers on h0 too
(`maker.label_selector={role: trainer}`): one host, nothing on the link.

Per cell: h1's link counters (`Hosts.counters`, the bridge port's own byte counts) before and after the
run, divided by the weight versions the trainer pushed (0 to the last `policy_version`);
one update's bytes as the makers are sent it (`weight_sync/bytes/wire/...` in the run's metrics.jsonl: in
the dtype they serve, bf16 for vLLM makers, a delta where one is sent; else `weight_sync/bytes`, the
trainer's) and the ratio of the two; delivery time
(a watcher on h0 polls every actor's status every 0.5 s: from the poll that first shows the trainer at
version v to the one that first shows a maker holding v or newer, acknowledged or swapped in; median and
max over makers and versions; the trainer's `weight_sync/push_s` beside it, which with overlapped pushes,
the default, is only the time to offer an update); trainer steps/s from step 1 to the last step (metrics
`time/elapsed`); staleness (`staleness/mean`, `staleness/max`, `buffer/dropped_stale`); held-out lift
(accuracy after - before, points, summary.json); the run's wall time. Modes: lora (the defaults), full
(`trainer.weight_sync=full`), delta (full + `trainer.sparse_deltas=true` + `maker.weight_cast_dtype=bfloat16`;
skipped, saying why, where the config refuses a key). A cell whose updates cannot cross in time
(estimated from the mode's update bytes measured at a faster rate) is skipped and said so; a failed cell
is reported and the next one runs. JSON to benchmarks/results/thin-links.json (or `--json`), a plot
with `--plot`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from detached_rl.cli.reporting import EVAL_ROW
from detached_rl.cli.run_setup import run_config

# The harness is test support in the repository (tests/hosts/), not part of the installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.hosts import Hosts  # noqa: E402
from tests.hosts.network import NetworkError, require_tools  # noqa: E402

TRAINER, MAKER = 0, 1
HOME = "/tmp/drl-hostfs/home"
MODES = {
    "lora": [],
    "full": ["trainer.weight_sync=full"],
    "delta": ["trainer.weight_sync=full", "trainer.sparse_deltas=true", "maker.weight_cast_dtype=bfloat16"],
}

# Polls the run's actors from h0 until its trainer has come and gone (or the time is up); prints a JSON
# line whenever an actor's versions change, stamped with time.time() (the machine's clock: every host
# of the harness shares it).
WATCH = """
import json, sys, time, ray
address, namespace, names, timeout = sys.argv[1], sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])
ray.init(address=address, namespace=namespace, log_to_driver=False)
print(json.dumps({"t": time.time(), "watching": True}), flush=True)
handles, last, seen, deadline = {}, {}, set(), time.monotonic() + timeout
while time.monotonic() < deadline:
    for name in names:
        if name not in handles and name not in seen:
            try:
                handles[name] = ray.get_actor(name, namespace=namespace)
                seen.add(name)
            except ValueError:
                pass
    refs = {name: handle.status.remote() for name, handle in handles.items()}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0) if refs else ([], [])
    now = time.time()
    for name, ref in refs.items():
        if ref not in ready:
            continue
        try:
            row = ray.get(ref)
        except Exception:
            handles.pop(name)  # ended: the run removes its actors
            continue
        updates = row.get("weight_updates") or {}
        keep = {"version": row.get("policy_version"), "pending": updates.get("pending_version"),
                "received": updates.get("received"), "superseded": updates.get("superseded"),
                "state": row.get("state")}
        pushed = row.get("push") or {}  # a maker's: samples its trainers took, seconds it waited for weights
        if pushed:
            keep["accepted"] = sum(t.get("accepted", 0) for t in pushed.get("per_trainer", {}).values())
            keep["waited_s"] = round((row.get("fresh_weight_waits") or {}).get("seconds", 0.0), 1)
        push = row.get("weight_push") or {}  # the trainer's: who relays to whom
        keep.update({key: push[key] for key in ("relay_tree", "relayed", "relay_fallbacks", "failed")
                     if key in push})
        if keep != last.get(name):
            last[name] = keep
            print(json.dumps({"t": now, "name": name, **keep}), flush=True)
    if names[0] in seen and names[0] not in handles:
        break
    time.sleep(0.5)
"""


def cell_overrides(mode: str, rate: float | None, eval_size: int | None, timeout: float,
                   extra: list[str] | None = None) -> list[str]:
    """The `--set` values of one cell: its mode, where its makers go, the run's own time limit, `extra`."""
    makers_on = "maker" if rate else "trainer"  # the baseline: makers on the trainer's host
    sets = [*MODES[mode], "trainer_group.label_selector={role: trainer}",
            f"maker.label_selector={{role: {makers_on}}}", "run.examples=0", f"run.timeout_s={timeout:.0f}"]
    return sets + ([f"task.eval_size={eval_size}"] if eval_size else []) + list(extra or [])


def refused(config: str | None, mode: str, extra: list[str] | None = None) -> str | None:
    """Why the config refuses `mode`'s keys (e.g. a key not built yet) or `extra`, or None."""
    try:
        run_config(config, [*MODES[mode], *(extra or [])])
    except Exception as error:  # noqa: BLE001 - any refusal is a reason to skip the mode
        return f"{type(error).__name__}: {error}"
    return None


def first_times(events: list[dict[str, Any]], name: str, versions: range) -> dict[int, float]:
    """For each version v, the first poll time at which actor `name` held v or newer (swapped or waiting)."""
    times: dict[int, float] = {}
    for event in events:
        if event.get("name") != name:
            continue
        held = max(v for v in (event.get("version"), event.get("pending"), -1) if isinstance(v, int))
        for version in versions:
            if version <= held:
                times.setdefault(version, event["t"])
    return times


def delivery(events: list[dict[str, Any]], trainer: str, makers: list[str], last: int) -> list[float]:
    """Seconds from the trainer reaching version v to each maker holding v or newer (v = 1..last)."""
    versions = range(1, last + 1)
    pushed = first_times(events, trainer, versions)
    seconds = []
    for maker in makers:
        for version, held in first_times(events, maker, versions).items():
            if version in pushed:
                seconds.append(max(held - pushed[version], 0.0))
    return seconds


def figures(rows: list[dict[str, Any]], summary: dict[str, Any], events: list[dict[str, Any]],
            link: dict[str, int], name: str, makers: int) -> dict[str, Any]:
    """The cell's figures from its metrics rows, summary.json, the watcher's events and the link's bytes."""
    rows = sorted(rows, key=lambda row: row["step"])
    span = rows[-1]["time/elapsed"] - rows[0]["time/elapsed"] if len(rows) > 1 else float("nan")
    # versions are numbered from 0 (the registration's) without gaps, one per step; policy_version too, since
    # a row may lack the weight_sync/* keys of its step
    keys = ("weight_sync/version", "policy_version")
    pushed = 1 + int(max(row.get(key, 0.0) for row in rows for key in keys))
    update = statistics.median(sent_bytes(row) for row in rows if "weight_sync/bytes" in row)
    trainer_update = statistics.median(row["weight_sync/bytes"] for row in rows if "weight_sync/bytes" in row)
    maker_names = [f"{name}-maker-{i}" for i in range(makers)]
    received = [max((e.get("received") or 0 for e in events if e.get("name") == m), default=0)
                for m in maker_names]
    waits = delivery(events, f"{name}-trainer", maker_names, int(rows[-1]["step"]))
    before, after = summary.get("held_out_before", {}), summary.get("held_out_after", {})
    lift = (100 * (after["accuracy"] - before["accuracy"])
            if "accuracy" in before and "accuracy" in after else float("nan"))
    return {
        "steps": len(rows), "steps_per_s": (len(rows) - 1) / span if span else float("nan"),
        "link_in_bytes": link["received"], "link_out_bytes": link["sent"],
        "versions_pushed": pushed, "updates_acknowledged_per_maker": received,
        "link_in_per_version": link["received"] / pushed,
        "update_bytes": update, "trainer_update_bytes": trainer_update,
        "link_per_update_ratio": link["received"] / pushed / update,
        "delivery_s_median": statistics.median(waits) if waits else float("nan"),
        "delivery_s_max": max(waits, default=float("nan")), "delivery_samples": len(waits),
        # the trainer's own time to offer (overlapped pushes, the default) or deliver an update
        "push_s_median": statistics.median(row.get("weight_sync/push_s", float("nan")) for row in rows),
        "superseded": max((row.get("weight_sync/superseded", 0.0) for row in rows), default=0.0),
        "staleness_mean": statistics.mean(row.get("staleness/mean", 0.0) for row in rows),
        "staleness_max": max(row.get("staleness/max", 0.0) for row in rows),
        "dropped_stale": max(row.get("buffer/dropped_stale", 0.0) for row in rows),
        "held_out_lift_points": lift, "run_seconds": summary.get("seconds", float("nan")),
    }


def sent_bytes(row: dict[str, Any]) -> float:
    """One version's bytes as the makers are sent it: a delta's, else the update in their wire dtype, else
    the trainer's own update."""
    for prefix in ("weight_sync/bytes/wire/delta/", "weight_sync/bytes/wire/"):
        sizes = [value for key, value in row.items() if key.startswith(prefix)]
        if sizes:
            return min(sizes)
    return row["weight_sync/bytes"]


def read_json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among `text`'s lines (other lines skipped)."""
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                found.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return found


def stop_group(process: subprocess.Popen[str]) -> None:
    """End a command this script started on a host, with the processes of its session (by its group id)."""
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def run_cell(hosts: Hosts, args: argparse.Namespace, mode: str, rate: float | None, steps: int,
             logs: Path, repeat: int = 0) -> dict[str, Any]:
    """One `detached-rl run` on the cluster: its figures, or {"error": ...} naming what went wrong."""
    name = f"tl-{mode}-{f'{rate:g}'.replace('.', '_') if rate else 'local'}-{repeat}"
    hosts.shape(MAKER, rate)
    output = f"{HOME}/thin-links"
    command = ["detached-rl", "run", "--address", hosts.head_address, "--makers", str(args.makers),
               "--steps", str(steps), "--name", name, "--output", output, "--no-progress"]
    command += ["--config", str(Path(args.config).resolve())] if args.config else []
    for value in cell_overrides(mode, rate, args.eval_size, args.cell_timeout, args.set):
        command += ["--set", value]
    names = [f"{name}-trainer", *(f"{name}-maker-{i}" for i in range(args.makers))]
    watch_args = [sys.executable, "-c", WATCH, hosts.head_address, "detached_rl", ",".join(names),
                  str(args.cell_timeout + 60)]
    watcher = hosts.popen(TRAINER, watch_args, log=logs / f"{name}.watch")
    run = None
    start = time.monotonic()
    try:
        before = hosts.counters(MAKER)
        run = hosts.popen(TRAINER, command, log=logs / f"{name}.log")
        try:
            run.wait(timeout=args.cell_timeout + 120)
        except subprocess.TimeoutExpired:
            return {"error": f"no end within {args.cell_timeout + 120:.0f} s"}
        after = hosts.counters(MAKER)
        wall = time.monotonic() - start
        if run.returncode != 0:
            lines = (logs / f"{name}.log").read_text().strip().splitlines() or [""]
            why = next((line for line in reversed(lines) if "error" in line.lower()), lines[-1])
            return {"error": f"detached-rl run exited {run.returncode}: {why}", "wall_s": wall}
        with contextlib.suppress(subprocess.TimeoutExpired):
            watcher.wait(timeout=30)  # it ends once the trainer is gone
        directory = f"{output}/{name}"
        metrics = hosts.run(TRAINER, ["cat", f"{directory}/metrics.jsonl"], check=True).stdout
        (logs / f"{name}.metrics.jsonl").write_text(metrics)
        rows = [row for row in read_json_lines(metrics) if row.get("kind") != EVAL_ROW]  # training steps
        summary_text = hosts.run(TRAINER, ["cat", f"{directory}/summary.json"], check=True).stdout
        (logs / f"{name}.summary.json").write_text(summary_text)
        summary = json.loads(summary_text)
        events = read_json_lines((logs / f"{name}.watch").read_text())
        link = {way: after[way] - before[way] for way in after}
        return {**figures(rows, summary, events, link, name, args.makers), "wall_s": wall}
    except Exception as error:  # noqa: BLE001 - a failed cell is reported, the next one runs
        return {"error": f"{type(error).__name__}: {error}", "wall_s": time.monotonic() - start}
    finally:
        for process in (run, watcher):
            if process is not None:
                stop_group(process)
        # whatever the run left (a cell that timed out): its actors, its directory
        for cleanup in (["detached-rl", "stop", "--force", "--address", hosts.head_address],
                        ["rm", "-rf", f"{output}/{name}"]):
            try:
                hosts.run(TRAINER, cleanup, timeout=120)
            except subprocess.TimeoutExpired:
                print(f"{name}: `{' '.join(cleanup[:3])}` did not end within 120 s", flush=True)


def idle_rate(hosts: Hosts, seconds: float = 10.0) -> dict[str, float]:
    """Bytes/s h1's link carries with no job running (Ray's heartbeats and reports)."""
    before = hosts.counters(MAKER)
    time.sleep(seconds)
    after = hosts.counters(MAKER)
    return {way: (after[way] - before[way]) / seconds for way in after}


def too_slow(update_bytes: float | None, rate: float, steps: int, timeout: float) -> str | None:
    """Why a cell would not finish in `timeout` s (its updates alone, at the link's rate), or None."""
    if update_bytes is None:
        return None
    seconds = (steps + 1) * update_bytes * 8 / (rate * 1e6)
    if seconds > 0.8 * timeout:
        return (f"{steps + 1} updates of {update_bytes / 1e6:.0f} MB at {rate:g} Mbit/s take about "
                f"{seconds / 60:.0f} min, over --cell-timeout {timeout:.0f} s (raise it, or lower the steps)")
    return None


def measure_mode(hosts: Hosts, args: argparse.Namespace, mode: str, rates: list[float], steps: int,
                 logs: Path) -> list[dict[str, Any]]:
    """A mode's cells, the baseline first, each rate `--repeats` times (interleaved: load that drifts hits
    them alike); each cell the median of its runs that succeeded, its runs kept."""
    places: list[float | None] = ([] if args.no_baseline else [None]) + rates
    runs: dict[float | None, list[dict[str, Any]]] = {place: [] for place in places}
    skipped: dict[float | None, str] = {}
    update_bytes = None
    for repeat in range(args.repeats):
        for rate in places:
            if rate in skipped:
                continue
            if rate and (reason := too_slow(update_bytes, rate, steps, args.cell_timeout)):
                print(f"{mode} at {rate:g} Mbit/s: skipped, {reason}", flush=True)
                skipped[rate] = reason
                continue
            cell = run_cell(hosts, args, mode, rate, steps, logs, repeat)
            update_bytes = cell.get("update_bytes", update_bytes)
            runs[rate].append(cell)
            print(f"{mode} at {f'{rate:g} Mbit/s' if rate else 'one host'} (run {repeat + 1}): "
                  + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in cell.items()}),
                  flush=True)
    cells = []
    for rate in places:
        head = {"mode": mode, "rate_mbit": rate, "steps_asked": steps}
        done = [run for run in runs[rate] if "error" not in run]
        if rate in skipped:
            cells.append({**head, "skipped": skipped[rate]})
        elif not done:
            cells.append({**head, "error": runs[rate][-1]["error"], "runs": runs[rate]})
        else:
            medians = {key: statistics.median(run[key] for run in done) for key, value in done[0].items()
                       if isinstance(value, (int, float))}
            cells.append({**head, **medians, "runs_done": len(done), "runs": runs[rate]})
    return cells


def numbers(text: str) -> list[float]:
    """'1000,100 20' -> [1000.0, 100.0, 20.0]."""
    return [float(part) for part in text.replace(",", " ").split()]


def plot(table: list[dict[str, Any]], path: Path) -> None:
    """Steps/s and link bytes per version against the link rate: one line per mode, the baseline's steps/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, (speed, size) = plt.subplots(1, 2, figsize=(10, 4))
    rates: set[float] = set()
    for color, mode in zip(("C0", "C1", "C2"), MODES, strict=True):
        cells = sorted((c for c in table if c["mode"] == mode and c["rate_mbit"] and "steps_per_s" in c),
                       key=lambda c: c["rate_mbit"])
        x = [c["rate_mbit"] for c in cells]
        rates.update(x)
        if cells:
            speed.plot(x, [c["steps_per_s"] for c in cells], "o-", color=color, label=f"{mode}, 2 hosts")
            size.plot(x, [c["link_in_per_version"] / 1e6 for c in cells], "o-", color=color,
                      label=f"{mode}: on the link")
            size.plot(x, [c["update_bytes"] / 1e6 for c in cells], "x:", color=color,
                      label=f"{mode}: one update as sent")
        for base in (c for c in table if c["mode"] == mode and not c["rate_mbit"] and "steps_per_s" in c):
            speed.axhline(base["steps_per_s"], linestyle="--", color=color, label=f"{mode}, one host")
    for axis, label in ((speed, "trainer steps/s"), (size, "MB into the makers' host per version")):
        axis.set_xscale("log")
        axis.set_xticks(sorted(rates), [f"{r:g}" for r in sorted(rates)])
        axis.minorticks_off()
        axis.set_xlabel("link rate, Mbit/s")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    size.set_yscale("log")
    speed.set_ylim(bottom=0)
    for which in (size.yaxis.set_major_formatter, size.yaxis.set_minor_formatter):
        which(FormatStrFormatter("%g"))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def report(table: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The table, each cell's steps/s as a ratio of the one-host baseline of its mode."""
    job = args.config or "the default job (SmolLM2-135M + LoRA, vLLM makers)"
    print(f"\n{job}, {args.makers} makers on h1, trainer and driver on h0; {platform.machine()}, "
          f"{os.cpu_count()} cores (every host shares them)")
    print(f"{'mode':>5} {'Mbit/s':>6} | {'steps/s':>7} {'x base':>6} | {'MB in/version':>13} "
          f"{'MB update':>9} {'ratio':>5} | {'delivery s':>10} | {'stale':>9} | {'lift':>5} | {'wall s':>6}")
    base = {c["mode"]: c for c in table if not c["rate_mbit"] and "steps_per_s" in c}
    for cell in table:
        where = f"{cell['rate_mbit']:g}" if cell["rate_mbit"] else "1 host"
        if "error" in cell or "skipped" in cell:
            why = f"failed: {cell['error']}" if "error" in cell else f"skipped: {cell['skipped']}"
            print(f"{cell['mode']:>5} {where:>6} | {why[:200]}")
            continue
        own = base.get(cell["mode"], {}).get("steps_per_s", float("nan"))
        cell["steps_ratio_to_base"] = ratio = cell["steps_per_s"] / own
        print(f"{cell['mode']:>5} {where:>6} | {cell['steps_per_s']:7.3f} {ratio:6.2f} | "
              f"{cell['link_in_per_version'] / 1e6:13.2f} {cell['update_bytes'] / 1e6:9.2f} "
              f"{cell['link_per_update_ratio']:5.2f} | {cell['delivery_s_median']:4.1f} /"
              f"{cell['delivery_s_max']:5.1f} | {cell['staleness_mean']:.2f}/{cell['staleness_max']:.0f}/"
              f"{cell['dropped_stale']:.0f} | {cell['held_out_lift_points']:+5.1f} | {cell['wall_s']:6.0f}")
    for cell in table:
        if len(cell.get("runs", [])) > 1:
            print(f"{cell['mode']} {cell['rate_mbit'] or 'one host'}: steps/s of each run "
                  + ", ".join(f"{run['steps_per_s']:.3f}" if "steps_per_s" in run else "failed"
                              for run in cell["runs"]))
    print("MB in/version: h1's link, bytes into the makers' host during the run / versions pushed "
          "(0..last);\nratio: that / one update as sent (its wire dtype, bf16 for vLLM makers); delivery: "
          "median / max s from the trainer at v\nto a maker holding v or newer (status polled every 0.5 s); "
          "stale: mean/max staleness, samples dropped\nstale; lift: held-out accuracy after - before, points")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="job config (default: none, the default job)")
    parser.add_argument("--rates", default="1000,100,20,5", help="Mbit/s of h1's link, e.g. 100,20")
    parser.add_argument("--modes", default="lora,full,delta", help="update modes: lora, full, delta")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--full-steps", type=int, default=None, help="steps of full cells (default --steps)")
    parser.add_argument("--delta-steps", type=int, default=None,
                        help="steps of delta cells (default --steps)")
    parser.add_argument("--makers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each cell (median reported)")
    parser.add_argument("--eval-size", type=int, default=None, help="held-out questions (default: the job's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another override for every cell, e.g. run.poll_interval_s=0.25")
    parser.add_argument("--cell-timeout", type=float, default=1800.0, help="seconds per cell")
    parser.add_argument("--no-baseline", action="store_true", help="leave out the one-host baseline")
    parser.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "thin-links.json")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of steps/s and link bytes against rate")
    parser.add_argument("--logs", type=Path, default=Path(__file__).parent / "results" / "thin-links-logs",
                        help="each cell's run and watcher output")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {unknown}; choose among {list(MODES)}")
    rates = sorted(numbers(args.rates), reverse=True)  # fast first: a mode's update size is known early
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not rates or min(rates) <= 0:
        parser.error(f"--rates: give positive Mbit/s, got {args.rates!r}")
    try:
        require_tools()
    except NetworkError as error:
        sys.exit(f"bench_thin_links: {error}")
    steps_of = {"lora": args.steps, "full": args.full_steps or args.steps,
                "delta": args.delta_steps or args.steps}
    table: list[dict[str, Any]] = []
    started = time.monotonic()
    labels = {TRAINER: {"role": "trainer"}, MAKER: {"role": "maker"}}
    logs = args.logs
    logs.mkdir(parents=True, exist_ok=True)
    with Hosts(2, cpus={TRAINER: 1 + args.makers, MAKER: args.makers}, labels=labels) as hosts:
        print(f"hosts up in {time.monotonic() - started:.0f} s (work directory {hosts.workdir}); logs in "
              f"{logs}", flush=True)
        idle = idle_rate(hosts)
        print(f"h1's link while idle (Ray's own traffic): {idle['received']:.0f} B/s in, "
              f"{idle['sent']:.0f} B/s out", flush=True)
        for mode in modes:
            if reason := refused(args.config, mode, args.set):
                print(f"{mode}: skipped, the config refuses its keys ({reason})", flush=True)
                table.append({"mode": mode, "rate_mbit": None, "skipped": reason})
            else:
                table += measure_mode(hosts, args, mode, rates, steps_of[mode], logs)
    report(table, args)
    print(f"benchmark wall time {time.monotonic() - started:.0f} s")
    save(args, table, plot, idle_link_bytes_per_s=idle)


def save(args: argparse.Namespace, table: list[dict[str, Any]], draw: Any, **more: Any) -> None:
    """Write the table (with the arguments, `more` and the machine) to `args.json`; `draw` it to `args.plot`
    when one is asked for."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores"
    args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "table": table,
                                     **more, "machine": machine}, indent=2))
    if args.plot:
        draw(table, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
