"""The sandbox's pipes and exit codes: feed stdin, collect bounded output until a
deadline, read why it ended."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time


def exit_reason(returncode: int) -> str | None:
    """Why the kernel ended the child, from a negative return code."""
    if returncode >= 0:
        return None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return {"SIGXCPU": "cpu_limit", "SIGKILL": "killed"}.get(name, f"signal:{name}")


def from_bwrap_status(status: int) -> int:
    """bwrap exits with 128 + n when its command died of signal n; report that as -n, like subprocess."""
    return -(status - 128) if 128 < status <= 128 + 64 else status


def communicate(
    proc: subprocess.Popen, stdin: bytes, deadline: float, max_output_bytes: int
) -> tuple[bytes, bytes, str | None]:
    """Feed stdin, collect stdout/stderr until both close; "timeout" or "output_limit" when cut short."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    outputs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    pending = memoryview(stdin)
    with selectors.DefaultSelector() as selector:
        for fd in outputs:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while len(selector.get_map()) > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return bytes(outputs[proc.stdout.fileno()]), bytes(outputs[proc.stderr.fileno()]), "timeout"
            for key, _ in selector.select(remaining):
                fd = key.fd
                if fd in outputs:
                    try:
                        chunk = os.read(fd, 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        selector.unregister(fd)
                        continue
                    outputs[fd] += chunk
                    if len(outputs[fd]) > max_output_bytes:
                        del outputs[fd][max_output_bytes:]
                        return bytes(outputs[proc.stdout.fileno()]), bytes(outputs[proc.stderr.fileno()]), \
                            "output_limit"
                else:
                    try:
                        written = os.write(fd, pending[:65536])
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the child exited or closed stdin: the rest is not wanted
                        written = len(pending)
                    pending = pending[written:]
                    if not pending:
                        selector.unregister(fd)
                        proc.stdin.close()
    return bytes(outputs[proc.stdout.fileno()]), bytes(outputs[proc.stderr.fileno()]), None
