"""Scaling and memory: samples/s with 1, 2, 4 makers against one trainer; peak RSS of a maker, a trainer.

    .venv/bin/python benchmarks/bench_scaling.py --model tiny --makers 1 2 4 --steps 30 --repeats 3
    .venv/bin/python benchmarks/bench_scaling.py --model smollm2 --makers 2 --steps 6 --repeats 3   # memory

Each run is `detached-rl run` (the default job's config, `detached_rl/configs/run.yaml`, with
`--model` and the number of makers changed; the buffer holds two pushes per maker), so every
figure is of the real actors. From its metrics: trained samples/s from the end of step 1 to
the end of the last step, and the trainer's idle fraction (time spent waiting for a batch /
that span). While it runs, a sampler thread reads the peak resident set (`VmHWM` in
/proc/<pid>/status, the kernel's own high-water mark) of every maker and trainer process
(`ray::ExperienceMakerHolder`, `ray::GRPOTrainerShell`). Median [min-max] over repeats; JSON
goes to `benchmarks/results/scaling-<model>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import warnings
from pathlib import Path

from detached_rl.cli.run import run_config, run_job

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
ROLES = {"ray::ExperienceMakerHolder": "maker", "ray::GRPOTrainerShell": "trainer"}


def actor_processes() -> dict[int, str]:
    """PID -> role of the maker and trainer worker processes on this machine."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            command = Path(entry.path, "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        for prefix, role in ROLES.items():
            if command.startswith(prefix):
                found[int(entry.name)] = role
    return found


def peak_rss_mib(pid: int) -> float | None:
    """The process's peak resident set (VmHWM) in MiB, or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class PeakSampler:
    """Polls the peak RSS of maker and trainer processes until stopped; keeps the largest seen per role."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.peaks: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            for pid, role in actor_processes().items():
                peak = peak_rss_mib(pid)
                if peak is not None:
                    self.peaks[pid] = (role, max(peak, self.peaks.get(pid, (role, 0.0))[1]))

    def by_role(self) -> dict[str, float]:
        """The largest peak RSS (MiB) among the processes of each role."""
        roles: dict[str, float] = {}
        for role, peak in self.peaks.values():
            roles[role] = max(roles.get(role, 0.0), peak)
        return roles


def one_run(model: str, makers: int, steps: int, output: str, name: str) -> dict[str, float]:
    """One `detached-rl run`: trained samples/s, trainer idle fraction, peak RSS per role."""
    from detached_rl.cli.reporting import read_metrics

    config = run_config(None, ["task.eval_size=2", "run.examples=0", "run.progress=false",
                               f"run.output_dir={output}", f"trainer.buffer_max_samples={32 * makers}"],
                        steps=steps, makers=makers, model=model, name=name)
    with PeakSampler() as sampler:
        result = run_job(config, echo=lambda line: None)
    rows = read_metrics(result.directory / "metrics.jsonl")
    span = rows[-1]["time/elapsed"] - rows[0]["time/elapsed"]
    samples = config.trainer.train_batch_size * (len(rows) - 1)
    idle = sum(row.get("time/wait_for_batch", 0.0) for row in rows[1:])
    peaks = sampler.by_role()
    return {"samples_per_s": samples / span, "trainer_idle_fraction": idle / span,
            "maker_peak_rss_mib": peaks.get("maker", float("nan")),
            "trainer_peak_rss_mib": peaks.get("trainer", float("nan"))}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--makers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    table = {}
    with tempfile.TemporaryDirectory() as output:
        for makers in args.makers:
            runs = [one_run(args.model, makers, args.steps, output, f"scaling-{makers}-{r}")
                    for r in range(args.repeats)]
            table[makers] = {key: summary([run[key] for run in runs]) for key in runs[0]}
            table[makers]["runs"] = runs
            print(f"{makers} makers: " + ", ".join(f"{k} {v['median']:.3f}" for k, v in table[makers].items()
                                                   if k != "runs"), flush=True)
    print(f"GRPO, {args.model}, default job config, {args.steps} steps, {args.repeats} repeats; "
          f"{platform.machine()}, {os.cpu_count()} cores")
    print(f"{'makers':>6} | {'trained samples/s':>22} | {'trainer idle':>18} | {'maker peak RSS MiB':>22} | "
          f"{'trainer peak RSS MiB':>22}")
    for makers, row in table.items():
        cells = [f"{row[k]['median']:.1f} [{row[k]['min']:.1f}-{row[k]['max']:.1f}]"
                 for k in ("samples_per_s", "maker_peak_rss_mib", "trainer_peak_rss_mib")]
        idle = row["trainer_idle_fraction"]
        print(f"{makers:>6} | {cells[0]:>22} | {100 * idle['median']:5.1f}% [{100 * idle['min']:.0f}-"
              f"{100 * idle['max']:.0f}] | {cells[1]:>22} | {cells[2]:>22}")
    out = Path(__file__).parent / "results" / f"scaling-{Path(args.model).name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "table": table}, indent=2))


if __name__ == "__main__":
    main()
