"""The default job (`detached-rl run`, `make demo`) per maker backend over several seeds: wall time, lift.

    .venv/bin/python benchmarks/bench_demo.py --backends hf vllm --seeds 0 1 2

Each run is `detached-rl run --no-progress --set maker.backend=<backend> --set maker.seed=<seed> --set
model.seed=<seed>`, in a process of its own, one after the other (never two at once: they would share the
cores). Seed s seeds the makers' samplers (`maker.seed`) and the LoRA adapter's initialisation (`model.seed`);
the base model, prompts and held-out set stay those of the default job. Figures per run, from the run's
`summary.json`: `seconds` (start to shutdown, model loading and the held-out evaluations included), held-out
accuracy before and after (`task.eval_size` problems, greedy) with its standard error, the lift (after -
before, in points). Per backend: median and minimum lift, median wall time. Writes
`benchmarks/results/<--label>.json` (default demo.json); `--set` applies overrides to every run (a recipe
candidate), so one call is one candidate over its seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
BIN = Path(sys.executable).parent


def run_once(backend: str, seed: int, output: Path, extra: list[str]) -> dict:
    """One default job; its summary figures."""
    name = f"demo-{backend}-seed{seed}"
    command = [str(BIN / "detached-rl"), "run", "--no-progress", "--name", name, "--output", str(output),
               "--set", f"maker.backend={backend}", "--set", f"maker.seed={seed}",
               "--set", f"model.seed={seed}", *extra]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    summary = json.loads((output / name / "summary.json").read_text())
    before, after = summary["held_out_before"]["accuracy"], summary["held_out_after"]["accuracy"]
    return {"backend": backend, "seed": seed, "seconds": summary["seconds"], "process_seconds": wall,
            "before": before, "after": after, "lift_points": 100 * (after - before),
            "summary": summary}


def main() -> None:
    """Run every (backend, seed), print the per-run rows and the per-backend summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--output", default=None, help="run directories go here (default: a temporary one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more config overrides")
    parser.add_argument("--label", default="demo", help="results go to benchmarks/results/<label>.json")
    parser.add_argument("--set-for", action="append", nargs=2, default=[], metavar=("BACKEND", "KEY=VALUE"),
                        help="an override for one backend's runs only")
    args = parser.parse_args()
    output = Path(args.output or tempfile.mkdtemp(prefix="bench-demo-"))
    extra = [item for pair in args.set for item in ("--set", pair)]
    rows = []
    for seed in args.seeds:  # backends alternate, so slow drift of the machine hits both alike
        for backend in args.backends:
            own = [item for name, pair in args.set_for if name == backend for item in ("--set", pair)]
            row = run_once(backend, seed, output, extra + own)
            rows.append(row)
            print(f"{backend:<6} seed {seed}: {row['seconds']:6.1f} s, held-out {row['before']:.1%} -> "
                  f"{row['after']:.1%} ({row['lift_points']:+.1f} points)", flush=True)
    summary = {}
    for backend in args.backends:
        mine = [row for row in rows if row["backend"] == backend]
        lifts = [row["lift_points"] for row in mine]
        summary[backend] = {"median_lift_points": statistics.median(lifts), "min_lift_points": min(lifts),
                            "median_seconds": statistics.median(row["seconds"] for row in mine)}
        print(f"{backend:<6} median lift {summary[backend]['median_lift_points']:+.1f} points (min "
              f"{summary[backend]['min_lift_points']:+.1f}), median wall time "
              f"{summary[backend]['median_seconds']:.0f} s")
    RESULTS.mkdir(exist_ok=True)
    report = {"label": args.label, "overrides": args.set,
              "machine": f"{platform.machine()}, {os.cpu_count()} cores", "runs": rows, "summary": summary}
    (RESULTS / f"{args.label}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
