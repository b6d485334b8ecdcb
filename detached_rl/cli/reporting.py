"""What a run leaves behind: per-step metrics as JSONL and TensorBoard events, a PNG plot, an accuracy table.

`MetricsRecorder` appends one JSON object per training step to `metrics.jsonl` (always) and
writes every numeric value as a TensorBoard scalar at that step (`tensorboard` and `matplotlib` are
plain dependencies). `plot_metrics` draws reward, KL, response length and weight-sync time per step.
`accuracy` and `format_comparison` summarise graded held-out answers.
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
    ("reward/mean", "reward (mean of the batch)"),
    (LOSS_KL, "KL to the reference"),
    ("response_length/mean", "response length (tokens)"),
    ("time/weight_sync", "weight sync time (s)"),
)


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


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file."""
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_series(rows: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) points of each `PLOT_PANELS` key, from the rows that carry it (under
    its name or an old alias)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for key, _ in PLOT_PANELS:
        values = [(row["step"], metric_value(row, key)) for row in rows]
        series[key] = [(step, value) for step, value in values if isinstance(value, int | float)]
    return series


def plot_metrics(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """A 2x2 PNG of reward, KL, response length and weight-sync time per step (missing series say so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    series = plot_series(rows)
    for axis, (key, label) in zip(axes.flat, PLOT_PANELS, strict=True):
        points = series[key]
        if points:
            steps, values = zip(*points, strict=True)
            axis.plot(steps, values, marker="o", markersize=3, linewidth=1.2)
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


def evaluation_summary(results: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Accuracy, format rate, lenient accuracy (when graded), mean reward and length of graded answers."""
    summary = {"accuracy": accuracy(results, "correct"), "reward": accuracy(results, "reward"),
               "response_length": accuracy(results, "response_length"), "count": float(len(results))}
    for key in ("format", "lenient"):
        if results and all(key in r for r in results):
            summary[f"{key}_rate" if key == "format" else "lenient_accuracy"] = accuracy(results, key)
    return summary


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
