"""The held-out curve of `detached-rl run`: every `run.eval_every` steps the makers grade the held-out split
while training goes on, and each answered evaluation becomes an evaluation row of metrics.jsonl.

Makers grade in their own concurrency group (`evaluation`), one batch of prompts at a time under the same
generation lock as their experience batches, so a curve point slows generation a little and never stops
it; its answers come from the weights each maker serves then (a point may span two policy versions, and
its row says which). The before and after evaluations are the driver's (`JobRunner.evaluate`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from detached_rl.cli.reporting import MetricsRecorder, evaluation_row


def split_evenly(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """`items` in `parts` contiguous chunks whose sizes differ by at most one (empty chunks dropped)."""
    size, extra = divmod(len(items), parts)
    chunks, begin = [], 0
    for index in range(parts):
        end = begin + size + (index < extra)
        chunks.append(list(items[begin:end]))
        begin = end
    return [chunk for chunk in chunks if chunk]


def curve_steps(every: int, total_steps: int) -> list[int]:
    """The steps a curve point is due at: every `every` steps before the last (that one is the after
    evaluation); none for `every` 0."""
    return list(range(every, total_steps, every)) if every > 0 else []


class HeldOutCurve:
    """Starts a held-out evaluation on the live makers at each due step and records it once answered,
    without holding up the driver's poll loop; one point in flight at a time (a step that comes due while
    one is answered waits for it)."""

    def __init__(self, problems: Sequence[Any], every: int, total_steps: int, echo: Callable[[str], None],
                 job_started: float | None = None) -> None:
        self.problems = list(problems)
        self.job_started = time.monotonic() if job_started is None else job_started
        self.due_steps = curve_steps(every, total_steps)
        self.total_steps = total_steps
        self.echo = echo
        self._pending: tuple[int, float, list[Any]] | None = None

    def poll(self, step: int, makers: Mapping[str, Any], recorder: MetricsRecorder) -> None:
        """Record a point that has been answered; start the next one once `step` reaches it."""
        self.collect(recorder, timeout=0.0)
        if self._pending is not None or not self.due_steps or step < self.due_steps[0] or not makers:
            return
        if step >= self.total_steps:  # training is over: the after evaluation is the last point
            self.due_steps.clear()
            return
        while self.due_steps and self.due_steps[0] <= step:
            self.due_steps.pop(0)
        chunks = split_evenly(self.problems, len(makers))
        # Graded once each maker serves this step's weights (a push may still be on its way when the trainer
        # reports the step); a maker that never gets them grades with what it serves, and the row says so.
        refs = [handle.evaluate.remote(chunk, min_version=step)
                for handle, chunk in zip(makers.values(), chunks, strict=False)]
        self._pending = (step, time.monotonic(), refs)

    def collect(self, recorder: MetricsRecorder, timeout: float) -> None:
        """Record the point in flight if it is answered within `timeout` s; a point that failed or is
        not answered by a positive `timeout` is reported and left out."""
        import ray

        if self._pending is None:
            return
        step, started, refs = self._pending
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs) and timeout <= 0:
            return
        self._pending = None
        try:
            if len(ready) < len(refs):
                raise TimeoutError(f"not answered within {timeout:.0f} s")
            parts = ray.get(refs)
        except (ray.exceptions.RayError, TimeoutError) as error:
            self.echo(f"warning: held-out curve point at step {step} left out "
                      f"({type(error).__name__}: {error})")
            return
        results = [result for part in parts for result in part]
        row = evaluation_row(results, time.monotonic() - started, f"step {step}",
                             job_seconds=time.monotonic() - self.job_started)
        step = row.get("eval/policy_version_min", step)  # its step: the oldest weights that answered
        recorder.record(step, row)
        self.echo(f"held-out at step {step}: {describe(row)}")


def describe(row: Mapping[str, Any]) -> str:
    """'accuracy 38.7% ± 3.0 on 256 problems (policy version 24, 17.9 s)' for an evaluation row."""
    low, high = row.get("eval/policy_version_min"), row.get("eval/policy_version_max")
    versions = f"policy version {low}" if low == high else f"policy versions {low}-{high}"
    return (f"accuracy {row['eval/accuracy']:.1%} ± {100 * row['eval/accuracy_se']:.1f} on "
            f"{int(row['eval/count'])} problems ({versions}, {row['eval/seconds']:.1f} s)")
