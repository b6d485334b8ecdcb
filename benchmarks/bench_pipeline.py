"""Pipeline overlap: the same GRPO work in one process (generate, then train) and detached (maker+trainer).

    .venv/bin/python benchmarks/bench_pipeline.py --steps 10 --repeats 3

The work is the default job's (`detached_rl/configs/run.yaml`): SmolLM2-135M-Instruct with LoRA
r=16 on all linear layers, word problems, 2 prompts x 8 answers = 16 samples of up to 40 tokens
per step, LoRA-only weight updates, `max_staleness=1`.

* (a) one process, no Ray: `ExperienceMaker.make_experience`, then `TrainerCore.train_step`,
  then the weight update into the maker, in turn, with both cores (2 torch threads);
* (b) detached: `detached-rl run` with 1 maker and 1 trainer (one core each: 1 torch thread
  apiece), which generate and train at the same time;
* the bound: max(generate, train) with 1 thread, measured in the same process as (a) right
  after it (what (b) could reach if neither side ever waited).

Time per step is measured from the end of step 1 to the end of step N, divided by N-1, so model
loading and first-call warm-up are left out of both. Median [min-max] over repeats; JSON goes to
`benchmarks/results/pipeline-staleness<N>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch

from detached_rl.algorithms.grpo import GRPOLearner
from detached_rl.cli.run import run_config, run_job
from detached_rl.config import RunConfig, maker_factory, trainer_factory
from detached_rl.maker.experience_maker import ExperienceMaker
from detached_rl.strategies import NaiveStrategy
from detached_rl.trainer.core import TrainerCore

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def config_for(steps: int, model: str, name: str, output: str, max_staleness: int = 1) -> RunConfig:
    """The default job's config with one maker, `max_staleness` (1 by default) and a token held-out split."""
    return run_config(None, [f"trainer.max_staleness={max_staleness}", "task.eval_size=2", "run.examples=0",
                             "run.progress=false", f"run.output_dir={output}"],
                      steps=steps, makers=1, model=model, name=name)


class InProcessStore:
    """`put` / `fetch` over a dict: the weight update stays in this process."""

    def __init__(self) -> None:
        self.objects: dict[int, object] = {}

    def put(self, value: object) -> int:
        key = len(self.objects)
        self.objects[key] = value
        return key

    def fetch(self, key: int) -> object:
        return self.objects[key]


def one_process(config: RunConfig, steps: int, bound_steps: int) -> dict[str, float]:
    """(a): generate-then-train with 2 threads; then 1-thread generate and train times for the bound."""
    torch.set_num_threads(2)
    maker = ExperienceMaker("maker", maker_factory(config)(), config.prompts(), config.maker_config)
    trainer = TrainerCore("trainer", GRPOLearner(trainer_factory(config)(), NaiveStrategy(), config.grpo,
                                                    sampling=config.sampling),
                          config.trainer)
    store = InProcessStore()
    trainer.weights.snapshot(store.put)
    maker.apply_weight_update(trainer.weights.register("maker"), store.fetch)

    def deliver(update, makers):
        return {name: maker.apply_weight_update(update, store.fetch) for name in makers}

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        trainer.push_experience(maker.make_experience())
        generated = time.perf_counter()
        trainer.train_step()
        trainer.weights.publish(store.put, deliver)
        return generated - start, time.perf_counter() - generated

    ends = []
    for _ in range(steps):
        step()
        ends.append(time.perf_counter())
    torch.set_num_threads(1)
    generate, train = zip(*(step() for _ in range(bound_steps)), strict=True)
    return {"step_s": (ends[-1] - ends[0]) / (steps - 1), "generate_1thread_s": statistics.median(generate),
            "train_1thread_s": statistics.median(train)}


def detached(config: RunConfig) -> dict[str, float]:
    """(b): `detached-rl run` with 1 maker + 1 trainer; time per step from its metrics."""
    from detached_rl.cli.reporting import read_metrics

    result = run_job(config, echo=lambda line: None)
    rows = read_metrics(result.directory / "metrics.jsonl")
    elapsed = [row["time/elapsed"] for row in rows]
    waits = [row.get("time/wait_for_batch", 0.0) for row in rows[1:]]
    span = elapsed[-1] - elapsed[0]
    return {"step_s": span / (len(rows) - 1), "trainer_idle_fraction": sum(waits) / span,
            "reward_last3": statistics.mean(row["reward/mean"] for row in rows[-3:])}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bound-steps", type=int, default=3, help="1-thread steps measured for the bound")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="the trainer's staleness bound (default 1)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as output:
        for repeat in range(args.repeats):
            config = config_for(args.steps, args.model, f"pipeline-{repeat}", output, args.max_staleness)
            in_process = one_process(config, args.steps, args.bound_steps)
            split = detached(config_for(args.steps, args.model, f"pipeline-{repeat}", output,
                                        args.max_staleness))
            runs.append({"one_process_s": in_process["step_s"], "detached_s": split["step_s"],
                         "bound_s": max(in_process["generate_1thread_s"], in_process["train_1thread_s"]),
                         "generate_1thread_s": in_process["generate_1thread_s"],
                         "train_1thread_s": in_process["train_1thread_s"],
                         "trainer_idle_fraction": split["trainer_idle_fraction"],
                         "ratio": in_process["step_s"] / split["step_s"]})
            print(f"repeat {repeat + 1}: " + ", ".join(f"{k} {v:.3f}" for k, v in runs[-1].items()),
                  flush=True)
    table = {key: summary([run[key] for run in runs]) for key in runs[0]}
    print(f"GRPO, {args.model} + LoRA, 16 samples x <=40 tokens per step, max_staleness "
          f"{args.max_staleness}, {args.steps} steps, {args.repeats} repeats; "
          f"{platform.machine()}, {os.cpu_count()} cores")
    for key, label in (("one_process_s", "(a) one process, generate then train, 2 threads"),
                       ("detached_s", "(b) detached, 1 maker + 1 trainer, 1 thread each"),
                       ("bound_s", "bound max(generate, train), 1 thread"),
                       ("generate_1thread_s", "  generate, 1 thread"),
                       ("train_1thread_s", "  train step, 1 thread")):
        value = table[key]
        print(f"{label:<52} {value['median']:6.2f} s/step [{value['min']:.2f}-{value['max']:.2f}]")
    print(f"(a)/(b) speed-up {table['ratio']['median']:.2f} "
          f"[{table['ratio']['min']:.2f}-{table['ratio']['max']:.2f}]; (b)/bound "
          f"{table['detached_s']['median'] / table['bound_s']['median']:.2f}; trainer idle in (b) "
          f"{100 * table['trainer_idle_fraction']['median']:.0f} %")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"pipeline-staleness{args.max_staleness}.json").write_text(json.dumps({"args": vars(args),
                                                                                  "runs": runs,
                                                                                  "table": table}, indent=2))


if __name__ == "__main__":
    main()
