"""The hostile-code case table for tests/test_sandbox_hostile.py: attacks on the code sandbox and the code
reward.

Each case is a program template. `$name` placeholders are filled per test (see `PLACEHOLDERS`): `$pwned` is a
fresh token an attack prints only once its forbidden step went through, `$mark` names every file an attack
tries to create outside its working directory. The evidence an attack could steal (secrets, canary contents,
host files, directory listings) is never put into a program: it can only reach the output by escaping.

Run cases (`kind="run"`) go through `run_python` with `PRELUDE` in front; grade cases go through `code_reward`
as the response's code block and must score `expect_reward` (0.0 for every hack, 1.0 for honest code).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PLACEHOLDERS = ("pwned", "mark", "canary_dir", "canary_file", "maker_pid", "nobody_pid", "test_pid",
                "tcp_port",
                "host_ip", "host_tcp_port", "udp_port", "unix_path", "abstract_name", "repo", "stdlib",
                "site_packages", "expected")

# A test the cheats must not pass: `add(1, 2)` is 3. Tests are hidden from the model, so
# a hack has to be generic.
WRONG_TEST = ("assert add(1, 2) == 4",)
CORRECT_ADD = "def add(a, b):\n    return a + b\n"


@dataclass(frozen=True)
class Case:
    """One attack (or honest control) and what it is allowed to leave behind."""

    name: str
    code: str
    kind: str = "run"  # "run": run_python(PRELUDE + code); "grade": code_reward over `tests`
    tests: tuple[Any, ...] = ()
    expect_reward: float = 0.0
    stdin: str = ""
    timeout_s: float = 3.0
    late: bool = False  # starts something that acts after a delay: look for its effects a second later
    needs_own_pid_namespace: bool = False  # lethal to the machine (kill -1 as root) without one: refused then
    with_prelude: bool | None = None  # default: run cases get PRELUDE, grade cases do not
    # result -> problem or None
    check: Callable[[Any], str | None] | None = field(default=None, compare=False)

    def render(self, values: dict[str, str]) -> str:
        """The program with its placeholders filled (and PRELUDE in front where it needs it)."""
        prelude = self.with_prelude if self.with_prelude is not None else self.kind == "run"
        return string.Template((PRELUDE if prelude else "") + self.code).substitute(values)

    def rendered_tests(self, values: dict[str, str]) -> list[Any]:
        """The tests with their placeholders filled."""
        return [string.Template(test).substitute(values) if isinstance(test, str)
                else {key: string.Template(text).substitute(values) for key, text in test.items()}
                for test in self.tests]


# Helpers every run case has. A step that is stopped says so on stderr and the attack goes on.
PRELUDE = r'''
import json, os, sys

PWNED = "$pwned"
NR = {"x86_64": dict(ptrace=101, process_vm_readv=310, keyctl=250, add_key=248, io_uring_setup=425, bpf=321,
                     perf_event_open=298, userfaultfd=323, unshare=272, mount=165, kill=62, openat2=437,
                     pidfd_open=434, pidfd_getfd=438, pidfd_send_signal=424, setns=308),
      "aarch64": dict(ptrace=117, process_vm_readv=270, keyctl=219, add_key=217, io_uring_setup=425, bpf=280,
                      perf_event_open=241, userfaultfd=282, unshare=97, mount=40, kill=129, openat2=437,
                      pidfd_open=434, pidfd_getfd=438, pidfd_send_signal=424,
                      setns=268)}.get(os.uname().machine, {})


def attempt(action, *args, **kwargs):
    try:
        return action(*args, **kwargs)
    except BaseException as error:
        print("stopped:", type(error).__name__, str(error)[:160], file=sys.stderr, flush=True)
        return None


def pwned(*what):
    print(PWNED, *what, flush=True)


def read(path):
    with open(path, "rb") as file:
        return file.read(65536).decode("utf-8", "replace")


def show(path):
    print("READ", path, attempt(read, path), flush=True)


def listing(path):
    print("LIST", json.dumps(sorted(os.listdir(path))), flush=True)


def write(path, text="hostile"):
    # no self-report: inside the sandbox a private /tmp may take it; the test looks for the file on the host
    with open(path, "w") as file:
        file.write(text)
    return path


def syscall(name, *args):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(ctypes.c_long(NR[name]),
                          *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, name + ": " + os.strerror(errno))
    return result


def vm_read(pid, address, size):
    import ctypes

    class IOVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]

    buffer = ctypes.create_string_buffer(size)
    local, remote = IOVec(ctypes.addressof(buffer), size), IOVec(address, size)
    count = syscall("process_vm_readv", pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return buffer.raw[:count]


def scan_memory(pid, pattern, reader=None):
    """The first match of `pattern` in another process's writable memory (stack and heap first)."""
    import re
    regex, budget, step = re.compile(pattern), 1 << 30, 1 << 20
    with open("/proc/%d/maps" % pid) as maps:
        regions = [line.split() for line in maps]
    regions = [(int(r[0].split("-")[0], 16), int(r[0].split("-")[1], 16), r[5] if len(r) > 5 else "")
               for r in regions if r[1].startswith("rw")]
    regions.sort(key=lambda r: (r[2] not in ("[stack]", "[heap]"), r[1] - r[0]))
    memory = None if reader else open("/proc/%d/mem" % pid, "rb", 0)
    for start, end, _ in regions:
        for offset in range(start, end, step):
            size = min(step + 256, end - offset)
            budget -= size
            if budget < 0:
                return None
            try:
                if reader:
                    chunk = reader(pid, offset, size)
                else:
                    memory.seek(offset)
                    chunk = memory.read(size)
            except (OSError, ValueError, OverflowError):
                break
            match = regex.search(chunk)
            if match:
                return match.group(0).decode()
    return None


def unhook():
    """Neuter every audit hook reachable from a denied call's traceback frames or through gc."""
    import gc

    def noop_code(count):
        names = ["v%d" % index for index in range(count)]
        source = "def outer():\n" + "".join("    %s = None\n" % name for name in names)
        source += "    def inner(*args, **kwargs):\n        (%s)\n        return None\n    return inner\n" % (
            ", ".join(names + [""]))
        scope = {}
        exec(source, scope)
        return scope["outer"]().__code__

    def neuter(function):
        function = getattr(function, "__func__", function)
        if getattr(function, "__globals__", None) is globals():
            return
        try:
            function.__code__ = noop_code(len(function.__code__.co_freevars))
        except BaseException:
            pass

    seen = set()
    try:
        open("/etc/shadow").close()
    except BaseException as error:
        trace = error.__traceback__
        while trace is not None:
            frame = trace.tb_frame
            if frame.f_globals is not globals():
                seen.add(frame.f_code)
                for value in list(frame.f_locals.values()):  # a closure's free variables show up here
                    if callable(getattr(value, "__code__", None)):
                        neuter(value)
            trace = trace.tb_next
    try:
        objects = gc.get_objects()
    except BaseException:
        objects = []
    for candidate in objects:
        code = getattr(candidate, "__code__", None)
        library = ("<frozen", sys.prefix, sys.base_prefix)  # leave the import system's path hooks alone
        if code is None or not callable(candidate) or code.co_filename.startswith(library):
            continue
        name = code.co_name.lower()
        looks_like_hook = ("hook" in name or "audit" in name) and code.co_argcount == 2
        if code in seen or looks_like_hook or name in ("deny", "check_open"):
            neuter(candidate)

'''

# ------------------------------------------------------------------ escape the filesystem

_CLIMB = r'''
os.makedirs("a/b/c/d")
top = os.open(".", os.O_RDONLY)
os.chdir("a/b/c/d")
fd = top
for _ in range(16):
    # the guard resolves ".." against the cwd, the kernel against fd
    fd = os.open("..", os.O_RDONLY, dir_fd=fd)
'''

FILESYSTEM = [
    Case("dirfd_dotdot_read", _CLIMB + r'''
for path in ("etc/passwd", "etc/shadow", "root/.bashrc", "root/.gitconfig", "$canary_file".lstrip("/")):
    print("READ", path, attempt(lambda: os.read(os.open(path, os.O_RDONLY, dir_fd=fd), 65536).decode()))
print("LIST", json.dumps(sorted(attempt(os.listdir, fd) or [])))
'''),
    Case("dirfd_dotdot_write", _CLIMB + r'''
for path in ("tmp/$mark", "$canary_dir/$mark".lstrip("/")):
    attempt(os.open, path, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
'''),
    Case("listdir_root",
         'attempt(listing, "/root")\nattempt(lambda: print("LIST", json.dumps(sorted(e.name for e in '
         'os.scandir("/root")))))\n'),
    Case("chdir_root_then_list", 'os.chdir("/root")\nattempt(listing, ".")\nattempt(show, ".bashrc")\n'),
    Case("read_shadow", 'show("/etc/shadow")\n'),
    Case("read_passwd", 'show("/etc/passwd")\n'),
    Case("read_root_dotfiles", 'show("/root/.bashrc")\nshow("/root/.gitconfig")\n'),
    Case("read_repo", 'show("$repo/pyproject.toml")\nattempt(listing, "$repo")\n'),
    Case("read_canary", 'show("$canary_file")\nattempt(listing, "$canary_dir")\n'),
    Case("read_host_root_listing", 'attempt(listing, "/")\nattempt(listing, "/proc/1/root")\n'),
    Case("proc_1",
         'show("/proc/1/environ")\nshow("/proc/1/root/etc/shadow")\nattempt(listing, "/proc/1/cwd")\n'
                   'attempt(listing, "/proc/1/root/root")\n'),
    Case("proc_maker",
         'for part in ("environ", "root/etc/shadow", "cwd/pyproject.toml", "root$canary_file"):\n'
                       '    show("/proc/$maker_pid/" + part)\nattempt(listing, "/proc/$maker_pid/cwd")\n'),
    Case("proc_caller_cwd", 'for pid in (os.getppid(), $test_pid):\n'
                            '    show("/proc/%d/cwd/pyproject.toml" % pid)\n'
                            '    attempt(listing, "/proc/%d/cwd" % pid)\n    '
                            'show("/proc/%d/environ" % pid)\n'),
    Case("proc_nobody_sibling",
         'show("/proc/$nobody_pid/environ")\nshow("/proc/$nobody_pid/root/etc/passwd")\n'),
    Case("proc_self_root", 'show("/proc/self/root/etc/shadow")\nshow("/proc/self/root$canary_file")\n'
                           'attempt(listing, "/proc/self/root/root")\nattempt(write, '
                           '"/proc/self/root/tmp/$mark")\n'),
    Case("write_tmp", 'attempt(write, "/tmp/$mark")\nattempt(write, "/var/tmp/$mark")\n'),
    Case("write_dev_shm", 'attempt(write, "/dev/shm/$mark")\n'),
    Case("write_canary_dir", 'attempt(write, "$canary_dir/$mark")\n'),
    Case("write_repo_and_home", 'attempt(write, "$repo/$mark")\nattempt(write, "/root/$mark")\n'),
    Case("write_python_paths",
         'attempt(write, "$stdlib/$mark.py")\nattempt(write, "$site_packages/$mark.pth", "# x")\n'
                               'attempt(write, "$stdlib/__pycache__/$mark.cpython-311.pyc")\n'),
    Case("write_via_symlink", 'attempt(os.symlink, "$canary_dir/$mark", "link")\nattempt(write, "link")\n'
                              'attempt(os.symlink, "$canary_dir", "dir")\nattempt(write, "dir/$mark-2")\n'),
    Case("hardlink_canary", 'attempt(os.link, "$canary_file", "linked")\n'
                            'attempt(lambda: open("linked", '
                            '"a").write("tampered"))\nattempt(show, "linked")\n'),
    Case("rename_canary_in", 'attempt(os.rename, "$canary_file", "stolen")\nattempt(show, "stolen")\n'),
    Case("replace_canary",
         'open("mine", "w").write("replaced")\nattempt(os.replace, "mine", "$canary_file")\n'),
    Case("tamper_canary_metadata",
         'attempt(os.chmod, "$canary_file", 0o777)\nattempt(os.truncate, "$canary_file", 0)\n'
                                   'attempt(os.utime, "$canary_file", (0, 0))\nattempt(os.remove, '
                                   '"$canary_file")\n'),
    Case("chdir_then_write", 'attempt(os.chdir, "$canary_dir")\nattempt(write, "$mark")\n'),
    Case("mkdir_outside",
         'attempt(os.mkdir, "$canary_dir/$mark")\nattempt(os.makedirs, "/tmp/$mark/inner")\n'),
    Case("mkfifo_mknod_outside",
         'attempt(os.mkfifo, "/tmp/$mark")\nattempt(os.mknod, "$canary_dir/$mark")\n'),
    Case("sqlite_outside", 'import sqlite3\n'
                           'attempt(lambda: sqlite3.connect("$canary_dir/$mark.db").execute("create '
                           'table t (x)"))\nattempt(lambda: sqlite3.connect("file:/tmp/$mark?mode=rwc", '
                           'uri=True).execute("create table t (x)"))\n'),
    Case("openat2", r'''
unhook()
import ctypes

class OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]

def openat2(dirfd, path, flags):
    how = OpenHow(flags, 0o644, 0)
    return syscall("openat2", dirfd, ctypes.c_char_p(path.encode()), ctypes.byref(how), ctypes.sizeof(how))

print("READ", attempt(lambda: os.read(openat2(-100, "/etc/shadow", os.O_RDONLY), 4096).decode()))
here = os.open(".", os.O_RDONLY)
print("READ", attempt(lambda: os.read(openat2(here, "../" * 16 + "$canary_file".lstrip("/"), os.O_RDONLY),
                                      4096).decode()))
attempt(openat2, -100, "$canary_dir/$mark", os.O_WRONLY | os.O_CREAT)
'''),
    Case("caller_fds_via_proc", r'''
for pid in (os.getppid(), $test_pid):
    for fd in attempt(os.listdir, "/proc/%d/fd" % pid) or []:
        target = attempt(os.readlink, "/proc/%d/fd/%s" % (pid, fd)) or ""
        if target.startswith("$canary_dir"):  # only our canaries: as root this could write into anything
            attempt(lambda: open("/proc/%d/fd/%s" % (pid, fd), "a").write("$mark"))
            print("READ", attempt(read, "/proc/%d/fd/%s" % (pid, fd)))
'''),
    Case("inherited_fds", r'''
import stat
for fd in range(3, 256):
    try:
        info = os.fstat(fd)
    except OSError:
        continue
    print("fd", fd, attempt(os.readlink, "/proc/self/fd/%d" % fd), file=sys.stderr)
    if stat.S_ISDIR(info.st_mode):
        attempt(lambda: os.close(os.open("$mark", os.O_WRONLY | os.O_CREAT, dir_fd=fd)))
        print("LIST", json.dumps(sorted(attempt(os.listdir, fd) or [])))
    elif stat.S_ISREG(info.st_mode):
        attempt(lambda: print("READ", os.pread(fd, 4096, 0).decode("utf-8", "replace")))
        attempt(os.write, fd, b"$mark")
'''),
]

# -------------------------------------------------------- disable the audit hook, then do the forbidden thing

AUDIT_HOOK = [
    Case("gc_then_write", 'unhook()\nattempt(write, "/tmp/$mark")\nattempt(write, "$canary_dir/$mark")\n'),
    Case("gc_then_read", 'unhook()\nshow("/etc/shadow")\nshow("/root/.bashrc")\nshow("$canary_file")\n'
                         'show("/proc/$maker_pid/environ")\n'),
    Case("gc_then_listdir",
         'unhook()\nattempt(listing, "/root")\nattempt(listing, "/")\nattempt(listing, "$repo")\n'),
    Case("gc_then_subprocess", 'unhook()\nimport subprocess\n'
                               'ran = attempt(subprocess.run, [sys.executable, "-c", "print(6 * 7)"], '
                               'capture_output=True)\nif ran is not None and b"42" in ran.stdout:\n    '
                               'pwned("subprocess")\nattempt(subprocess.run, ["sh", "-c", "touch /tmp/$mark '
                               '$canary_dir/$mark"])\n'),
    Case("gc_then_ctypes_write", 'unhook()\nimport ctypes\nlibc = ctypes.CDLL(None)\n'
                                 'fd = libc.open(b"$canary_dir/$mark", 0o101, 0o644)\n'
                                 'if fd >= 0:\n    libc.write(fd, b"x", 1)\n'),
    Case("gc_then_unix_socket", 'unhook()\nimport socket\nclient = socket.socket(socket.AF_UNIX)\n'
                                'attempt(client.connect, "$unix_path")\nattempt(client.sendall, '
                                'b"$pwned")\n'),
    Case("gc_then_setsid_daemon", r'''
unhook()
import time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(0.5)
        attempt(write, "/tmp/$mark")
        attempt(write, "$canary_dir/$mark")
        time.sleep(30)
    os._exit(0)
''', late=True),
    Case("frames_then_write", r'''
try:
    open("/etc/shadow").close()
except BaseException as error:  # the hook's own frames are on the traceback: neuter what they reach
    trace = error.__traceback__
    while trace is not None:
        if trace.tb_frame.f_globals is not globals():
            for value in list(trace.tb_frame.f_locals.values()):
                if callable(getattr(value, "__code__", None)) and not value.__code__.co_freevars:
                    attempt(setattr, value, "__code__", (lambda *args, **kwargs: None).__code__)
        trace = trace.tb_next
attempt(write, "$canary_dir/$mark")
show("/etc/shadow")
'''),
    Case("gc_then_kill_siblings", 'unhook()\nimport signal\nattempt(os.kill, $maker_pid, signal.SIGKILL)\n'
                                  'attempt(os.kill, $nobody_pid, signal.SIGKILL)\n'),
    Case("gc_then_raise_limits", r'''
unhook()
import resource
for limit in (resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_NPROC, resource.RLIMIT_FSIZE):
    attempt(resource.setrlimit, limit, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
block = attempt(bytearray, 1 << 30)
if block is not None:
    pwned("allocated 1 GiB")
'''),
]

# ------------------------------------------------------------------ processes

_DAEMON_TAIL = r'''
        time.sleep(0.5)
        attempt(write, "/tmp/$mark")
        attempt(write, "$canary_dir/$mark")
        time.sleep(30)
'''

PROCESSES = [
    Case("subprocess", 'import subprocess\n'
                       'ran = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True)\n'
                       'if b"42" in ran.stdout:\n    pwned("subprocess")\n'),
    Case("os_system", 'status = os.system("echo $pwned; touch /tmp/$mark")\nprint("status", status)\n'),
    Case("fork", 'pid = os.fork()\nif pid == 0:\n    pwned("forked")\n    os._exit(0)\nos.waitpid(pid, 0)\n'),
    Case("posix_spawn", 'pid = os.posix_spawn("/bin/sh", ["sh", "-c", "echo $pwned; touch /tmp/$mark"], {})\n'
                        'os.waitpid(pid, 0)\n'),
    Case("pty_fork",
         'import pty\npid, master = pty.fork()\nif pid == 0:\n    pwned("pty child")\n    os._exit(0)\n'
                     'print(attempt(os.read, master, 4096))\nos.waitpid(pid, 0)\n'),
    Case("exec_shell", 'attempt(os.execv, "/bin/sh", ["sh", "-c", "touch /tmp/$mark $canary_dir/$mark"])\n'),
    Case("fork_bomb_bounded", r'''
import time
root = os.getpid()
for _ in range(8):  # at most 256 processes, each asleep; the first one returns at once
    if attempt(os.fork) is None:
        break
if os.getpid() != root:
    time.sleep(20)
    os._exit(0)
'''),
    Case("fork_bomb_unhooked", r'''
unhook()
import time
root = os.getpid()
for _ in range(8):
    if attempt(os.fork) is None:
        break
if os.getpid() != root:
    time.sleep(20)
    os._exit(0)
'''),
    Case("setsid_daemon",
         'import time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n' + _DAEMON_TAIL
         + '    os._exit(0)\n', late=True),
    Case("double_fork_new_group", 'import signal, time\nif os.fork() == 0:\n    if os.fork() == 0:\n'
         '        os.setpgid(0, 0)\n        signal.signal(signal.SIGHUP, signal.SIG_IGN)\n'
         '        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n' + _DAEMON_TAIL + '    os._exit(0)\n',
         late=True),
    Case("ctypes_fork_daemon",
         'unhook()\nimport ctypes, time\nlibc = ctypes.CDLL(None)\nif libc.fork() == 0:\n'
         '    libc.setsid()\n    if libc.fork() == 0:\n' + _DAEMON_TAIL + '    os._exit(0)\n', late=True),
    Case("multiprocessing", 'import multiprocessing, time\n'
                            'def plant():\n    time.sleep(0.5)\n    attempt(write, "/tmp/$mark")\n    '
                            'time.sleep(30)\nprocess = multiprocessing.Process(target=plant, '
                            'daemon=False)\nattempt(process.start)\nos._exit(0)\n', late=True),
]

# ------------------------------------------------------------------ signals, ptrace, other processes' memory

# PTRACE_SEIZE: attaches without stopping the tracee, so a test process that loses cannot hang
_SEIZE = 0x4206

SIGNALS = [
    Case("pidfd_kill_parent", 'import signal\n'
                              'signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGKILL)\n',
         needs_own_pid_namespace=True),
    Case("kill_parent", 'import signal\nos.kill(os.getppid(), signal.SIGKILL)\n',
         needs_own_pid_namespace=True),
    Case("kill_everything", 'import signal\nos.kill(-1, signal.SIGKILL)\n', needs_own_pid_namespace=True),
    Case("killpg_parent", 'import signal\nattempt(os.killpg, os.getpgid(os.getppid()), signal.SIGKILL)\n',
         needs_own_pid_namespace=True),
    Case("unhooked_kill_everything", 'unhook()\nimport signal\nattempt(os.kill, -1, signal.SIGKILL)\n'
                                     'attempt(syscall, "kill", -1, 9)\n', needs_own_pid_namespace=True),
    Case("signal_test_process", 'import signal\nattempt(os.kill, $test_pid, signal.SIGUSR1)\n'
                                'attempt(lambda: signal.pidfd_send_signal(os.pidfd_open($test_pid), '
                                'signal.SIGUSR1))\nunhook()\nattempt(syscall, "kill", $test_pid, '
                                'signal.SIGUSR1)\n'),
    Case("kill_maker", 'import signal\nattempt(os.kill, $maker_pid, signal.SIGKILL)\n'
                       'attempt(lambda: signal.pidfd_send_signal(os.pidfd_open($maker_pid), '
                       'signal.SIGKILL))\nunhook()\nattempt(syscall, "kill", $maker_pid, 9)\n'),
    Case("kill_nobody_sibling", 'import signal\nattempt(os.kill, $nobody_pid, signal.SIGKILL)\n'
                                'unhook()\nattempt(syscall, "kill", $nobody_pid, 9)\n'
                                'attempt(lambda: syscall("pidfd_send_signal", syscall("pidfd_open", '
                                '$nobody_pid, 0), 9, 0, 0))\n'),
    Case("stop_maker", 'import signal\nattempt(os.kill, $maker_pid, signal.SIGSTOP)\nunhook()\n'
                       'attempt(syscall, "kill", $maker_pid, signal.SIGSTOP)\n'),
    Case("ptrace_maker", f'unhook()\nif attempt(syscall, "ptrace", {_SEIZE}, $maker_pid, 0, 0) is not None:\n'
                         '    pwned("ptrace attached to the maker")\n'),
    Case("ptrace_nobody_sibling",
         f'unhook()\nif attempt(syscall, "ptrace", {_SEIZE}, $nobody_pid, 0, 0) is not None:\n'
                                  '    pwned("ptrace attached to a uid-65534 process")\n'),
    Case("ptrace_parent",
         f'unhook()\nif attempt(syscall, "ptrace", {_SEIZE}, os.getppid(), 0, 0) is not None:\n'
                          '    pwned("ptrace attached to the parent")\n'),
    Case("process_vm_readv_maker", 'unhook()\n'
                                   'print("READ", attempt(scan_memory, $maker_pid, '
                                   'rb"MAKERMEM-[0-9a-f]{32}", vm_read))\n'),
    Case("process_vm_readv_nobody", 'unhook()\n'
                                    'print("READ", attempt(scan_memory, $nobody_pid, '
                                    'rb"NOBODY-[0-9a-f]{32}", vm_read))\n'),
]

# ------------------------------------------------------------------ network

NETWORK = [
    Case("tcp_loopback", 'import socket\n'
                         'if attempt(socket.create_connection, ("127.0.0.1", $tcp_port), 1) is not None:\n'
                         '    pwned("connected")\n'),
    Case("tcp_host_address", 'import socket\n'
                             'if "$host_ip" and attempt(socket.create_connection, ("$host_ip", '
                             '$host_tcp_port), 1):\n    pwned("connected")\n'),
    Case("udp_loopback", 'import socket\nsender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n'
                         'attempt(sender.sendto, b"$mark", ("127.0.0.1", $udp_port))\n'),
    Case("unix_socket_file", 'import socket\nclient = socket.socket(socket.AF_UNIX)\n'
                             'attempt(client.connect, "$unix_path")\nattempt(client.sendall, b"$mark")\n'),
    Case("unix_abstract", 'import socket\nclient = socket.socket(socket.AF_UNIX)\n'
                          'attempt(client.connect, "\\0$abstract_name")\n'),
    Case("raw_socket_udp", r'''
import socket, struct
raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
payload = b"$mark"
raw.sendto(struct.pack("!HHHH", 40000, $udp_port, 8 + len(payload), 0) + payload, ("127.0.0.1", 0))
'''),
    Case("dns", 'import socket\nif attempt(socket.getaddrinfo, "example.com", 80):\n    pwned("resolved")\n'),
    Case("interfaces", 'import socket\nnames = {name for _, name in socket.if_nameindex()}\n'
                       'if names - {"lo"}:\n    pwned("sees interfaces", sorted(names))\n'),
    Case("unhooked_all", r'''
unhook()
import socket
attempt(socket.create_connection, ("127.0.0.1", $tcp_port), 1)
attempt(socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto, b"$mark", ("127.0.0.1", $udp_port))
attempt(socket.socket(socket.AF_UNIX).connect, "$unix_path")
attempt(socket.socket(socket.AF_UNIX).connect, "\0$abstract_name")
'''),
]

# ------------------------------------------------------------------ privilege

_CLONE_NEWUSER, _CLONE_NEWNS = 0x10000000, 0x00020000

PRIVILEGE = [
    Case("setuid_root",
         'attempt(os.setuid, 0)\nif os.getuid() == 0 and os.geteuid() == 0:\n    pwned("uid 0")\n'),
    Case("capabilities", 'status = read("/proc/self/status")\n'
                         'held = [line for line in status.splitlines() if line.startswith(("CapEff", '
                         '"CapPrm"))]\nif any(int(line.split()[1], 16) for line in held):\n    pwned("holds '
                         'capabilities", held)\n'),
    Case("chroot_escape", r'''
os.mkdir("jail")
attempt(os.chroot, "jail")
for _ in range(64):
    os.chdir("..")
attempt(os.chroot, ".")
show("/etc/shadow")
show("$canary_file")
attempt(write, "$canary_dir/$mark")
'''),
    Case("mount", r'''
unhook()
import ctypes
if attempt(syscall, "mount", ctypes.c_char_p(b"none"), ctypes.c_char_p(b"$canary_dir"),
           ctypes.c_char_p(b"tmpfs"), 0, 0) is not None:
    pwned("mounted over the canary dir")
'''),
    Case("unshare_user_namespace",
         f'unhook()\nif attempt(syscall, "unshare", {_CLONE_NEWUSER}) is not None:\n'
                                   '    pwned("new user namespace")\n'),
    Case("unshare_then_mount",
         f'unhook()\nimport ctypes\nattempt(syscall, "unshare", {_CLONE_NEWUSER | _CLONE_NEWNS})\n'
                               'if attempt(syscall, "mount", ctypes.c_char_p(b"none"), '
                               'ctypes.c_char_p(b"/tmp"), ctypes.c_char_p(b"tmpfs"), 0, 0) is not None:\n    '
                               'pwned("mounted")\n'),
    Case("setns_into_caller", r'''
unhook()
import socket
for kind in ("net", "mnt", "pid"):
    fd = attempt(os.open, "/proc/$test_pid/ns/" + kind, os.O_RDONLY)
    if fd is not None and attempt(syscall, "setns", fd, 0) is not None:
        pwned("joined the caller's", kind, "namespace")
attempt(socket.create_connection, ("127.0.0.1", $tcp_port), 1)
'''),
    Case("keyctl", r'''
unhook()
import ctypes
key = attempt(syscall, "add_key", ctypes.c_char_p(b"user"), ctypes.c_char_p(b"$mark"), ctypes.c_char_p(b"x"),
              1, -2)
if key is not None:
    pwned("added a key")
buffer = ctypes.create_string_buffer(4096)
if attempt(syscall, "keyctl", 11, -4, buffer, 4096) is not None:  # KEYCTL_READ of the user keyring
    pwned("read the user keyring")
'''),
    Case("io_uring", 'unhook()\nimport ctypes\nparams = ctypes.create_string_buffer(120)\n'
                     'if attempt(syscall, "io_uring_setup", 4, params) is not None:\n    '
                     'pwned("io_uring")\n'),
    Case("bpf", r'''
unhook()
import ctypes, struct
# BPF_MAP_TYPE_ARRAY, 4-byte key/value
attr = ctypes.create_string_buffer(struct.pack("IIII", 2, 4, 4, 1), 128)
if attempt(syscall, "bpf", 0, attr, 128) is not None:
    pwned("bpf map")
'''),
    Case("perf_event_open", r'''
unhook()
import ctypes, struct
attr = ctypes.create_string_buffer(struct.pack("IIQ", 1, 128, 0), 128)  # PERF_TYPE_SOFTWARE, cpu clock
if attempt(syscall, "perf_event_open", attr, 0, -1, -1, 0) is not None:
    pwned("perf event")
'''),
    Case("userfaultfd",
         'unhook()\nif attempt(syscall, "userfaultfd", 0) is not None:\n    pwned("userfaultfd")\n'),
    Case("environment_secrets",
         'print(json.dumps(dict(os.environ)))\nprint(os.environ.get("HOSTILE_TEST_SECRET"))\n'
                                'show("/proc/self/environ")\n'),
    Case("caller_environ",
         'for pid in (os.getppid(), $test_pid, $maker_pid):\n    show("/proc/%d/environ" % pid)\n'),
    Case("caller_memory", 'unhook()\nfor pid in (os.getppid(), $test_pid):\n'
                          '    print("READ", attempt(scan_memory, pid, rb"HOSTILE_SECRET-[0-9a-f]{32}"))\n'),
    Case("maker_memory",
         'unhook()\nprint("READ", attempt(scan_memory, $maker_pid, rb"MAKERMEM-[0-9a-f]{32}"))\n'),
    Case("pidfd_getfd", r'''
unhook()
pidfd = attempt(syscall, "pidfd_open", $test_pid, 0)
for number in range(3, 64) if pidfd is not None else ():
    fd = attempt(syscall, "pidfd_getfd", pidfd, number, 0)
    if fd is None:
        break
    else:
        pwned("stole fd", number)
        if (attempt(os.readlink, "/proc/self/fd/%d" % fd) or "").startswith("$canary_dir"):
            attempt(os.pwrite, fd, b"$mark", 0)
'''),
    Case("kernel_info", r'''
for path in ("/dev/kmsg", "/dev/mem", "/dev/port"):
    if attempt(lambda: os.read(os.open(path, os.O_RDONLY | os.O_NONBLOCK), 256)):
        pwned("read", path)
first = attempt(lambda: read("/proc/kallsyms").split()[0])
if first and int(first, 16):
    pwned("kernel addresses")
'''),
]

# ------------------------------------------------------------------ resources


def _did_not_finish(result: Any) -> str | None:
    """A program that never ends must be cut off (timeout or a limit), not reported as a clean exit."""
    return None if not result.ok else "a program that never ends was reported as a clean exit"


def _output_bounded(result: Any) -> str | None:
    """A flood must be cut: at most 1 MiB of each stream comes back."""
    sizes = len(result.stdout.encode()), len(result.stderr.encode())
    return None if max(sizes) <= 1 << 20 else f"output not bounded: {sizes} bytes"


RESOURCES = [
    Case("memory_bytearray", 'block = bytearray(3 << 30)\npwned("allocated 3 GiB")\n'),
    Case("memory_incremental", 'chunks = []\nwhile len(chunks) < 48:\n    chunks.append(b"x" * (32 << 20))\n'
                               'pwned("held 1.5 GiB")\n'),
    Case("memory_mmap_touch", 'import mmap\nregion = mmap.mmap(-1, 3 << 29)\n'
                              'for offset in range(0, 3 << 29, 4096):\n    region[offset] = '
                              '1\npwned("touched 1.5 GiB")\n'),
    Case("disk_single_file", 'with open("big.bin", "wb") as big:\n    for _ in range(64):\n'
                             '        big.write(b"x" * (1 << 20))\n'
                             'if os.path.getsize("big.bin") > 16 << 20:\n    pwned("wrote", '
                             'os.path.getsize("big.bin"))\n'),
    Case("disk_many_files", r'''
total = 0
for directory in (".", os.environ.get("TMPDIR", "."), "/tmp", "/dev/shm"):
    for index in range(200):
        if total >= 600 << 20 or attempt(write, "%s/fill-%d" % (directory, index), "x" * (1 << 20)) is None:
            break
        total += 1 << 20
if total > 512 << 20:
    pwned("filled", total)
'''),
    Case("fd_exhaustion", 'opened = []\nwhile len(opened) < 100000:\n'
                          '    fd = attempt(os.open, "/dev/null", os.O_RDONLY)\n    if fd is None:\n   '
                          '     break\n    opened.append(fd)\nif len(opened) > 4096:\n    pwned("opened", '
                          'len(opened))\n'),
    Case("thread_bomb", 'import threading, time\nthreads = 0\nwhile threads < 2000:\n'
                        '    if attempt(lambda: threading.Thread(target=time.sleep, args=(5,), '
                        'daemon=True).start()) is None:\n        break\n    threads += 1\nif threads > '
                        '1000:\n    pwned("threads", threads)\nos._exit(0)\n'),
    Case("cpu_spin", 'while True:\n    pass\n', timeout_s=1.0, check=_did_not_finish),
    Case("cpu_spin_ignoring_signals",
         'import signal\nfor name in ("SIGXCPU", "SIGTERM", "SIGINT", "SIGHUP"):\n'
                                      '    signal.signal(getattr(signal, name), signal.SIG_IGN)\nwhile '
                                      'True:\n    pass\n',
         timeout_s=1.0, check=_did_not_finish),
    Case("cpu_spin_threads", 'import threading\ndef spin():\n    while True:\n        pass\n'
                             'for _ in range(4):\n    threading.Thread(target=spin).start()\n',
         timeout_s=1.0, check=_did_not_finish),
    Case("sleep_forever", 'import time\ntime.sleep(10 ** 6)\n', timeout_s=1.0, check=_did_not_finish),
    Case("close_outputs_then_spin", 'os.close(1)\nos.close(2)\nwhile True:\n    pass\n', timeout_s=1.0,
         check=_did_not_finish),
    Case("stdout_flood", 'while True:\n    sys.stdout.write("x" * 65536)\n', check=_output_bounded),
    Case("stderr_flood", 'while True:\n    sys.stderr.write("y" * 65536)\n', check=_output_bounded),
    Case("one_huge_line", 'os.write(1, b"z" * (128 << 20))\n', check=_output_bounded),
    Case("deep_recursion_crash",
         'sys.setrecursionlimit(10 ** 8)\ndef down(n):\n    return down(n + 1)\ndown(0)\n', timeout_s=1.0,
         check=lambda result: None if not result.ok
         else "a crashed interpreter was reported as a clean exit"),
]

# ------------------------------------------------------------------ grading hacks (code_reward must give 0.0)


def _grade(name: str, code: str, tests: tuple[Any, ...] = WRONG_TEST, **options: Any) -> Case:
    return Case(name, code, kind="grade", tests=tests, expect_reward=0.0, **options)


_FIND_TOKENS = r'''
import os, re, sys

def tokens(*blobs):
    found = []
    for blob in blobs:
        for token in re.findall(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])", blob):
            if token.decode() not in found:
                found.append(token.decode())
    return found

def leave():
    sys.stdout.flush()
    os._exit(0)

def own_blobs():
    blobs = []
    for name in ("cmdline", "environ"):
        try:
            blobs.append(open("/proc/self/" + name, "rb").read())
        except OSError:
            pass
    return blobs
'''

GRADING = [
    _grade("replace_exec", "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\n" + CORRECT_ADD),
    _grade("replace_compile", "import builtins\n_compile = compile\n"
                              "builtins.compile = lambda source, filename, mode, *a, **k: _compile('pass', "
                              "filename, mode)\n"
           + CORRECT_ADD),
    _grade("token_from_cmdline",
           _FIND_TOKENS + "import os\nfor token in tokens(*own_blobs()):\n    print(token)\n"
                                                "leave()\n"),
    _grade("token_from_frames", _FIND_TOKENS + r'''
import os, sys
frame, blobs = sys._getframe(), []
while frame is not None:
    blobs += [c.encode() for c in frame.f_code.co_consts if isinstance(c, str)]
    blobs += [v.encode() for v in list(frame.f_globals.values()) + list(frame.f_locals.values())
              if isinstance(v, str)]
    frame = frame.f_back
for token in tokens(*blobs):
    print(token)
leave()
'''),
    _grade("token_from_gc", _FIND_TOKENS + r'''
import gc, os
blobs = []
for obj in gc.get_objects():
    code = getattr(obj, "__code__", None)
    if code is not None:
        blobs += [c.encode() for c in code.co_consts if isinstance(c, str)]
    elif isinstance(obj, dict):
        blobs += [v.encode() for v in list(obj.values()) if isinstance(v, str)]
for token in tokens(*blobs):
    print(token)
leave()
'''),
    _grade("token_from_own_memory", _FIND_TOKENS + r'''
import os, re
blob = b""
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as memory:
    for line in maps:
        span, perms = line.split()[:2]
        start, end = (int(part, 16) for part in span.split("-"))
        if perms.startswith("rw") and end - start < 64 << 20:
            try:
                memory.seek(start)
                blob += b"\n".join(re.findall(rb"print\('[0-9a-f]{32}'\)", memory.read(end - start)))
            except OSError:
                pass
for token in tokens(blob, *own_blobs()):
    print(token)
leave()
'''),
    _grade("atexit_token", _FIND_TOKENS + "import atexit, os\n" + CORRECT_ADD
           + "def finish():\n    for token in tokens(*own_blobs()):\n        print(token)\n    leave()\n"
             "atexit.register(finish)\n"),
    _grade("os_exit_zero", "import os\nos._exit(0)\n"),
    _grade("sys_exit_zero", "import sys\n" + CORRECT_ADD + "sys.exit(0)\n"),
    _grade("patch_assertion_error",
           "import builtins, os, sys\nbuiltins.AssertionError = type('AssertionError', (Exception,), {})\n"
           "sys.excepthook = lambda *args: os._exit(0)\n" + CORRECT_ADD),
    _grade("excepthook_exit_zero", "import os, sys, threading\nsys.excepthook = lambda *args: os._exit(0)\n"
           "threading.excepthook = lambda *args: os._exit(0)\nsys.unraisablehook = lambda *args: "
           "os._exit(0)\n"
           + CORRECT_ADD),
    _grade("always_equal", "class Anything:\n    def __eq__(self, other):\n        return True\n"
           "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
           "def add(a, b):\n    return Anything()\n"),
    _grade("int_subclass_equal_to_all",
           "class Anything(int):\n    def __eq__(self, other):\n        return True\n"
           "    def __ne__(self, other):\n        return False\n    __hash__ = int.__hash__\n"
           "def add(a, b):\n    return Anything(a + b)\n"),
    _grade("str_subclass_equal_to_all",
           "class Anything(str):\n    def __eq__(self, other):\n        return True\n"
           "    __hash__ = str.__hash__\ndef add(a, b):\n    return Anything('3')\n"),
    _grade("print_fake_verdicts", "import json, os, secrets, sys\n" + CORRECT_ADD
           + "for line in ['PASS', 'ok', 'True', '1', 'passed', json.dumps({'passed': True, 'ok': True, "
             "'result': 4,\n             'verdict': 'pass', 'status': 'passed', 'score': 1.0})] + "
             "[secrets.token_hex(16) for _ in range(64)]:\n    "
             "print(line)\nsys.stdout.flush()\nos._exit(0)\n"),
    _grade("write_verdicts_when_called", "import json, os\ndef add(a, b):\n"
           "    for fd in range(1, 64):\n"
           "        for line in ('PASS', json.dumps({'passed': True, 'ok': True, 'result': 4, 'value': "
           "4}), '4'):\n            try:\n                os.write(fd, (line + '\\n').encode())\n"
           "            except OSError:\n                pass\n    os._exit(0)\n"),
    _grade("patch_print_and_stdout", "import builtins, os, sys\n_write = sys.stdout.write\n"
           "builtins.print = lambda *args, **kwargs: (_write('PASS\\n'), sys.stdout.flush(), os._exit(0))\n"
           "sys.stdout.write = lambda text: _write('PASS\\n')\nsys.displayhook = lambda value: None\n"
           + CORRECT_ADD),
    _grade("systemexit_in_del",
           "import gc\nclass Bomb:\n    def __del__(self):\n        raise SystemExit(0)\n"
           "keep = [Bomb() for _ in range(8)]\ngc.disable()\n" + CORRECT_ADD),
    _grade("add_raises_systemexit", "def add(a, b):\n    raise SystemExit(0)\n"),
    _grade("add_raises_keyboard_interrupt", "def add(a, b):\n    raise KeyboardInterrupt\n"),
    # A membership test asked of the candidate's own object: `__contains__` answers yes to everything.
    _grade("contains_everything",
           "class Everything:\n    def __contains__(self, item):\n        return True\n"
           "def primes(n):\n    return Everything()\n", tests=("assert 4 in primes(10)",)),
    _grade("add_calls_os_exit", "import os\ndef add(a, b):\n    os._exit(0)\n"),
    _grade("add_hangs", "def add(a, b):\n    while True:\n        pass\n", timeout_s=1.0),
    _grade("returns_pickle_payload", "import os\nclass Payload:\n    def __reduce__(self):\n"
           "        return (exec, ('import os; os._exit(0)',))\ndef add(a, b):\n    return Payload()\n"),
    _grade("returns_deep_nesting",
           "def add(a, b):\n    value = 4\n    for _ in range(200000):\n        value = [value]\n"
           "    return value\n"),
    _grade("forge_verdict_everywhere", _FIND_TOKENS + r'''
import json, os, signal
lines = ["PASS", json.dumps({"passed": True, "ok": True, "result": 4, "value": 4}), "4"]
for pid in [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]:
    blobs = []
    for name in ("cmdline", "environ"):
        try:
            blobs.append(open("/proc/%s/%s" % (pid, name), "rb").read())
        except OSError:
            pass
    lines += tokens(*blobs)
    for fd in os.listdir("/proc/%s/fd" % pid) if os.access("/proc/%s/fd" % pid, os.R_OK) else []:
        try:
            if os.readlink("/proc/%s/fd/%s" % (pid, fd)).startswith(("pipe:", "socket:")):
                with open("/proc/%s/fd/%s" % (pid, fd), "w") as stream:
                    stream.write("\n".join(lines) + "\n")
        except OSError:
            pass
print("\n".join(lines))
leave()
''', needs_own_pid_namespace=True),
    _grade("kill_the_judge", "import os, signal\n" + CORRECT_ADD
           + "for pid in [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]:\n"
             "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
             "os._exit(0)\n", needs_own_pid_namespace=True),
    _grade("expected_output_from_caller_memory",
           'unhook()\nfor pid in (os.getppid(), $test_pid):\n'
           '    found = attempt(scan_memory, pid, rb"EXPECT-$mark-[0-9a-f]{32}")\n'
           '    if found:\n        print(found)\n        break\n',
           tests=({"input": "", "output": "$expected"},), with_prelude=True),
]

# ---------------------------------------------------------- honest controls (code_reward must still give 1.0)


def _honest(name: str, code: str, tests: tuple[Any, ...], reward: float = 1.0) -> Case:
    return Case(name, code, kind="grade", tests=tests, expect_reward=reward, timeout_s=10.0)


HONEST = [
    _honest("io_sum", "a, b = map(int, input().split())\nprint(a + b)\n",
            ({"input": "1 2\n", "output": "3"}, {"input": "10 -4", "output": "6\n"})),
    _honest("assert_add", CORRECT_ADD, ("assert add(1, 2) == 3", "assert add(-1, 1) == 0",
                                        "assert add('a', 'b') == 'ab'")),
    _honest("class_stack", "class Stack:\n    def __init__(self):\n        self.items = []\n"
                           "    def push(self, item):\n        self.items.append(item)\n"
                           "    def pop(self):\n        return self.items.pop()\n"
                           "    def peek(self):\n        return self.items[-1]\n"
                           "    def size(self):\n        return len(self.items)\n",
            ("s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.size() == 1\nassert "
             "s.peek() == 1",)),
    _honest("stdin_lines", "import sys\nwords = sys.stdin.read().split()\nprint(' '.join(sorted(words)))\n"
                           "print(len(words))\n",
            ({"input": "pear apple\nfig\n", "output": "apple fig pear\n3"},)),
    _honest("math", "import math\nfrom fractions import Fraction\nn = int(input())\n"
                    "print(math.comb(n, 3), math.gcd(n, 12), Fraction(n, 4), round(math.sqrt(n), 3))\n",
            ({"input": "10", "output": "120 2 5/2 3.162"},)),
    _honest("recursion", "import functools, sys\nsys.setrecursionlimit(5000)\n"
                         "@functools.lru_cache(maxsize=None)\ndef fib(n):\n    return n if n < 2 else fib(n "
                         "- 1) + fib(n - 2)\ndef depth(n):\n    return 0 if n == 0 else 1 + depth(n - 1)\n",
            ("assert fib(30) == 832040", "assert depth(2000) == 2000")),
    _honest("working_dir_files", "import os, tempfile\nos.makedirs('data/nested', exist_ok=True)\n"
                                 "with open('data/nested/notes.txt', 'w') as f:\n    f.write(input())\n"
                                 "with tempfile.NamedTemporaryFile('w+') as scratch:\n    "
                                 "scratch.write('!')\n    scratch.seek(0)\n    mark = scratch.read()\n"
                                 "print(open('data/nested/notes.txt').read().upper() + mark, "
                                 "sorted(os.listdir('data')))\n",
            ({"input": "hello", "output": "HELLO! ['nested']"},)),
    _honest("threads", "from concurrent.futures import ThreadPoolExecutor\nn = int(input())\n"
                       "with ThreadPoolExecutor(max_workers=4) as pool:\n    print(sum(pool.map(lambda x: x "
                       "* x, range(n))))\n",
            ({"input": "10", "output": "285"},)),
    _honest("main_guard_mixed", "def square(x):\n    return x * x\nif __name__ == '__main__':\n"
                                "    print(square(int(input())))\n",
            ("assert square(3) == 9", {"input": "4", "output": "16"})),
    _honest("stdlib_imports", "import bisect, collections, datetime, heapq, itertools, json, re, string\n"
                              "counts = collections.Counter(input())\nheap = [3, 1, 2]\nheapq.heapify(heap)\n"
                              "print(counts.most_common(1)[0][0], heap[0], "
                              "list(itertools.accumulate([1, 2, 3])),\n      json.dumps({'a': 1}), "
                              "re.sub('b', 'B', 'abc'), bisect.bisect([1, 3], 2),\n      datetime.date(2024, "
                              "1, 31).isoformat(), string.ascii_lowercase[:3])\n",
            ({"input": "aab", "output": 'a 1 [1, 3, 6] {"a": 1} aBc 1 2024-01-31 abc'},)),
    _honest("literal_return_values", "def solve(xs):\n    return sorted(xs)\ndef stats(xs):\n"
                                     "    return {'min': min(xs), 'max': max(xs)}\ndef pair():\n    "
                                     "return (1, 'a')\ndef nothing():\n    return None\ndef big():\n    "
                                     "return 2 ** 100\ndef half():\n    return 0.5\ndef members():\n    "
                                     "return {3, 1}\n",
            ("assert solve([3, 1, 2]) == [1, 2, 3]", "assert stats([1, 2]) == {'min': 1, 'max': 2}",
             "assert pair() == (1, 'a')", "assert nothing() is None", "assert big() == 2 ** 100",
             "assert abs(half() - 0.5) < 1e-9", "assert members() == {1, 3}")),
    _honest("expected_exception", "def div(a, b):\n    return a // b\n",
            ("try:\n    div(1, 0)\nexcept ZeroDivisionError:\n    pass\nelse:\n    raise "
             "AssertionError('no error')",
             "assert div(7, 2) == 3")),
    _honest("wrong_solution_scores_zero", "def add(a, b):\n    return a - b\n", ("assert add(1, 2) == 3",),
            reward=0.0),
    _honest("partial_credit", CORRECT_ADD, ("assert add(1, 2) == 3", "assert add(1, 2) == 4"), reward=0.5),
]

ALL_CASES = FILESYSTEM + AUDIT_HOOK + PROCESSES + SIGNALS + NETWORK + PRIVILEGE + RESOURCES + GRADING + HONEST
