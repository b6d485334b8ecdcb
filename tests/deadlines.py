"""Deadlines that scale with the machine: a bound a test waits for is the bound on an idle reference box times
how much slower this machine starts a Python process that imports torch, measured once per test session.

CI's box is 1-1.8x slower than an idle development VM, and a user runs makers beside a busy trainer: a fixed
number that holds on an idle box fails there. `scaled(seconds)` never shrinks a bound (a faster machine keeps
the reference's), and `DETACHED_RL_DEADLINE_SCALE` overrides the measurement (e.g. under a debugger).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

SCALE_VARIABLE = "DETACHED_RL_DEADLINE_SCALE"
# `python -c "import torch, transformers"`'s wall time on the idle reference box (x86_64 AMD EPYC VM, 2 cores,
# 2026-12-07: 3.5, 3.0, 3.1 s), the start-up every Ray worker and `detached-rl` job pays.
REFERENCE_STARTUP_S = 3.0
STARTUP_PROBE = "import torch, transformers"


@functools.cache
def startup_seconds() -> float:
    """This machine's wall time now for a Python process that imports torch and transformers (the faster of
    two, so a one-off hiccup does not count)."""
    times = []
    for _ in range(2):
        started = time.monotonic()
        subprocess.run([sys.executable, "-c", STARTUP_PROBE], check=True, capture_output=True, timeout=600)
        times.append(time.monotonic() - started)
    return min(times)


@functools.cache
def slowness() -> float:
    """How many times slower than the reference box this machine starts a process now (at least 1)."""
    if (fixed := os.environ.get(SCALE_VARIABLE)) is not None:
        return max(1.0, float(fixed))
    return max(1.0, startup_seconds() / REFERENCE_STARTUP_S)


def scaled(seconds: float) -> float:
    """`seconds`, a deadline that holds on the idle reference box, scaled to this machine."""
    return seconds * slowness()
