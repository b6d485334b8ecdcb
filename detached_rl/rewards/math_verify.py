"""math-verify in a helper process, for the `boxed` reward: loud when it cannot run, never silently weaker.

Serves math-verify in a separate process: sympy can spin for minutes (or forever) on answers
such as 2^{2^{2^{2^{100}}}}, math-verify's own timeouts use SIGALRM, which only works in a main
thread, and makers score from worker threads. Its main thread keeps those timeouts; the caller
kills it if it still overruns, and a memory cap turns huge integers into a quick MemoryError.

Failure policy: math-verify not installed is a broken install (it is a dependency), so a call
raises `MathVerifyUnavailable`. A worker that does not come up is logged with its stderr, the
call answers None (the reward then says so in its `verifier_unavailable` component, a metric),
and the next call after `retry_after_s` starts a worker again: one failure never downgrades
the process for good.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import math
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from detached_rl.core.line_reader import LineReader

logger = logging.getLogger(__name__)

WORKER_CODE = """\
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
from math_verify import parse, verify
print("ready", flush=True)
for line in sys.stdin:
    gold, guess, timeout = json.loads(line)
    try:
        gold = parse("\\\\boxed{" + gold + "}", parsing_timeout=timeout)
        guess = parse("\\\\boxed{" + guess + "}", parsing_timeout=timeout)
        equal = bool(gold and guess and verify(gold, guess, timeout_seconds=timeout))
    except Exception:
        equal = False
    print(json.dumps(equal), flush=True)
"""


class MathVerifyUnavailable(RuntimeError):
    """math-verify cannot run here at all (not installed)."""


class MathVerifyWorker:
    """A lazily started, thread-safe math-verify process; restarted after it is killed for overrunning."""

    startup_timeout_s = 120.0
    retry_after_s = 30.0  # after a failed start, calls answer None this long before a new start is tried

    def __init__(self, code: str = WORKER_CODE, installed: bool | None = None) -> None:
        self._code = code
        self._lock = threading.Lock()
        self._process: subprocess.Popen[str] | None = None
        self._stderr: IO[str] | None = None
        self._reader: LineReader | None = None  # the worker's stdout
        if installed is None:
            installed = importlib.util.find_spec("math_verify") is not None
        self._installed = installed
        self._down_until = 0.0
        self.failed_starts = 0
        self.timeouts = 0
        atexit.register(self.close)

    def _readline(self, timeout_s: float) -> str | None:
        """One line from the worker, or None on timeout or exit."""
        assert self._reader is not None
        return self._reader.readline(timeout_s)

    def _start(self) -> bool:
        """Start the worker; False (logged, retried after `retry_after_s`) if it does not come up."""
        # Lives as long as the worker; closed in close().
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", self._code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=self._stderr, text=True,
            )
            self._reader = LineReader(self._process.stdout.fileno())
            ready = self._readline(self.startup_timeout_s) == "ready\n"
        except OSError as error:
            ready, detail = False, str(error)
        else:
            detail = self._stderr_tail()
        if ready:
            return True
        self.close()
        self.failed_starts += 1
        self._down_until = time.monotonic() + self.retry_after_s
        logger.warning("math-verify worker did not start (%d failed starts; retrying in %.0f s); boxed "
                       "answers are compared as strings meanwhile and counted in the reward's "
                       "verifier_unavailable: %s",
                       self.failed_starts, self.retry_after_s, detail or "no output")
        return False

    def _stderr_tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        lines = self._stderr.read()[-2000:].strip().splitlines()
        return lines[-1] if lines else ""

    def close(self) -> None:
        """Kill the worker (the next call starts a new one)."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for stream in (self._process.stdin, self._process.stdout):
                if stream is not None:
                    stream.close()
            self._process = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def equal(self, predicted: str, answer: str, timeout_s: float) -> bool | None:
        """Whether math-verify deems them equivalent (an overrun counts as not);
        None when its worker is down."""
        if not self._installed:
            raise MathVerifyUnavailable("the boxed reward needs math-verify, which is not installed "
                                        "(pip install math-verify==0.9.0, a dependency of detached-rl)")
        with self._lock:
            if self._process is None and (time.monotonic() < self._down_until or not self._start()):
                return None
            assert self._process is not None and self._process.stdin is not None
            try:
                self._process.stdin.write(json.dumps([answer, predicted, max(1, math.ceil(timeout_s))])
                                          + "\n")
                self._process.stdin.flush()
                # two parses and a comparison, each with its own timeout
                reply = self._readline(3 * timeout_s + 1)
            except (OSError, ValueError):
                reply = None
            if not reply:
                self.timeouts += 1
                self.close()
                return False
            return json.loads(reply) is True
