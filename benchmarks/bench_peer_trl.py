"""Peer benchmark: Hugging Face TRL's GRPOTrainer against detached-rl's GRPO job, on the same work, in one
run.

    make bench-env    # once: TRL and datasets, into this virtualenv only (the `bench` extra)
    .venv/bin/python benchmarks/bench_peer_trl.py --steps 10 --repeats 3     # time per step
    .venv/bin/python benchmarks/bench_peer_trl.py --accuracy --repeats 3 --eval-size 256
                      # held-out accuracy against wall time: the default job, then TRL for as long
                      # (peer_trl_timed.py)

The work is the default job's (`detached_rl/config/run.yaml`), and both sides read it from
that one config: GRPO on the packaged SmolLM2-135M-Instruct with a peft LoRA adapter (r=16,
alpha=32, dropout 0, every Linear layer but the output head), the `word_problems` training
prompts in the same order (the one-maker prompt stream, system message with the worked example
included), the `answer_line` reward, the job's prompts x answers per step (2 x 8 = 16 samples) of at
most 40 new tokens at temperature 0.8 (top-k and top-p off), one pass over each batch, AdamW
(betas 0.9/0.999, eps 1e-8, no weight decay, gradient norm clipped at 1.0) at the job's learning rate
and schedule (TRL: transformers' `cosine_with_min_lr` for our cosine with a floor, spanning the same
steps), PPO clip 0.2, the job's KL coefficient (0.1) with the k3 estimator against the initial policy,
group-normalised advantages (r - mean) / std, token-mean loss, bf16 autocast on the training
forward passes, float32 generation, dropout off, no gradient checkpointing (TRL's default turns
it on).

* ours: `detached_rl.cli.run.run_job` (`detached-rl run`) with 1 maker and 1 trainer (one torch
  thread each, the maker niced, as in run.yaml), which generate and train at the same time;
* TRL: `trl.GRPOTrainer` in this process with 2 torch threads (it generates, then trains, so it
  gets both cores), transformers `generate`, no vLLM, `use_cpu=True`.

Figures, each a median [min-max] over `--repeats` runs (the two sides alternate):
* time per step: end of step 1 to end of step N, divided by N-1 (model loading, the first
  generation and first-call warm-up are left out of both). Ours: the sum over steps 2..N of the
  trainer's own per-step clocks in metrics.jsonl (`time/wait_for_batch` + `time/training` +
  `time/weight_sync`: the trainer's whole loop); the driver-side `time/elapsed` difference (1 s
  polling) is kept in the JSON as a cross-check. TRL: wall clock at each `on_step_end` callback.
* reward after N steps: the mean over the last 3 steps of the batch mean reward (ours:
  `reward/mean` per metrics.jsonl row; TRL: the `reward` of its per-step log).
* held-out accuracy after: the same 64 held-out problems (`task.eval_size`, `--eval-size`), greedy, graded by
  `answer_line` (ours: `RunResult.after`, from the maker; TRL: the trained model, wrapped in
  detached-rl's `Actor`, outside the timed steps).

Settings that differ, and why:
* staleness: ours trains on a batch the maker generated while the previous step trained
  (`trainer.max_staleness=1`, `--max-staleness`: the maker waits for weights fresh enough, so every
  batch is one version behind; the maker generates with the default job's backend, vLLM in bf16
  where installed, so the trainer recomputes the "old" log-probs and weights tokens by TIS,
  `proximal_recompute: true`); TRL is on-policy (it
  generates with the weights it then trains, and its "old" log-probs are the trained forward's own,
  so the ratio is exactly 1). That overlap is what is being measured.
* threads: 1 + 1 in two processes (ours) against 2 in one (TRL), so both use the machine's 2 cores.
* loss: TRL `loss_type="dapo"` (policy and KL terms summed over the step's completion tokens and
  divided by their number: with one process and no gradient accumulation, exactly our
  `token-mean`; "bnpo" would be identical here). TRL adds beta*KL per token before aggregating;
  ours aggregates it separately with the same token-mean: the same sum.
* KL gradient: `use_bias_correction_kl=False` (TRL's default multiplies the KL term by the
  importance ratio, which changes its gradient even on-policy; ours does not).
* advantage eps: TRL divides by std + 1e-4, ours by std + 1e-6 (not configurable in TRL).
* seeds: repeat i seeds TRL with `--seed` + i and our maker's sampler (`maker.seed`) with the same;
  the runs differ in random streams, so rewards are comparable in distribution, not sample by sample.
* TRL computes log-probs and entropy with its fused LM head (no full logits); ours materialises
  the response logits. Ours runs each distinct prompt through the model once per step and shares
  its key/value cache across the group's 8 answers (generation and training); TRL runs every row's
  prompt. Both recompute the reference log-probs each step (ours: a merged copy of
  the initial policy; TRL: the same model with the adapter disabled).
Run it on an otherwise idle machine: with others' work on the 2 cores (load average ~5), TRL's
2-thread steps took 5x as long in one check. The 1-minute load average before each run is
printed and kept in the JSON. `--only ours|trl` runs one side. Results go to
`benchmarks/results/peer_trl.json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download: the model is the packaged copy
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from peer_trl_common import build_trl_trainer, check_comparable, held_out_accuracy  # noqa: E402

from detached_rl.cli.reporting import read_metrics  # noqa: E402
from detached_rl.cli.run import run_config, run_job  # noqa: E402
from detached_rl.config import RunConfig  # noqa: E402

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
SIDES = ("ours", "trl")
LAST = 3  # steps whose mean reward is "the reward after N steps"
TRL_THREADS = 2


def job_config(steps: int, name: str, output: str, eval_size: int, seed: int,
               max_staleness: int = 1) -> RunConfig:
    """The default job (run.yaml) with one maker, `max_staleness` (1, as in the pipeline benchmark), a small
    held-out split and no progress bar."""
    return run_config(None, [f"run.output_dir={output}", "run.progress=false", "run.examples=0",
                             f"task.eval_size={eval_size}", f"maker.seed={seed}",
                             f"trainer.max_staleness={max_staleness}"],
                      steps=steps, makers=1, name=name)


def summarize(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def last_mean(values: list[float], count: int = LAST) -> float:
    """Mean of the last `count` values."""
    return statistics.mean(values[-count:])


def run_ours(steps: int, output: str, eval_size: int, seed: int, name: str,
             max_staleness: int = 1) -> dict[str, Any]:
    """One `detached-rl run` job (1 maker + 1 trainer); figures from its metrics.jsonl and held-out result."""
    config = job_config(steps, name, output, eval_size, seed, max_staleness)
    check_comparable(config)
    start = time.perf_counter()
    result = run_job(config, echo=lambda line: None)
    rows = sorted(read_metrics(result.directory / "metrics.jsonl"), key=lambda row: row["step"])
    if len(rows) != steps:
        raise RuntimeError(f"ours: metrics.jsonl has {len(rows)} rows for {steps} steps")
    loop = [row["time/wait_for_batch"] + row["time/training"] + row.get("time/weight_sync", 0.0)
            for row in rows]
    return {
        "step_s": sum(loop[1:]) / (steps - 1),
        "step_s_driver_elapsed": (rows[-1]["time/elapsed"] - rows[0]["time/elapsed"]) / (steps - 1),
        "first_step_s": loop[0],
        "train_s_median": statistics.median(row["time/training"] for row in rows[1:]),
        "wait_for_batch_s_median": statistics.median(row["time/wait_for_batch"] for row in rows[1:]),
        "reward_last": last_mean([row["reward/mean"] for row in rows]),
        "correct_last": (last_mean([row["info/correct"] for row in rows]) if "info/correct" in rows[0]
                         else None),
        "rewards": [row["reward/mean"] for row in rows],
        "held_out_before": result.before.get("accuracy"),
        "held_out_after": result.after.get("accuracy"),
        "staleness_mean": statistics.mean(row.get("staleness/mean", 0.0) for row in rows),
        "job_s": time.perf_counter() - start,
    }


def run_trl(steps: int, output: str, eval_size: int, seed: int, precision: str) -> dict[str, Any]:
    """One TRL GRPOTrainer run on the same prompts, reward and settings; figures from
    its logs and a step clock."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall clock at the start of training and at the end of each optimizer step."""

        def __init__(self) -> None:
            self.begin = 0.0
            self.ends: list[float] = []

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    torch.set_num_threads(TRL_THREADS)
    config = job_config(steps, "trl", output, eval_size, seed)
    correct_log: list[float] = []
    clock = StepClock()
    trainer = build_trl_trainer(config, str(Path(output) / "trl"), seed, precision, steps, [clock],
                                correct_log)
    model, tokenizer, args = trainer.model, trainer.processing_class, trainer.args
    start = time.perf_counter()
    trainer.train()
    logs = sorted((entry for entry in trainer.state.log_history if "reward" in entry),
                  key=lambda e: e["step"])
    if len(logs) != steps or len(clock.ends) != steps:
        raise RuntimeError(f"trl: {len(logs)} log rows and {len(clock.ends)} step ends for {steps} steps")
    rewards = [float(entry["reward"]) for entry in logs]
    figures = {
        "step_s": (clock.ends[-1] - clock.ends[0]) / (steps - 1),
        "first_step_s": clock.ends[0] - clock.begin,
        # TRL's own: generation + loss + backward, without the optimizer step
        "trl_step_time_s_median": (statistics.median(float(e["step_time"]) for e in logs[1:])
                                   if "step_time" in logs[0] else None),
        "reward_last": last_mean(rewards),
        "correct_last": last_mean(correct_log) if len(correct_log) == steps else None,
        "rewards": rewards,
        "kl_last": float(logs[-1]["kl"]) if "kl" in logs[-1] else None,
        "held_out_after": held_out_accuracy(trainer.model, tokenizer, config),
        "precision": "bf16 autocast" if args.bf16 else "fp32",
        "job_s": time.perf_counter() - start,
    }
    del trainer, model
    gc.collect()
    return figures


def trl_version() -> str:
    """The installed TRL version, or 'not installed'."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trl")
    except PackageNotFoundError:
        return "not installed"



def cell(summary: dict[str, float] | None, fmt: str) -> str:
    """'median [min-max]' in `fmt`, or n/a."""
    if summary is None:
        return "n/a"
    return f"{summary['median']:{fmt}} [{summary['min']:{fmt}}-{summary['max']:{fmt}}]"


def main() -> None:
    """Run both sides, print the table and write JSON."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=("ours", "trl", "both"), default="both")
    parser.add_argument("--eval-size", type=int, default=64, help="held-out problems graded after training")
    parser.add_argument("--seed", type=int, default=0, help="repeat i uses seed + i on both sides")
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="our trainer's staleness bound (default 1)")
    parser.add_argument("--trl-precision", choices=("bf16", "fp32"), default="bf16",
                        help="TRL training forward passes: bf16 autocast (as our trainer) or fp32")
    parser.add_argument("--accuracy", action="store_true",
                        help="held-out accuracy against wall time: the default job (2 makers) per seed, "
                             "then TRL for the same wall time (peer_trl_timed.py); --repeats seeds, "
                             "--eval-size problems")
    args = parser.parse_args()
    if args.accuracy:
        from peer_trl_timed import accuracy_benchmark

        accuracy_benchmark(args.repeats, args.seed, args.eval_size, args.trl_precision, TRL_THREADS)
        return
    if args.steps < 2:
        parser.error("--steps must be >= 2 (time per step runs from the end of step 1 to the end of step N)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    transformers.logging.set_verbosity_error()
    sides = SIDES if args.only == "both" else (args.only,)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    with tempfile.TemporaryDirectory(prefix="peer-trl-") as output:
        for repeat in range(args.repeats):
            seed = args.seed + repeat
            for side in sides:
                load = os.getloadavg()[0]  # others' work on this machine skews both sides: kept with each run
                if side == "ours":
                    row = run_ours(args.steps, output, args.eval_size, seed, f"peer-ours-{stamp}-{repeat}",
                                   args.max_staleness)
                else:
                    row = run_trl(args.steps, str(Path(output) / f"trl-{repeat}"), args.eval_size, seed,
                                  args.trl_precision)
                row["load_average_before"] = load
                runs[side].append(row)
                print(f"repeat {repeat + 1} {side}: {row['step_s']:.2f} s/step (first step "
                      f"{row['first_step_s']:.1f} s), reward {row['reward_last']:.3f}, held-out after "
                      f"{row['held_out_after']:.1%}, {row['job_s']:.0f} s in all; load average "
                      f"before {load:.1f}", flush=True)
    table = {side: {key: summarize([r[key] for r in rows]) if all(r.get(key) is not None for r in rows)
                    else None
                    for key in ("step_s", "reward_last", "correct_last", "held_out_after")}
             for side, rows in runs.items()}
    precision = runs["trl"][0]["precision"] if "trl" in runs else None
    print("\nGRPO, SmolLM2-135M-Instruct + LoRA r=16 all-linear, word problems, 2 prompts x 8 = "
          f"16 samples x <=40 tokens per step, {args.steps} steps, {args.repeats} repeats; "
          f"{platform.machine()}, {os.cpu_count()} cores")
    labels = {"ours": "ours: 1 maker + 1 trainer, 1 thread each",
              "trl": f"TRL {trl_version()} GRPOTrainer, {TRL_THREADS} threads, {precision}"}
    reward_header = f"reward after {args.steps} steps (last {min(LAST, args.steps)})"
    print(f"{'side':<50} | {'time per step s':>22} | {reward_header:>30} | {'held-out accuracy after':>26}")
    for side, row in table.items():
        print(f"{labels[side]:<50} | {cell(row['step_s'], '.2f'):>22} | "
              f"{cell(row['reward_last'], '.3f'):>30} | {cell(row['held_out_after'], '.1%'):>26}")
    ratio = None
    if len(table) == 2:
        ratio = table["trl"]["step_s"]["median"] / table["ours"]["step_s"]["median"]
        print(f"TRL time / our time per step: {ratio:.2f}x (medians)")
    out = Path(__file__).parent / "results" / "peer_trl.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                               "trl_version": trl_version(), "trl_threads": TRL_THREADS,
                               "trl_precision": precision,
                               "table": table, "ratio_trl_over_ours": ratio, "runs": runs}, indent=2))
    print(f"wrote {out}")

if __name__ == "__main__":
    main()
