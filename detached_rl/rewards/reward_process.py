"""Rewards run in a helper process: one that hangs is killed after its timeout, one that crashes is restarted.

The parent (a maker, or a scorer of the reward role) sends each reward call as a length-prefixed pickle on the
child's stdin; the child imports the reward by its path, calls it, turns its answer into plain floats (or
dicts of floats) and sends that back on a duplicate of its stdout. The reward's own prints go to stderr (the
maker's log). Answers are plain data, so the parent never unpickles a user's class.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!Q")
#: How a reward call failed, for the whole batch: it raised (or its process died), or ran past its timeout.
RAISED, TIMEOUT = "raised", "timeout"


def plain_values(answer: Any) -> list[Any] | str:
    """A reward's answer as a list of floats, dicts of floats, or None where a value is not a number; a str
    (why) when the answer is not one value per completion at all."""
    if isinstance(answer, str | bytes | dict) or not hasattr(answer, "__len__"):
        return f"returned a {type(answer).__name__}, not one value per completion"
    values: list[Any] = []
    for value in list(answer):
        if isinstance(value, dict):
            try:
                values.append({str(key): float(part) for key, part in value.items()})
            except (TypeError, ValueError):
                values.append(None)
            continue
        if isinstance(value, str | bytes):  # float("1") works; a reward's text is still not a number
            values.append(None)
            continue
        try:
            values.append(float(value))
        except (TypeError, ValueError):
            values.append(None)
    return values


def _write(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _serve() -> None:
    """The child: answer calls until stdin closes."""
    from detached_rl.rewards.specs import import_reward_module

    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward's prints go to stderr, not into the replies
    requests = sys.stdin.buffer
    functions: dict[str, Any] = {}
    while True:
        header = requests.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        target, prompts, completions, columns = pickle.loads(requests.read(_HEADER.unpack(header)[0]))
        try:
            if target not in functions:
                module, _, name = target.partition(":")
                found: Any = import_reward_module(module)
                for part in name.split("."):
                    found = getattr(found, part)
                functions[target] = found
            reply: Any = ("ok", plain_values(functions[target](prompts, completions, **columns)))
        except BaseException as error:  # noqa: BLE001 - anything the user's code raises is a refusal
            reply = ("raised", f"{type(error).__name__}: {error}"[:500])
        _write(replies, reply)


class RewardProcess:
    """A helper process that calls rewards by import path, each call bounded by a timeout."""

    def __init__(self, python_path: Sequence[str] | None = None) -> None:
        self.python_path = list(python_path if python_path is not None else sys.path)
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    def _start(self) -> subprocess.Popen:
        if self._process is None or self._process.poll() is not None:
            if self._process is not None:
                self.restarts += 1
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in self.python_path if p)}
            self._process = subprocess.Popen(
                [sys.executable, "-c", "from detached_rl.rewards.reward_process import _serve; _serve()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self._process

    def call(self, target: str, prompts: Sequence[str], completions: Sequence[str],
             columns: dict[str, list[Any]], timeout_s: float) -> tuple[str, Any]:
        """("ok", values) as `plain_values` gives them, ("raised", why) or ("timeout", why)."""
        with self._lock:
            process = self._start()
            try:
                _write(process.stdin, (target, list(prompts), list(completions), columns))
                deadline = time.monotonic() + timeout_s
                header = self._read(process, _HEADER.size, deadline)
                return pickle.loads(self._read(process, _HEADER.unpack(header)[0], deadline))
            except TimeoutError:
                self._kill()
                return TIMEOUT, f"ran past task.reward_timeout_s={timeout_s:g} s (its process was killed)"
            except (BrokenPipeError, EOFError, OSError) as error:
                code = self._kill()
                return RAISED, f"its process died (exit code {code}): {type(error).__name__}"

    @staticmethod
    def _read(process: subprocess.Popen, size: int, deadline: float) -> bytes:
        data = b""
        fd = process.stdout.fileno()
        while len(data) < size:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, size - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    def _kill(self) -> int | None:
        process, self._process = self._process, None
        if process is None:
            return None
        process.kill()
        code = process.wait()
        self.restarts += 1
        for stream in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        return code

    def close(self) -> None:
        """Stop the helper process."""
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                self._process.stdin.close()
                try:
                    self._process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
            self._process = None

    def __del__(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None:
            process.kill()


__all__ = ["RAISED", "TIMEOUT", "RewardProcess", "plain_values"]
