"""Run untrusted Python (e.g. model-written solutions) in a resource-limited child process.

Layers, from strongest to weakest:

* the child is a separate process in its own session (the whole process group is killed on
  timeout and at the end), started in a fresh empty temporary directory that is deleted
  afterwards, with no inherited environment (secrets in our env are invisible) and
  `python -I -S -B` (no user site, no site-packages, no PYTHON* variables, no .pyc writes);
* kernel resource limits, set by the child on itself before the untrusted code runs:
  CPU seconds, address space, file size, open files, core dumps, processes;
* a network namespace (`unshare -rn`, only loopback, no route out) when the kernel lets us
  create one without privileges; otherwise nothing at the OS level stops network access;
* a Python audit hook installed before the untrusted code runs, which cannot be removed, and
  which denies sockets, starting processes, signalling other processes, changing rlimits,
  ctypes, writing (or linking, renaming, deleting) outside the working directory, and reading
  files other than the standard library, the working directory and a few devices.

What this cannot guarantee: the audit hook is a Python-level guard; it stops accidents and
naive attempts, not a determined attacker (e.g. a bug in a C extension, or code that finds the
hook's state through `gc`). Running as root, RLIMIT_NPROC does not apply and files are written
with root's permissions, so the hook is then the only guard against forking and writing outside
the directory. Without a usable network namespace, only the hook blocks the network. For
adversarial code, run the makers in a container or VM without credentials.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

MAX_CODE_BYTES = 120_000  # one argv string may hold at most 128 KiB on Linux
_NOFILE = 32
_THREAD_HEADROOM = 8  # RLIMIT_NPROC counts threads too; leave room for a few
_MAX_WRITE_OPENS = 64  # files the code may open for writing: RLIMIT_FSIZE bounds each, this bounds the count

# Runs in the child before the untrusted code (passed as argv[1]); str.format fills the {limits}.
_PRELUDE = r'''
import os, resource, sys

def _confine():
    limits = {limits!r}
    for name, value in limits.items():
        if value is None:
            continue
        kind = getattr(resource, name)
        hard = resource.getrlimit(kind)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, value + 1 if name == "RLIMIT_CPU" and value < hard else value))
    root = os.path.realpath(os.getcwd())
    readable = tuple(os.path.realpath(path) for path in sys.path if path) + (root,)
    devices = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
    own_proc = "/proc/%d" % os.getpid()
    own_pid = os.getpid()
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    block_processes = {block_processes!r}
    process_events = frozenset(("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
                                "os.system", "subprocess.Popen", "os.startfile", "pty.spawn"))
    blocked_imports = frozenset(("_ctypes", "ctypes") + (("_posixsubprocess",) if block_processes else ()))
    # event -> (indices of path arguments, indices of dir_fd arguments)
    path_events = {{
        "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,)),
        "os.rename": ((0, 1), (2, 3)), "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)),
        "os.utime": ((0,), (3,)), "os.truncate": ((0,), ()), "os.chflags": ((0,), ()),
        "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
    }}
    writes = [0]
    realpath, isdir, fsdecode, sep = os.path.realpath, os.path.isdir, os.fsdecode, os.sep

    def inside(path, dirs):
        return any(path == d or path.startswith(d + sep) for d in dirs)

    def deny(what):
        raise PermissionError("sandbox: " + what + " is not allowed")

    def check_open(path, flags):
        if isinstance(path, int):
            return
        path = realpath(fsdecode(path))
        if inside(path, (root,)):
            if flags & write_flags:
                writes[0] += 1
                if writes[0] > {max_write_opens}:
                    deny("opening more than {max_write_opens} files for writing")
            return
        if flags & write_flags:
            deny("writing " + path)
        if isdir(path):
            deny("opening directory " + path)  # a directory fd would let dir_fd calls escape
        if not (inside(path, readable) or path in devices or inside(path, (own_proc,))):
            deny("reading " + path)

    def hook(event, args):
        if event == "open":
            check_open(args[0], args[2] or 0)
        elif event in path_events:
            paths, dir_fds = path_events[event]
            for index in dir_fds:
                if index < len(args) and args[index] not in (None, -1):
                    deny(event + " with dir_fd")
            for index in paths:
                path = args[index]
                if isinstance(path, int) and event != "os.truncate":
                    deny(event + " on a file descriptor")
                if not isinstance(path, int) and not inside(realpath(fsdecode(path)), (root,)):
                    deny(event + " outside the working directory")
        elif event.startswith("socket.") or event.startswith("ctypes."):
            deny(event)
        elif event in ("os.link", "os.symlink", "os.killpg", "resource.setrlimit", "resource.prlimit"):
            deny(event)
        elif event == "os.kill" and args[0] != own_pid:
            deny("signalling other processes")
        elif event == "import" and args[0] in blocked_imports:
            deny("importing " + args[0])
        elif block_processes and event in process_events:
            deny("starting processes")

    sys.addaudithook(hook)

_confine()
del _confine
_source = sys.argv.pop(1)
sys.argv[0] = "solution.py"
exec(compile(_source, "solution.py", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
'''


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


@functools.cache
def network_isolation_prefix() -> tuple[str, ...]:
    """`unshare -rn` when an unprivileged network namespace can be created here, else ()."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10, env={})
    except (OSError, subprocess.SubprocessError):
        return ()
    return (unshare, "-rn") if probe.returncode == 0 else ()


def _user_task_count() -> int:
    """Processes and threads of our real uid: what RLIMIT_NPROC is compared against."""
    uid, count = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _nproc_limit(max_processes: int) -> int | None:
    """RLIMIT_NPROC for the child; None as root, where the kernel does not enforce it."""
    if os.getuid() == 0:
        return None
    return _user_task_count() + max_processes + _THREAD_HEADROOM


def _child_env(home: str) -> dict[str, str]:
    """A minimal environment: nothing of ours (API keys, tokens) leaks into the child."""
    return {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "HOME": home,
            "TMPDIR": home}


def _kill_group(pid: int) -> None:
    """SIGKILL the child's process group (the child leads it; not yet reaped, so its id is not reused)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _exit_reason(returncode: int) -> str | None:
    """Why the kernel ended the child, from a negative return code."""
    if returncode >= 0:
        return None
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = str(-returncode)
    return {"SIGXCPU": "cpu_limit", "SIGKILL": "killed"}.get(name, f"signal:{name}")


def _communicate(
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


def _await_exit(pid: int, deadline: float) -> bool:
    """Whether the child exits before `deadline`; does not reap it, so its group id stays reserved."""
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.002)
    return False


def run_python(
    code: str,
    stdin: str = "",
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    cpu_s: int | None = None,
    max_file_mb: int = 1,
    max_processes: int = 0,
    max_output_kb: int = 64,
) -> SandboxResult:
    """Run `code` as a script in a confined child process (see the module docstring); never raises for bad code.

    `cpu_s` defaults to the wall-clock timeout rounded up, plus one second. `max_processes` = 0
    forbids starting processes; as root (no RLIMIT_NPROC) process creation is always forbidden.
    stdout and stderr are each capped at `max_output_kb`; exceeding it kills the child.
    """
    if len(code.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES or "\0" in code:
        return SandboxResult(-1, "", "sandbox: code too long or contains NUL bytes", False, "invalid_code")
    nproc = _nproc_limit(max_processes)
    limits = {
        "RLIMIT_CPU": cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1,
        "RLIMIT_AS": memory_mb * 2**20,
        "RLIMIT_FSIZE": max_file_mb * 2**20,
        "RLIMIT_NOFILE": _NOFILE,
        "RLIMIT_CORE": 0,
        "RLIMIT_NPROC": nproc,
    }
    prelude = _PRELUDE.format(
        limits=limits, block_processes=max_processes == 0 or nproc is None, max_write_opens=_MAX_WRITE_OPENS
    )
    command = [*network_isolation_prefix(), sys.executable, "-I", "-S", "-B", "-c", prelude, code]
    workdir = tempfile.mkdtemp(prefix="detached_rl_sandbox_")
    try:
        try:
            # Limits are set by the child's prelude rather than a preexec_fn, which can deadlock
            # when the caller has other threads (makers score from worker threads).
            proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=workdir, env=_child_env(workdir), close_fds=True, start_new_session=True,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            return SandboxResult(-1, "", f"sandbox: could not start: {error}", False, "start_failed")
        deadline = time.monotonic() + timeout_s
        try:
            stdout, stderr, reason = _communicate(
                proc, stdin.encode("utf-8", "surrogateescape"), deadline, max_output_kb * 1024
            )
            if reason is None and not _await_exit(proc.pid, deadline):
                reason = "timeout"  # closed its output but kept running
        finally:
            _kill_group(proc.pid)
            returncode = proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        return SandboxResult(
            returncode=returncode,
            stdout=stdout.decode("utf-8", "replace"),
            stderr=stderr.decode("utf-8", "replace"),
            timed_out=reason == "timeout",
            killed_reason=reason or _exit_reason(returncode),
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
