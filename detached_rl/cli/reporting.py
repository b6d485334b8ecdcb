"""What a run leaves behind: per-step metrics as JSONL and TensorBoard events, a PNG plot, an accuracy table.

`MetricsRecorder` appends one JSON object per training step to `metrics.jsonl` (always) and
writes every numeric value as a TensorBoard scalar at that step (`tensorboard` and `matplotlib` are
plain dependencies); each held-out evaluation adds a row of its own (`"kind": "eval"`, the `eval/*` names of
`evaluation_row`) at the step it was taken. `plot_metrics` draws held-out accuracy (± one standard error),
reward, KL and response length per step. `evaluation_summary` summarises graded held-out answers.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from detached_rl.algorithms.metrics import LOSS_KL, metric_value

# (metric key, panel title) of the four panels of `plot_metrics`, in order; keys are names of
# `detached_rl.algorithms.metrics` (rows that carry only an old alias of a name are read too).
PLOT_PANELS = (
    ("eval/accuracy", "held-out accuracy (± 1 standard error)"),
    ("reward/mean", "reward (mean of the batch)"),
    (LOSS_KL, "KL to the reference"),
    ("response_length/mean", "response length (tokens)"),
)
#: The `kind` of a metrics.jsonl row that holds a held-out evaluation; training rows carry no `kind`.
EVAL_ROW = "eval"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a reader sees null
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class MetricsRecorder:
    """Appends per-step metrics to `<directory>/metrics.jsonl` and TensorBoard events in
    `<directory>/tensorboard`."""

    def __init__(self, directory: str | Path, tensorboard: bool = True) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")
        self._writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            # a broken install (tensorboard is a dependency): JSONL only, and say so
            except ImportError as error:
                logging.getLogger(__name__).warning("no TensorBoard events, metrics.jsonl only: %s", error)
                SummaryWriter = None  # noqa: N806
            if SummaryWriter is not None:
                self._writer = SummaryWriter(log_dir=str(self.directory / "tensorboard"))


    def record(self, step: int, metrics: dict[str, Any]) -> None:
        """Write one step's metrics (numbers become scalars; anything else is kept in the JSONL only)."""
        row = {"step": step, **metrics}
        self._file.write(json.dumps(_jsonable(row), sort_keys=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        """Flush and close the files."""
        self._file.close()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()

    def __enter__(self) -> MetricsRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path, kind: str | None = "train") -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file: the training steps' ("train"), the held-out evaluations' ("eval") or
    all (None)."""
    with Path(path).open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if kind is None:
        return rows
    return [row for row in rows if (row.get("kind") == EVAL_ROW) == (kind == EVAL_ROW)]


def plot_series(rows: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) points of each `PLOT_PANELS` key, from the rows that carry it (under
    its name or an old alias)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for key, _ in PLOT_PANELS:
        values = [(row["step"], metric_value(row, key)) for row in rows]
        series[key] = [(step, value) for step, value in values if isinstance(value, int | float)]
    return series


def plot_metrics(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """A 2x2 PNG of held-out accuracy, reward, KL and response length per step (missing series say so).

    `rows`: training and evaluation rows (`read_metrics(path, kind=None)`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    rows = sorted(rows, key=lambda row: row["step"])  # evaluation rows land when answered, not in step order
    series = plot_series(rows)
    for axis, (key, label) in zip(axes.flat, PLOT_PANELS, strict=True):
        points = series[key]
        if points:
            steps, values = zip(*points, strict=True)
            axis.plot(steps, values, marker="o", markersize=3, linewidth=1.2)
            if key == "eval/accuracy":
                errors = [row.get("eval/accuracy_se") or 0.0 for row in rows
                          if isinstance(row.get(key), int | float)]
                if len(errors) == len(values):
                    axis.fill_between(steps, [v - e for v, e in zip(values, errors, strict=True)],
                                      [v + e for v, e in zip(values, errors, strict=True)], alpha=0.2)
        else:
            axis.text(0.5, 0.5, f"no {key!r} recorded", ha="center", va="center", transform=axis.transAxes)
        axis.set_title(label)
        axis.set_xlabel("step (policy version)")
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    path = Path(path)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def accuracy(results: Sequence[dict[str, Any]], key: str = "correct") -> float:
    """Mean of `key` over graded answers (0.0 for none)."""
    values = [float(r.get(key, 0.0)) for r in results]
    return sum(values) / len(values) if values else 0.0


def standard_error(share: float, count: int | float) -> float:
    """Binomial standard error of a share measured on `count` independent problems (0.0 for none)."""
    return math.sqrt(share * (1.0 - share) / count) if count > 0 else 0.0


def evaluation_summary(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Accuracy with its standard error, format rate, lenient accuracy (when graded), mean reward and length
    of graded answers."""
    correct = accuracy(results, "correct")
    summary = {"accuracy": correct, "accuracy_se": standard_error(correct, len(results)),
               "reward": accuracy(results, "reward"), "response_length": accuracy(results, "response_length"),
               "count": float(len(results))}
    for key in ("format", "lenient"):
        if results and all(key in r for r in results):
            summary[f"{key}_rate" if key == "format" else "lenient_accuracy"] = accuracy(results, key)
    return summary


def evaluation_row(results: Sequence[dict[str, Any]], seconds: float, label: str,
                   job_seconds: float | None = None) -> dict[str, Any]:
    """A held-out evaluation as a metrics.jsonl row (without its step): `eval/*` figures, the policy
    versions that answered (a curve point taken while makers swap weights may span two), the seconds it
    took and, given `job_seconds`, when it was answered (seconds since the job started)."""
    summary = evaluation_summary(results)
    versions = [int(r["policy_version"]) for r in results if r.get("policy_version") is not None]
    row: dict[str, Any] = {"kind": EVAL_ROW, "eval/label": label}
    row.update({f"eval/{key}": value for key, value in summary.items()})
    if versions:
        row.update({"eval/policy_version_min": min(versions), "eval/policy_version_max": max(versions)})
    row["eval/seconds"] = seconds
    if job_seconds is not None:
        row["eval/job_seconds"] = job_seconds
    return row


def side_by_side(before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]], count: int,
                 width: int = 160) -> str:
    """The first `count` held-out prompts with the answer before and after training, marked right or wrong."""

    def shown(result: dict[str, Any]) -> str:
        mark = "right" if result.get("correct") else "wrong"
        text = " | ".join(line.strip() for line in result["response"].strip().splitlines() if line.strip())
        return f"[{mark}] {text[:width]}"

    lines = []
    for b, a in list(zip(before, after, strict=False))[:count]:
        lines += [f"  Q: {b['prompt'][:width]}", f"     before {shown(b)}", f"     after  {shown(a)}"]
    return "\n".join(lines)
