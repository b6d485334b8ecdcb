"""Full-weight sync throughput: the chunked, checksummed protocol against a raw ray.put + ray.get.

    .venv/bin/python benchmarks/bench_weight_sync.py --model smollm2 --makers 1 2 4 --repeats 3

For each number of makers, in one run on one local Ray cluster:
* protocol: the trainer side builds a `WeightUpdate` (chunks cut by a byte budget, crc32
  checksums, each chunk `ray.put` once) and sends the same update to every maker actor; each
  maker pulls the chunks one at a time, verifies, stages and swaps them into its model
  (`WeightReceiver`, "staged" mode — what `ExperienceMakerHolder.apply_weight_update` runs);
* raw: the same tensors `ray.put` once as the same chunks, each maker `ray.get`s them and
  does nothing else — the limit of moving these bytes through the object store here.
Throughput is bytes delivered to all makers / wall time, from the first put to the last
maker done. "trainer CPU s" is the sender process's CPU time for one sync (build + put +
dispatch), which should not grow with the number of makers. Prints a table (median, min,
max over repeats) and writes `benchmarks/results/weight_sync-<model>.json`.

The same table is printed for the LoRA-only update of the default run's adapter (SmolLM2 +
peft LoRA r=16 on all linear layers: only the adapter tensors travel), and a chunk-size sweep
(`--chunk-sweep`, protocol only, `--sweep-makers` makers) shows what the byte budget costs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from pathlib import Path

import ray
import torch

from detached_rl.cli.jobs import init_local_ray
from detached_rl.weights.ray_wire import PiecedChunk, fetch_chunk, put_chunk
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.update import build_weight_update

PUT = put_chunk  # how chunks are stored (`--piece-mb`)


def load_state(model: str) -> dict[str, torch.Tensor]:
    """The state dict to send: the packaged SmolLM2 (fp32) or a tiny model."""
    from detached_rl.models import load_causal_lm

    loaded, _ = load_causal_lm(model)
    return {k: v.detach().clone() for k, v in loaded.state_dict().items()}


def load_lora_state(model: str) -> dict[str, torch.Tensor]:
    """The tensors a LoRA-only update carries: the trainable adapter of the default run (r=16, all-linear)."""
    from detached_rl.models import LoraSettings, apply_lora, load_causal_lm

    loaded, _ = load_causal_lm(model)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lora = apply_lora(loaded, LoraSettings(r=16, alpha=32, target_modules=("all-linear",)))
    return {k: v.detach().clone() for k, v in lora.named_parameters() if v.requires_grad}


@ray.remote
class Receiver:
    """A maker stand-in holding a model of the same shapes; applies updates like a real maker."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        torch.set_num_threads(1)
        self.params = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
        self.receiver = WeightReceiver({"actor": _NamedState(self.params)})

    def apply(self, update) -> float:
        start = time.perf_counter()
        self.receiver.receive(update, lambda ref: fetch_chunk(ref, timeout=300))
        return time.perf_counter() - start

    def raw_get(self, refs) -> float:
        start = time.perf_counter()
        for ref in refs:
            fetch_chunk(ref, timeout=300) if isinstance(ref, PiecedChunk) else ray.get(ref, timeout=300)
        return time.perf_counter() - start


class _NamedState(torch.nn.Module):
    """A module whose state dict has exactly the given names (dots allowed)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def state_dict(self, *args, **kwargs):  # noqa: D102 - mirrors nn.Module
        return dict(self._tensors)


def one_sync(state, receivers, version: int, chunk_bytes: int) -> tuple[float, float, int]:
    """(wall seconds, sender CPU seconds, bytes) of one protocol sync to every receiver."""
    cpu, wall = time.process_time(), time.perf_counter()
    update, stats = build_weight_update({"actor": state}, version, PUT, chunk_bytes=chunk_bytes)
    refs = [r.apply.remote(update) for r in receivers]
    cpu_used = time.process_time() - cpu
    ray.get(refs, timeout=600)
    return time.perf_counter() - wall, cpu_used, stats.bytes


def one_raw(state, receivers, chunk_bytes: int, put=ray.put) -> tuple[float, float, int]:
    """(wall seconds, sender CPU seconds, bytes) of putting the same chunks once
    and getting them everywhere."""
    cpu, wall = time.process_time(), time.perf_counter()
    chunks, chunk, size, total = [], {}, 0, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > chunk_bytes:
            chunks.append(put(chunk))
            chunk, size = {}, 0
        chunk[name] = tensor
        size += nbytes
        total += nbytes
    if chunk:
        chunks.append(put(chunk))
    refs = [r.raw_get.remote(chunks) for r in receivers]
    cpu_used = time.process_time() - cpu
    ray.get(refs, timeout=600)
    return time.perf_counter() - wall, cpu_used, total


def summarize(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(state: dict[str, torch.Tensor], counts: list[int], repeats: int, chunk_bytes: int,
            raw: bool = True) -> list[dict]:
    """One row per maker count: protocol (and raw) MB/s, seconds and the trainer's CPU time per sync."""
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in state.items()}
    rows = []
    for count in counts:
        receivers = [Receiver.remote(shapes) for _ in range(count)]
        ray.get([r.raw_get.remote([]) for r in receivers])
        one_sync(state, receivers, 0, chunk_bytes)  # warm-up: first allocation of staging buffers
        protocol, plain, zero_copy = [], [], []
        for repeat in range(repeats):
            protocol.append(one_sync(state, receivers, repeat + 1, chunk_bytes))
            if raw:
                plain.append(one_raw(state, receivers, chunk_bytes))
                zero_copy.append(one_raw(state, receivers, chunk_bytes, put=PUT))
        nbytes = protocol[0][2]
        row = {
            "makers": count, "bytes": nbytes, "chunk_bytes": chunk_bytes,
            "protocol_MBps": summarize([nbytes * count / 2**20 / w for w, _, _ in protocol]),
            "protocol_s": summarize([w for w, _, _ in protocol]),
            "trainer_cpu_s": summarize([c for _, c, _ in protocol]),
        }
        if raw:
            row["raw_MBps"] = summarize([nbytes * count / 2**20 / w for w, _, _ in plain])
            row["raw_zero_copy_MBps"] = summarize([nbytes * count / 2**20 / w for w, _, _ in zero_copy])
            row["raw_s"] = summarize([w for w, _, _ in plain])
            row["ratio"] = row["protocol_MBps"]["median"] / row["raw_MBps"]["median"]
        rows.append(row)
        for r in receivers:
            ray.kill(r)
    return rows


def cell(value: dict[str, float], digits: int = 0) -> str:
    """median [min-max]."""
    return f"{value['median']:.{digits}f} [{value['min']:.{digits}f}-{value['max']:.{digits}f}]"


def print_table(title: str, rows: list[dict]) -> None:
    """The protocol vs raw table of one kind of update."""
    print(f"{title}: {rows[0]['bytes'] / 2**20:.2f} MiB per sync")
    print(f"{'makers':>6} | {'protocol MB/s':>20} | {'raw MB/s':>20} | {'ratio':>5} | "
          f"{'zero-copy raw MB/s':>20} | {'sync s':>20} | {'trainer CPU s':>13}")
    for row in rows:
        print(f"{row['makers']:>6} | {cell(row['protocol_MBps']):>20} | {cell(row['raw_MBps']):>20} | "
              f"{row['ratio']:>5.2f} | {cell(row['raw_zero_copy_MBps']):>20} | "
              f"{cell(row['protocol_s'], 3):>20} | {row['trainer_cpu_s']['median']:>13.3f}")


def main() -> None:
    """Run and print the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--makers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-mb", type=float, default=64)
    parser.add_argument("--piece-mb", type=float, default=1,
                        help="pieces each chunk travels in (trainer.weight_piece_bytes); >= --chunk-mb: one")
    parser.add_argument("--chunk-sweep", type=float, nargs="*", default=[4, 16, 64, 256],
                        help="chunk sizes (MiB) for the sweep; none: no sweep")
    parser.add_argument("--sweep-makers", type=int, default=2)
    parser.add_argument("--no-lora", action="store_true", help="skip the LoRA-only table")
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    init_local_ray("bench", include_dashboard=False, log_to_driver=False, num_cpus=max(args.makers) + 1)
    chunk_bytes = int(args.chunk_mb * 2**20)
    global PUT
    PUT = functools.partial(put_chunk, piece_bytes=int(args.piece_mb * 2**20))
    state = load_state(args.model)
    results = {"full": measure(state, args.makers, args.repeats, chunk_bytes)}
    if not args.no_lora:
        results["lora"] = measure(load_lora_state(args.model), args.makers, args.repeats, chunk_bytes)
    results["chunk_sweep"] = [row for mb in args.chunk_sweep
                              for row in measure(state, [args.sweep_makers], args.repeats, int(mb * 2**20),
                                                 raw=False)]
    ray.shutdown()
    print(f"model {args.model}, chunks of {args.chunk_mb:g} MiB in pieces of {args.piece_mb:g} MiB, "
          f"{args.repeats} repeats; "
          f"{platform.machine()}, {os.cpu_count()} cores. MB/s = bytes delivered to all makers / wall time; "
          "median [min-max]. raw: ray.put + ray.get of the tensors; zero-copy: the same bytes as arrays, "
          "fetched and not touched")
    print_table("full update", results["full"])
    if "lora" in results:
        print_table("LoRA-only update", results["lora"])
        full, lora = results["full"][0], results["lora"][0]
        print(f"LoRA / full: bytes {lora['bytes'] / full['bytes']:.4f}, sync time "
              f"{lora['protocol_s']['median'] / full['protocol_s']['median']:.4f} ({full['makers']} maker)")
    if results["chunk_sweep"]:
        print(f"chunk-size sweep, full update, {args.sweep_makers} makers")
        print(f"{'chunk MiB':>9} | {'protocol MB/s':>20} | {'sync s':>20} | {'trainer CPU s':>13}")
        for row in results["chunk_sweep"]:
            print(f"{row['chunk_bytes'] / 2**20:>9g} | {cell(row['protocol_MBps']):>20} | "
                  f"{cell(row['protocol_s'], 3):>20} | {row['trainer_cpu_s']['median']:>13.3f}")
    out = Path(__file__).parent / "results" / f"weight_sync-{args.model}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
