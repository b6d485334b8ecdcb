"""Hostile code against the code sandbox and the code reward (issue 20), one table-driven class per attack
family.

Every case is judged by its effects, the same way: nothing escapes (canary files outside unchanged, no file
the attack named exists on the host, no secret, host file or host directory listing in its output, no listener
reached), the caller survives (this process gets no signal; a sibling "maker" and a sibling uid-65534 process
stay alive and running), no process outlives the call (this process is a child subreaper, so a daemon that
double-forks and setsids still ends up as our descendant), no hack scores and honest code still scores.
The canaries and the Unix socket are world-readable and -writable, so that only the sandbox, not file
permissions, keeps a uid-65534 attacker from them. `TestHarnessDetects` runs some attacks unconfined (as uid
65534, without the sandbox) and checks that each is caught: the checks can fail.
The cases live in tests/hostile_cases.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from detached_rl.rewards.functions import code_reward
from detached_rl.rewards.sandbox import run_python

from .hostile_cases import (
    ALL_CASES,
    AUDIT_HOOK,
    FILESYSTEM,
    GRADING,
    HONEST,
    NETWORK,
    PRIVILEGE,
    PROCESSES,
    RESOURCES,
    SIGNALS,
    Case,
)

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534
PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 2.0  # how long a leftover process may take to go away after the call returned
LATE_S = 0.7  # delayed attacks act 0.5 s after they start: look for their effects this much later
HANG_MARGIN_S = 30.0  # not a timing assertion: a call this far past its timeout has hung
# Top-level names of a standard Linux root; any other name in "/" identifies the host's root (e.g. /old_root).
STANDARD_ROOT_NAMES = {"bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32", "media", "mnt",
                       "opt",
                       "proc", "root", "run", "sbin", "srv", "sys", "tmp", "usr", "var", "work", "nix",
                       "snap"}
MAKER_CODE = "import sys\nheld = sys.stdin.readline()\nprint('ready', flush=True)\nsys.stdin.read()\n"


def _case_id(case: Case) -> str:
    return case.name


def _descendants(root: int) -> dict[int, str]:
    """Live (non-zombie) descendants of `root`: pid -> command line."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in "ZX":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, pending = {}, list(children.get(root, []))
    while pending:
        pid = pending.pop()
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            found[pid] = command.decode(errors="replace")[:120]
        except OSError:
            found[pid] = "?"
        pending += children.get(pid, [])
    return found


def _zombie_children(parent: int) -> set[int]:
    """Direct children of `parent` that have exited and wait to be reaped."""
    zombies = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == parent:
                zombies.add(int(entry.name))
    return zombies


def _state(pid: int) -> str:
    """The kernel's one-letter state of `pid` ("" when gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _pending_signals(pid: int) -> int:
    """Signals sent to `pid` and not yet handled (a stop or kill under load may take a moment to act)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields.get("SigPnd", "0"), 16) | int(fields.get("ShdPnd", "0"), 16)


def _longest_line(path: str) -> str | None:
    """The longest line of a file (evidence that it was read), or None when
    unreadable or too short to tell."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    line = max(lines, key=len, default="").strip()
    return line if len(line) >= 16 else None


def _host_address() -> str | None:
    """This machine's own non-loopback IPv4 address, if it has one (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def _nonblocking(sock: socket.socket) -> socket.socket:
    sock.setblocking(False)
    return sock


class World:
    """What lives around every attack for the whole module: listeners, siblings,
    the subreaper, a signal trap."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.pid = os.getpid()
        self.usr1: list[int] = []
        self.host_ip = _host_address()
        tcp = _nonblocking(socket.create_server(("127.0.0.1", 0), backlog=64))
        self.streams = {"tcp 127.0.0.1": tcp}
        if self.host_ip is not None:
            server = socket.create_server((self.host_ip, 0), backlog=64)
            self.streams["tcp host address"] = _nonblocking(server)
        self.unix_path = str(scratch / "listener.sock")
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)  # reachable by any uid: only the sandbox may stand in the way
        unix.listen(64)
        self.streams["unix socket file"] = _nonblocking(unix)
        self.abstract_name = f"detached-rl-hostile-{secrets.token_hex(8)}"
        abstract = socket.socket(socket.AF_UNIX)
        abstract.bind("\0" + self.abstract_name)
        abstract.listen(64)
        self.streams["abstract unix socket"] = _nonblocking(abstract)
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind(("127.0.0.1", 0))
        self.datagrams = {"udp 127.0.0.1": _nonblocking(udp)}
        self.maker_env_secret = f"MAKERENV-{secrets.token_hex(16)}"
        self.maker_memory_secret = f"MAKERMEM-{secrets.token_hex(16)}"
        self.nobody_secret = f"NOBODY-{secrets.token_hex(16)}"
        self.maker: subprocess.Popen | None = None
        self.nobody: subprocess.Popen | None = None
        self.ensure_siblings()
        self._previous_usr1 = signal.signal(signal.SIGUSR1, lambda number, frame: self.usr1.append(number))
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        self._own_pid_namespace: bool | None = None

    def ensure_siblings(self) -> None:
        """(Re)start the maker (root, secrets in its environment and memory) and the uid-65534 sibling."""
        for sibling in (self.maker, self.nobody):
            if sibling is not None and sibling.poll() is None and (
                    _state(sibling.pid) in ("T", "t") or _pending_signals(sibling.pid)):
                sibling.kill()  # stopped, or about to be: a fresh one is simpler than undoing it
                sibling.wait()
        if self.maker is None or self.maker.poll() is not None:
            self.maker = subprocess.Popen(
                [sys.executable, "-c", MAKER_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO,
                env={"PATH": "/usr/bin:/bin", "MAKER_SECRET": self.maker_env_secret})
            assert self.maker.stdin is not None and self.maker.stdout is not None
            self.maker.stdin.write((self.maker_memory_secret + "\n").encode())
            self.maker.stdin.flush()
            assert self.maker.stdout.readline() == b"ready\n"
        if self.nobody is None or self.nobody.poll() is not None:
            self.nobody = subprocess.Popen(["sleep", "3600"], user=NOBODY, group=NOBODY, extra_groups=[],
                                           cwd="/",
                                           env={"NOBODY_SECRET": self.nobody_secret})

    def sibling_problems(self) -> list[str]:
        """Whether the maker and the uid-65534 sibling are alive and not stopped."""
        problems = []
        for name, sibling in (("maker", self.maker), ("uid-65534 sibling", self.nobody)):
            assert sibling is not None
            state = _state(sibling.pid)
            if sibling.poll() is not None:
                problems.append(f"the {name} was killed (exit {sibling.returncode})")
            elif state in ("T", "t"):
                problems.append(f"the {name} was stopped (state {state})")
            elif _pending_signals(sibling.pid):
                problems.append(f"the {name} has pending signals {_pending_signals(sibling.pid):#x}")
        return problems

    def drain(self) -> list[str]:
        """Connections and datagrams that reached our listeners since the last drain."""
        hits = []
        for name, listener in self.streams.items():
            while True:
                try:
                    connection, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                connection.close()
                hits.append(name)
        for name, listener in self.datagrams.items():
            while True:
                try:
                    listener.recvfrom(65536)
                except (BlockingIOError, InterruptedError):
                    break
                hits.append(name)
        return hits

    def own_pid_namespace(self) -> bool:
        """Whether sandboxed code runs in a pid namespace of its own (kill(-1) then
        reaches only its own tree)."""
        if self._own_pid_namespace is None:
            probe = run_python("import os\nprint(os.readlink('/proc/self/ns/pid'))", timeout_s=20)
            namespace = probe.stdout.strip()
            self._own_pid_namespace = probe.ok and namespace.startswith("pid:[") and namespace != os.readlink(
                "/proc/self/ns/pid")
        return self._own_pid_namespace

    def close(self) -> None:
        self._libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        signal.signal(signal.SIGUSR1, self._previous_usr1)
        for sibling in (self.maker, self.nobody):
            if sibling is not None:
                with contextlib.suppress(ProcessLookupError):
                    sibling.kill()
                sibling.wait()
                for stream in (sibling.stdin, sibling.stdout):
                    if stream is not None:
                        stream.close()
        for listener in [*self.streams.values(), *self.datagrams.values()]:
            listener.close()


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    scratch = Path(tempfile.mkdtemp(prefix="hostile-"))  # short: a Unix socket path has at most 107 bytes
    scratch.chmod(0o755)
    world = World(scratch)
    try:
        yield world
    finally:
        world.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _snapshot(root: Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every entry under `root`: type, permission bits and (for files) content."""
    entries = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        content = path.read_bytes() if stat.S_ISREG(info.st_mode) else None
        entries[str(path.relative_to(root))] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode),
                                                content)
    return entries


@dataclass
class Arena:
    """One attack's surroundings: canaries, marks, the secrets it must not reach; `attack`
    runs a case and judges it."""

    world: World
    env_secret: str
    mark: str = field(default_factory=lambda: f"hostile-{secrets.token_hex(8)}")
    pwned: str = field(default_factory=lambda: f"PWNED-{secrets.token_hex(8)}")
    held: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.canary_dir = self.world.scratch / f"canary-{secrets.token_hex(4)}"
        (self.canary_dir / "sub").mkdir(parents=True)
        self.canary_text = f"CANARY-{secrets.token_hex(16)}"
        self.canary_file = self.canary_dir / "canary.txt"
        self.canary_file.write_text(self.canary_text)
        (self.canary_dir / "held.txt").write_text(f"HELD-{secrets.token_hex(16)}")
        (self.canary_dir / "sub" / "inner.txt").write_text(f"INNER-{secrets.token_hex(16)}")
        for path in (self.canary_dir, self.canary_dir / "sub"):
            path.chmod(0o777)
        for path in self.canary_dir.rglob("*.txt"):
            path.chmod(0o666)
        # Inheritable on purpose, as a careless caller's would be: the sandbox must not pass them on.
        for path, flags in ((self.canary_dir / "held.txt", os.O_RDWR), (self.canary_dir, os.O_RDONLY)):
            fd = os.open(path, flags)
            os.set_inheritable(fd, True)
            self.held.append(fd)
        self.expected = f"EXPECT-{self.mark}-{secrets.token_hex(16)}"
        self.before_files = _snapshot(self.canary_dir)
        self.before_processes = set(_descendants(self.world.pid))
        self.world.ensure_siblings()
        self.world.drain()
        self.world.usr1.clear()

    @property
    def values(self) -> dict[str, str]:
        world = self.world
        assert world.maker is not None and world.nobody is not None
        return {
            "pwned": self.pwned, "mark": self.mark, "canary_dir": str(self.canary_dir),
            "canary_file": str(self.canary_file), "maker_pid": str(world.maker.pid),
            "nobody_pid": str(world.nobody.pid), "test_pid": str(world.pid),
            "tcp_port": str(world.streams["tcp 127.0.0.1"].getsockname()[1]), "host_ip": world.host_ip or "",
            "host_tcp_port": (str(world.streams["tcp host address"].getsockname()[1]) if world.host_ip
                              else "0"),
            "udp_port": str(world.datagrams["udp 127.0.0.1"].getsockname()[1]), "unix_path": world.unix_path,
            "abstract_name": world.abstract_name, "repo": str(REPO),
            "stdlib": sysconfig.get_paths()["stdlib"],
            "site_packages": sysconfig.get_paths()["purelib"], "expected": self.expected,
        }

    def watched_dirs(self) -> list[str]:
        """Where an attack's `$mark` files would land on the host."""
        paths = sysconfig.get_paths()
        return sorted({"/tmp", "/var/tmp", "/dev/shm", "/root", "/", str(REPO), os.getcwd(),
                       tempfile.gettempdir(),
                       paths["stdlib"], os.path.join(paths["stdlib"], "__pycache__"), paths["purelib"],
                       str(self.canary_dir), str(self.canary_dir / "sub")})

    def marked_files(self) -> list[str]:
        found = []
        for directory in self.watched_dirs():
            with contextlib.suppress(OSError):
                found += [os.path.join(directory, name) for name in os.listdir(directory)
                          if self.mark in name]
        return found

    def evidence(self) -> dict[str, str]:
        """Strings that can only be in an attack's output if it read what it must not: label -> string."""
        world = self.world
        found = {"test process secret": self.env_secret, "maker environment": world.maker_env_secret,
                 "maker memory": world.maker_memory_secret,
                 "uid-65534 sibling environment": world.nobody_secret,
                 "canary file": self.canary_text, "expected output": self.expected}
        for name, snapshot in self.before_files.items():
            if snapshot[2]:
                found[f"canary {name}"] = snapshot[2].decode()
        for path in ("/etc/shadow", "/etc/passwd", "/root/.bashrc", "/root/.gitconfig",
                     str(REPO / "pyproject.toml")):
            line = _longest_line(path)
            if line is not None:
                found[path] = line
        listed = {"/root": set(os.listdir("/root")) - {".pyenv"},
                  "/": set(os.listdir("/")) - STANDARD_ROOT_NAMES,
                  str(REPO): {"pyproject.toml", ".git", "README.md"},
                  str(self.canary_dir): {"canary.txt", "held.txt"}}
        for directory, names in listed.items():
            for name in names:
                found[f"listing of {directory} ({name})"] = json.dumps(name)  # attacks print listings as JSON
        return found

    def attack(self, case: Case) -> None:
        """Run `case` and assert everything the module docstring promises; all
        problems are reported together."""
        if case.needs_own_pid_namespace and not self.world.own_pid_namespace():
            pytest.fail(f"refused to run {case.name}: sandboxed code shares our pid namespace, so "
                        "this attack would reach every process the sandbox's uid may signal (as root: the "
                        "whole machine)")
        problems, output = self.problems(case, run_python)
        assert not problems, "\n".join(problems) + (f"\n--- output ---\n{output[-2000:]}" if output else "")

    def problems(self, case: Case, run: Any) -> tuple[list[str], str]:
        """Run `case` (a run case through `run(code, timeout_s=...)`) and list everything that escaped."""
        values = self.values
        code = case.render(values)
        start = time.monotonic()
        result, reward = None, None
        if case.kind == "run":
            result = run(code, timeout_s=case.timeout_s)
            output = result.stdout + result.stderr
        else:
            tests = case.rendered_tests(values)
            reward = code_reward("q", f"```python\n{code}\n```\n", tests, timeout_s=case.timeout_s)["reward"]
            output = ""
        elapsed = time.monotonic() - start
        problems = []
        budget = case.timeout_s * max(1, len(case.tests)) + HANG_MARGIN_S
        if elapsed > budget:
            problems.append(f"the call hung: {elapsed:.0f} s for a {case.timeout_s} s timeout")
        if self.world.usr1:
            problems.append(f"the test process was signalled {len(self.world.usr1)} time(s)")
        problems += self._leftover_processes()
        problems += self.world.sibling_problems()
        if case.late:
            time.sleep(LATE_S)
        after_files = _snapshot(self.canary_dir)
        if after_files != self.before_files:
            changed = sorted(name for name in set(after_files) | set(self.before_files)
                             if after_files.get(name) != self.before_files.get(name))
            problems.append(f"canary directory changed: {changed}")
        problems += [f"created on the host: {path}" for path in self.marked_files()]
        if self.pwned in output:
            lines = [line for line in output.splitlines() if self.pwned in line]
            problems.append(f"the attack reports success: {lines[:3]}")
        problems += [f"leaked {label}" for label, text in self.evidence().items() if text in output]
        problems += [f"reached the {name} listener" for name in self.world.drain()]
        if reward is not None and reward != case.expect_reward:
            problems.append(f"reward {reward}, expected {case.expect_reward}")
        if case.check is not None and result is not None:
            problem = case.check(result)
            if problem is not None:
                problems.append(problem)
        return problems, output

    def _leftover_processes(self) -> list[str]:
        """Processes the call started that are still alive after a grace period."""
        deadline = time.monotonic() + GRACE_S
        while True:
            left = {pid: line for pid, line in _descendants(self.world.pid).items()
                    if pid not in self.before_processes}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        return [f"{len(left)} process(es) outlived the call, e.g. {sorted(left.items())[:3]}"] if left else []

    def clean_up(self) -> None:
        """Kill what the attack left running, reap what we adopted, remove what it planted, close our fds."""
        for pid in _descendants(self.world.pid):
            if pid not in self.before_processes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        siblings = {sibling.pid for sibling in (self.world.maker, self.world.nobody) if sibling is not None}
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            adopted = _zombie_children(self.world.pid) - self.before_processes - siblings
            for pid in adopted:  # orphans reparented to us; run_python already waited for its own child
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            if not adopted and not set(_descendants(self.world.pid)) - self.before_processes:
                break
            time.sleep(0.01)
        for path in self.marked_files():
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.remove(path)
        for fd in self.held:
            os.close(fd)
        shutil.rmtree(self.canary_dir, ignore_errors=True)
        self.world.ensure_siblings()


@pytest.fixture
def arena(world: World, monkeypatch: pytest.MonkeyPatch) -> Iterator[Arena]:
    secret = f"HOSTILE_SECRET-{secrets.token_hex(16)}"
    monkeypatch.setenv("HOSTILE_TEST_SECRET", secret)
    arena = Arena(world, secret)
    try:
        yield arena
    finally:
        arena.clean_up()


class TestFilesystemEscape:
    @pytest.mark.parametrize("case", FILESYSTEM, ids=_case_id)
    def test_nothing_escapes(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


class TestAuditHookDisabled:
    @pytest.mark.parametrize("case", AUDIT_HOOK, ids=_case_id)
    def test_os_layer_holds_without_the_hook(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


class TestProcesses:
    @pytest.mark.parametrize("case", PROCESSES, ids=_case_id)
    def test_no_process_escapes_or_outlives(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


class TestSignalsAndOtherProcesses:
    @pytest.mark.parametrize("case", SIGNALS, ids=_case_id)
    def test_caller_and_siblings_survive(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


class TestNetwork:
    @pytest.mark.parametrize("case", NETWORK, ids=_case_id)
    def test_no_listener_is_reached(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


class TestPrivilege:
    @pytest.mark.parametrize("case", PRIVILEGE, ids=_case_id)
    def test_no_privilege_is_gained(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


class TestResources:
    @pytest.mark.parametrize("case", RESOURCES, ids=_case_id)
    def test_limits_hold_and_the_call_returns(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


class TestGradingHacks:
    @pytest.mark.parametrize("case", GRADING, ids=_case_id)
    def test_hack_scores_zero(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


class TestHonestCode:
    @pytest.mark.parametrize("case", HONEST, ids=_case_id)
    def test_honest_code_still_scores(self, case: Case, arena: Arena) -> None:
        arena.attack(case)


# ------------------------------------------------------------------ the checks catch what they look for

# Attacks that succeed without the sandbox (as uid 65534, environment inherited), with the
# problem each must raise.
UNCONFINED_CATCHES = {
    "read_canary": "leaked canary file", "write_canary_dir": "canary directory changed",
    "hardlink_canary": "canary directory changed", "read_repo": f"leaked {REPO / 'pyproject.toml'}",
    "write_tmp": "created on the host", "environment_secrets": "leaked test process secret",
    "proc_nobody_sibling": "leaked uid-65534 sibling environment",
    "process_vm_readv_nobody": "leaked uid-65534 sibling environment",
    "ptrace_nobody_sibling": "the attack reports success",
    "kill_nobody_sibling": "uid-65534 sibling was killed",
    "setsid_daemon": "outlived the call", "tcp_loopback": "reached the tcp 127.0.0.1 listener",
    "udp_loopback": "reached the udp 127.0.0.1 listener",
    "unix_socket_file": "reached the unix socket file listener",
    "unix_abstract": "reached the abstract unix socket listener",
}


@dataclass(frozen=True)
class Unconfined:
    """How an unconfined run ended (the fields of SandboxResult that the checks read)."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@pytest.fixture(scope="module")
def nobody_python() -> str:
    """A Python interpreter that uid 65534 may run (ours may sit in a root-only directory)."""
    for candidate in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        with contextlib.suppress(OSError):
            if candidate and subprocess.run([candidate, "-c", "pass"], user=NOBODY, group=NOBODY,
                                            extra_groups=[],
                                            cwd="/", capture_output=True).returncode == 0:
                return candidate
    pytest.skip("no Python interpreter that uid 65534 can run")


class TestHarnessDetects:
    @pytest.mark.parametrize("name", sorted(UNCONFINED_CATCHES))
    def test_unconfined_attack_is_caught(self, name: str, arena: Arena, nobody_python: str,
                                         tmp_path: Path) -> None:
        tmp_path.chmod(0o777)

        def unconfined(code: str, timeout_s: float) -> Unconfined:
            # Output to files, not pipes: a daemon that keeps a pipe open would hold
            # the call until the timeout.
            with open(tmp_path / "out", "w+b") as out, open(tmp_path / "err", "w+b") as err:
                child = subprocess.Popen([nobody_python, "-I", "-c", code], stdout=out, stderr=err,
                                         cwd=tmp_path,
                                         user=NOBODY, group=NOBODY, extra_groups=[], env=dict(os.environ))
                try:
                    returncode, timed_out = child.wait(timeout_s), False
                except subprocess.TimeoutExpired:
                    child.kill()
                    returncode, timed_out = child.wait(), True
                out.seek(0)
                err.seek(0)
                return Unconfined(returncode, out.read().decode(errors="replace"),
                                  err.read().decode(errors="replace"), timed_out)

        case = next(case for case in ALL_CASES if case.name == name)
        problems, output = arena.problems(case, unconfined)
        assert any(UNCONFINED_CATCHES[name] in problem for problem in problems), (problems, output[-2000:])


def test_case_table_is_large_and_unique() -> None:
    names = [case.name for case in ALL_CASES]
    assert len(names) >= 60 and len(names) == len(set(names))
    assert ALL_CASES == (FILESYSTEM + AUDIT_HOOK + PROCESSES + SIGNALS + NETWORK + PRIVILEGE + RESOURCES
                         + GRADING + HONEST)
