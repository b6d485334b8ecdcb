"""What runs inside the sandboxed interpreter besides the untrusted code: the audit-hook prelude and the
probe.

The prelude is the sandbox's second layer (a Python audit hook behind the OS confinement, see
`detached_rl.rewards.sandbox`); the probe is what the first call runs to see its own confinement.
"""

from __future__ import annotations

MAX_WRITE_OPENS = 64  # files the code may open for writing (second layer; the tmpfs size bounds the bytes)

# Runs in the sandboxed interpreter before the untrusted code (passed as argv[1]): the audit hook, a
# second layer behind the OS confinement. str.format fills the {fields}.
_PRELUDE_TEMPLATE = r'''
import os, sys

def _confine():
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

    if {audit_hook!r}:
        sys.addaudithook(hook)

_confine()
del _confine
_source = sys.argv.pop(1)
sys.argv[0] = "solution.py"
exec(compile(_source, "solution.py", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
'''

# Run inside the sandbox by the first call: what the code would see of its own confinement.
PROBE = """\
fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(fields["Uid"].split()[0], fields["Gid"].split()[0], fields["Groups"].strip() or "-",
      fields["CapEff"].strip(), fields["CapBnd"].strip(), fields["NoNewPrivs"].strip(),
      fields["Seccomp"].strip())
"""


def prelude(block_processes: bool, audit_hook: bool) -> str:
    """The prelude program (passed as `-c`; the untrusted code follows as argv[1])."""
    return _PRELUDE_TEMPLATE.format(block_processes=block_processes, max_write_opens=MAX_WRITE_OPENS,
                                    audit_hook=audit_hook)
