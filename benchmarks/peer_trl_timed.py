"""Held-out accuracy against wall time, detached-rl's default job against TRL's GRPOTrainer on the same work
(`bench_peer_trl.py --accuracy`).

Per seed, ours first: the default job as a user runs it (`detached-rl run`: 2 makers + 1 trainer, the recipe
of run.yaml, `maker.seed` and `model.seed` = the seed), timed from before Ray starts to the end of the job
(model loading, both held-out evaluations and the export included); its held-out curve (`eval/job_seconds`
of the evaluation rows in metrics.jsonl) is ours against time. Then TRL with that job's wall time as its
budget, counted from before it loads the model: it trains until the budget is spent (the last step ends
past it) and is graded at the half and at the end with the clock stopped (grading is not charged to TRL).

Both final models are graded again by one grader, outside the clocks: greedy answers of Hugging Face
`generate` in float32 to the same held-out problems (`peer_trl_common.held_out_accuracy`; ours: the merged
model the job exported). That figure, "accuracy at equal wall time", is the comparison; each side's own
curve is kept for the plot (ours graded by its makers' engine, vLLM in bf16 where installed, so its
curve's level may differ from the common grader's by the engines' difference).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from peer_trl_common import build_trl_trainer, held_out_accuracy

from detached_rl.cli.reporting import read_metrics
from detached_rl.cli.run import run_config, run_job
from detached_rl.config import RunConfig
from detached_rl.models import load_causal_lm


def default_job(seed: int, output: str, eval_size: int, name: str) -> RunConfig:
    """The default job (run.yaml) with seed `seed`, `eval_size` held-out problems, no progress bar."""
    return run_config(None, [f"run.output_dir={output}", "run.progress=false", "run.examples=0",
                             f"task.eval_size={eval_size}", f"maker.seed={seed}", f"model.seed={seed}"],
                      name=name)


def run_ours_timed(seed: int, output: str, eval_size: int, name: str) -> dict[str, Any]:
    """One default job; its wall time, accuracy before/after (its makers' grading), curve, and the common
    grader's accuracy of the exported merged model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = default_job(seed, output, eval_size, name)
    start = time.perf_counter()
    result = run_job(config, echo=lambda line: None)
    wall = time.perf_counter() - start
    curve = sorted((row["eval/job_seconds"], row["eval/accuracy"], row["step"])
                   for row in read_metrics(result.directory / "metrics.jsonl", kind="eval"))
    merged = AutoModelForCausalLM.from_pretrained(result.directory / "merged")
    tokenizer = AutoTokenizer.from_pretrained(result.directory / "merged")
    return {"job_s": wall, "steps": result.steps, "before_own": result.before["accuracy"],
            "after_own": result.after["accuracy"], "curve_own": curve,
            "after": held_out_accuracy(merged, tokenizer, config)}


class TimeBudget:
    """A wall clock from `start` that stops while `paused()` (grading), with the points to grade at."""

    def __init__(self, budget_s: float, start: float) -> None:
        self.budget_s = budget_s
        self.start = start
        self.paused_s = 0.0

    def elapsed(self) -> float:
        """Seconds charged so far."""
        return time.perf_counter() - self.start - self.paused_s

    def pause_for(self, work: Any) -> Any:
        """Run `work()` without charging its time."""
        begin = time.perf_counter()
        try:
            return work()
        finally:
            self.paused_s += time.perf_counter() - begin


def run_trl_timed(seed: int, output: str, eval_size: int, budget_s: float, precision: str) -> dict[str, Any]:
    """TRL's GRPOTrainer on the default job's work for `budget_s` s of wall time (loading included); graded at
    the half and at the end with its clock stopped."""
    from transformers import TrainerCallback

    start = time.perf_counter()
    clock = TimeBudget(budget_s, start)
    config = default_job(seed, output, eval_size, "trl")
    curve: list[tuple[float, float, int]] = []

    class Budget(TrainerCallback):
        """Grades at the half of the budget; stops training once it is spent."""

        def __init__(self) -> None:
            self.graded_half = False

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            elapsed = clock.elapsed()
            if not self.graded_half and elapsed >= budget_s / 2:
                self.graded_half = True
                accuracy = clock.pause_for(lambda: held_out_accuracy(model, trainer.processing_class, config))
                model.train()
                curve.append((elapsed, accuracy, state.global_step))
            if elapsed >= budget_s:
                control.should_training_stop = True

    # A decaying schedule spans the steps of our run, as ours does (TRL, slower per step, is stopped by the
    # budget first); a constant one leaves the budget alone to stop it.
    max_steps = config.grpo.actor_optimizer.total_steps or 400
    trainer = build_trl_trainer(config, str(Path(output) / "trl"), seed, precision, max_steps=max_steps,
                                callbacks=[Budget()])
    trainer.train()
    elapsed = clock.elapsed()
    steps = trainer.state.global_step
    accuracy = clock.pause_for(lambda: held_out_accuracy(trainer.model, trainer.processing_class, config))
    curve.append((elapsed, accuracy, steps))
    return {"job_s": elapsed, "steps": steps, "after": accuracy, "curve_own": curve}


def base_accuracy(eval_size: int) -> float:
    """The common grader's accuracy of the base model (the same for every seed and both sides)."""
    config = default_job(0, "runs", eval_size, "base")
    model, tokenizer = load_causal_lm(config.model.policy)
    return held_out_accuracy(model, tokenizer, config)


def accuracy_benchmark(repeats: int, first_seed: int, eval_size: int, precision: str,
                       trl_threads: int) -> None:
    """Ours then TRL per seed; print each run and the medians, write benchmarks/results/peer_trl_accuracy.json
    and docs/figures/peer-trl-accuracy.png."""
    import json
    import os
    import platform
    import statistics
    import tempfile

    import torch

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    base = base_accuracy(eval_size)
    print(f"base model, common grader: {base:.1%} on {eval_size} held-out problems", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
    with tempfile.TemporaryDirectory(prefix="peer-trl-accuracy-") as output:
        for repeat in range(repeats):
            seed = first_seed + repeat
            ours = run_ours_timed(seed, output, eval_size, f"peer-accuracy-ours-{seed}")
            runs["ours"].append({"seed": seed, **ours})
            threads = torch.get_num_threads()
            torch.set_num_threads(trl_threads)
            trl = run_trl_timed(seed, str(Path(output) / f"trl-{seed}"), eval_size, ours["job_s"], precision)
            torch.set_num_threads(threads)
            runs["trl"].append({"seed": seed, **trl})
            print(f"seed {seed}: ours {ours['after']:.1%} after {ours['job_s']:.0f} s "
                  f"({ours['steps']} steps; its makers graded {ours['before_own']:.1%} -> "
                  f"{ours['after_own']:.1%}), TRL "
                  f"{trl['after']:.1%} after {trl['job_s']:.0f} s ({trl['steps']} steps)", flush=True)
    medians = {side: statistics.median(run["after"] for run in rows) for side, rows in runs.items()}
    print(f"\nheld-out accuracy at equal wall time (common grader, {eval_size} problems, base {base:.1%}), "
          f"medians over {repeats} seeds: ours {medians['ours']:.1%}, TRL {medians['trl']:.1%}; "
          f"{platform.machine()}, {os.cpu_count()} cores")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "peer_trl_accuracy.json").write_text(json.dumps(
        {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "eval_size": eval_size, "base": base,
         "medians": medians, "runs": runs}, indent=2))
    plot_curves(runs, base, Path(__file__).parent.parent / "docs" / "figures" / "peer-trl-accuracy.png")


def plot_curves(runs: dict[str, list[dict[str, Any]]], base: float, path: Path) -> None:
    """Held-out accuracy against wall time, one line per run (ours: its makers' grading; TRL: the common
    grader), the common grader's final figures as markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 5), constrained_layout=True)
    for side, colour in (("ours", "C0"), ("trl", "C1")):
        for index, run in enumerate(runs[side]):
            points = [(0.0, base)] * (side == "trl") + [(seconds, accuracy) for seconds, accuracy, _ in
                                                          run["curve_own"]]
            seconds, accuracy = zip(*points, strict=True)
            axis.plot(seconds, accuracy, color=colour, alpha=0.6, marker="o", markersize=3,
                      label=("detached-rl (its makers' grading)" if side == "ours" else "TRL") if not index
                      else None)
            axis.plot([run["job_s"]], [run["after"]], color=colour, marker="*", markersize=10)
    axis.set_xlabel("wall time since the job started (s)")
    axis.set_ylabel("held-out accuracy")
    axis.set_title("held-out accuracy against wall time (stars: the common grader at the end)")
    axis.grid(alpha=0.3)
    axis.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
