"""What `detached-rl run` shows and keeps of its results: progress line, plot, summary.json, the table."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from detached_rl.algorithms.metrics import LOSS_KL, metric_value
from detached_rl.cli.reporting import evaluation_summary, plot_metrics, read_metrics, side_by_side
from detached_rl.cli.run_setup import RunResult
from detached_rl.config import RunConfig

TRAINER_SUMMARY_KEYS = ("name", "rank", "world_size", "state", "policy_version", "steps", "samples_trained",
                        "device", "last_error")
MAKER_SUMMARY_KEYS = ("name", "state", "restarted", "backend", "policy_version", "samples_made",
                      "tokens_per_s", "last_error")


def progress_line(row: dict[str, Any], status: dict[str, Any], elapsed: float,
                  versions: dict[str, Any]) -> str:
    """The progress bar's text after a step: reward, correct share, KL, samples/s, each maker's version."""
    served = " ".join(f"m{i}:v{v}" for i, v in enumerate(versions.values()))
    kl = metric_value(row, LOSS_KL)
    parts = [f"reward {row.get('reward/mean', float('nan')):.3f}"]
    if "info/correct" in row:
        parts.append(f"correct {row['info/correct']:.0%}")
    parts += [f"KL {kl:.4f}" if kl is not None else "KL n/a",
              f"{status['samples_trained'] / max(elapsed, 1e-9):.2f} samples/s", f"makers {served}"]
    return ", ".join(parts)


def shown_value(summary: dict[str, Any], key: str) -> str:
    """One figure of an evaluation summary as the table shows it ('38.7% ± 3.0' for the accuracy)."""
    value = summary[key]
    if key == "accuracy":
        return f"{value:.1%} ± {100 * summary.get('accuracy_se', 0.0):.1f}"
    return f"{value:.2f}" if key in ("reward", "response_length") else f"{value:.1%}"


def write_report(name: str, directory: Path, config: RunConfig,
                 evaluations: tuple[list[dict[str, Any]], list[dict[str, Any]]], trained: dict[str, Any],
                 files: dict[str, str], seconds: float, dead_makers: dict[str, str],
                 echo: Callable[[str], None]) -> RunResult:
    """Draw the plot, write summary.json and show the before/after table; the run's `RunResult`."""
    before, after = evaluations
    summary_before, summary_after = evaluation_summary(before), evaluation_summary(after)
    result = RunResult(name, directory, seconds, int(trained["trainer"]["steps"]), summary_before,
                       summary_after, {**files, "metrics": str(directory / "metrics.jsonl"),
                                       "tensorboard": str(directory / "tensorboard")})
    # A failure drawing the plot is reported and leaves the plot out; eval.json is on disk already.
    plot = directory / "metrics.png"
    try:
        plot_metrics(read_metrics(directory / "metrics.jsonl", kind=None), plot, title=name)
    except Exception as error:  # noqa: BLE001 - reported; the run's results are written below
        echo(f"warning: {plot} not written ({type(error).__name__}: {error})")
    else:
        result.files["plot"] = str(plot)
    summary = {"name": name, "seconds": seconds, "train_seconds": trained["seconds"],
               "steps": result.steps, "held_out_before": summary_before, "held_out_after": summary_after,
               "trainers": [{k: t.get(k) for k in TRAINER_SUMMARY_KEYS} for t in trained["trainers"]],
               "makers": [{k: m.get(k) for k in MAKER_SUMMARY_KEYS} for m in trained["makers"]],
               "cpu_count": os.cpu_count(), "files": result.files}
    (directory / "summary.json").write_text(json.dumps(summary, indent=1))
    echo("")
    echo(f"{'':24}{'before':>14}{'after':>14}")
    labels = (("accuracy", "held-out accuracy"), ("format_rate", "answer format"),
              ("lenient_accuracy", "last number right"), ("reward", "mean reward"),
              ("response_length", "response tokens"))
    for key, label in labels:
        if key in summary_before and key in summary_after:
            shown = "".join(f"{shown_value(summary, key):>14}" for summary in (summary_before, summary_after))
            echo(f"{label:<24}{shown}")
    echo(f"(± one standard error over {int(summary_after['count'])} held-out problems)")
    if config.run.examples:
        echo("\nexamples (held-out):")
        echo(side_by_side(before, after, config.run.examples))
    if dead_makers:
        died = "; ".join(f"{maker}: {why}" for maker, why in dead_makers.items())
        echo(f"\nmakers that died during the run: {died}")
    echo(f"\n{result.steps} steps, {seconds:.0f} s in all ({trained['seconds']:.0f} s training); "
         f"results in {directory}")
    return result
