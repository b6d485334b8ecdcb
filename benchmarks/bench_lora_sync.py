"""Full vs LoRA-only weight updates of the packaged SmolLM2-135M-Instruct with LoRA r=8 on q_proj/v_proj.

    .venv/bin/python benchmarks/bench_lora_sync.py --repeats 3

One local Ray cluster; the driver is the trainer (a peft LoRA policy), two maker actors hold
the same policy: one keeps the adapters ("keep"), one serves a plain model and re-merges
W = W0 + scaling*B*A after each update ("merge"). For each kind of update the table shows
the bytes sent, the trainer's build time (snapshot, checksum, put) and the time until both
makers have applied it (fetch, verify, swap, re-merge). Median [min-max] over repeats; JSON
goes to `benchmarks/results/lora_sync.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import ray
import torch

from detached_rl.cli.jobs import init_local_ray
from detached_rl.models import LoraSettings, apply_lora, load_smollm2
from detached_rl.models.lora_merge import LoraMergeTarget
from detached_rl.weights.ray_wire import fetch_chunk, put_chunk
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import build_weight_update

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
SETTINGS = LoraSettings(r=8, alpha=16, target_modules=("q_proj", "v_proj"))


def lora_policy(seed: int = 0) -> torch.nn.Module:
    """SmolLM2 with a peft LoRA adapter (B initialised to random values so updates matter)."""
    model, _ = load_smollm2()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return apply_lora(model, SETTINGS)


@ray.remote
class Maker:
    """Holds the LoRA policy in one of the two maker modes and applies updates."""

    def __init__(self, mode: str) -> None:
        torch.set_num_threads(1)
        policy = lora_policy(seed=1)
        target = LoraMergeTarget.from_lora_model(policy) if mode == "merge" else policy

        def refresh(names):
            target.refresh({n.split("/", 1)[1] for n in names})

        after = refresh if mode == "merge" else None
        self.receiver = WeightReceiver({"actor": target}, after_swap=after)

    def apply(self, update) -> float:
        start = time.perf_counter()
        self.receiver.receive(update, lambda ref: fetch_chunk(ref, timeout=300))
        return time.perf_counter() - start


def summarize(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    """Run and print the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    init_local_ray("bench", include_dashboard=False, log_to_driver=False, num_cpus=3)
    policy = lora_policy(seed=0)
    makers = [Maker.remote("keep"), Maker.remote("merge")]
    version = 0
    rows = {}
    for kind in ("full", "lora", "full", "lora"):  # the first round is a warm-up
        builds, applies, sizes = [], [], []
        for _ in range(args.repeats):
            version += 1
            with torch.no_grad():  # a "training step": every adapter tensor changes
                for p in policy.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn_like(p) * 1e-3)
            state = policy.state_dict() if kind == "full" else {
                k: p.detach() for k, p in policy.named_parameters() if p.requires_grad}
            start = time.perf_counter()
            update, stats = build_weight_update({"actor": state}, version, put_chunk, kind=kind)
            built = time.perf_counter()
            ray.get([m.apply.remote(update) for m in makers], timeout=600)
            builds.append(built - start)
            applies.append(time.perf_counter() - built)
            sizes.append(stats.bytes)
        rows[kind] = {"bytes": sizes[0], "build_s": summarize(builds),
                      "apply_both_makers_s": summarize(applies),
                      "total_s": summarize([b + a for b, a in zip(builds, applies, strict=True)])}
    ray.shutdown()
    full, lora = rows["full"], rows["lora"]
    print(f"SmolLM2-135M-Instruct + peft LoRA r=8 on q_proj/v_proj; 2 makers (keep, merge); "
          f"{args.repeats} repeats; {platform.machine()}, {os.cpu_count()} cores")
    print(f"{'update':>6} | {'bytes':>12} | {'build s':>20} | {'apply s (both makers)':>22} | "
          f"{'total s':>20}")
    for kind, row in rows.items():
        cells = [f"{row[key]['median']:.3f} [{row[key]['min']:.3f}-{row[key]['max']:.3f}]"
                 for key in ("build_s", "apply_both_makers_s", "total_s")]
        print(f"{kind:>6} | {row['bytes']:>12,} | {cells[0]:>20} | {cells[1]:>22} | {cells[2]:>20}")
    print(f"LoRA / full: bytes {lora['bytes'] / full['bytes']:.4%}, "
          f"time {lora['total_s']['median'] / full['total_s']['median']:.3f}x")
    out = Path(__file__).parent / "results" / "lora_sync.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
