"""Reward functions (tags, boxed maths, code) and the code sandbox, including hostile code."""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from detached_rl import Experience, collate
from detached_rl.models import FunctionReward, tiny_tokenizer
from detached_rl.rewards import functions as rewards_module
from detached_rl.rewards import isolation, sandbox
from detached_rl.rewards.functions import (
    REWARD_FUNCTIONS,
    answers_match,
    as_number,
    boxed_reward,
    code_reward,
    get_reward_function,
    last_boxed,
    last_python_block,
    numeric_answer_reward,
    think_answer_tags_reward,
)
from detached_rl.rewards.math_verify import MathVerifyWorker
from detached_rl.rewards.sandbox import SandboxUnavailable, run_python

from .helpers import processes_with

SECRET = "hunter2-not-for-the-sandbox"


def _marked_processes() -> set[int]:
    """Pids of live sandboxed interpreters (their command line holds the prelude) of this test process."""
    return processes_with(b"def _confine")


def _children() -> set[int]:
    """Our direct child processes."""
    children = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            children |= {int(pid) for pid in (task / "children").read_text().split()}
        except OSError:
            continue
    return children


def _sandbox_dirs() -> set[str]:
    """Sandbox working directories currently in the temp dir."""
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("detached_rl_sandbox_")}


@pytest.fixture
def no_leftovers():
    """Checks that a test leaves no sandboxed process, child process or working directory behind."""
    before = (_marked_processes(), _children(), _sandbox_dirs())
    yield
    math_worker = rewards_module._MATH_VERIFY._process
    ignored = {math_worker.pid} if math_worker is not None else set()
    # The sandbox waits until its processes are gone, so ours are; a sandbox of the other pytest-xdist worker
    # that is ending can show its interpreter for a moment after bwrap exited (reparented, so counted as
    # escaped). An escaped process stays: wait out the moment, not the escape.
    deadline = time.monotonic() + 3.0
    while _marked_processes() - before[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _marked_processes() - before[0]
    assert not _children() - before[1] - ignored
    assert not _sandbox_dirs() - before[2]


def _block(code: str, language: str = "python") -> str:
    return f"Here is my solution.\n```{language}\n{code}\n```\n"


# ------------------------------------------------------------------ registry, helpers


def test_registry_names_and_lookup():
    assert set(REWARD_FUNCTIONS) == {"numeric_answer", "answer_line", "think_answer_tags", "boxed", "code"}
    assert get_reward_function("numeric_answer") is numeric_answer_reward
    assert get_reward_function("boxed") is boxed_reward
    with pytest.raises(ValueError, match="boxed.*code.*numeric_answer.*think_answer_tags"):
        get_reward_function("nope")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("42", 42.0), (" -1,234.5 ", -1234.5), ("3/4", 0.75), ("1e-3", 0.001), ("$12", 12.0), (".5", 0.5),
     ("1/0", None), ("nan", None), ("inf", None), ("1,2", None), ("seven", None), ("", None)],
)
def test_as_number(text, expected):
    assert as_number(text) == expected


def test_answers_match_numbers_with_tolerance_and_normalised_strings():
    assert answers_match("3.0000000001", 3) and answers_match("1,000", 1000) and answers_match("1/2", "0.5")
    assert not answers_match("3.01", 3)
    assert answers_match("  New   York. ", "new york") and not answers_match("York", "New York")


# ------------------------------------------------------------------ <think>/<answer> tags

FULL, WRONG, CORRECT_ONLY, NOTHING = (
    {"reward": 1.1, "correct": 1.0, "format": 1.0},
    {"reward": pytest.approx(0.1), "correct": 0.0, "format": 1.0},
    {"reward": 1.0, "correct": 1.0, "format": 0.0},
    {"reward": 0.0, "correct": 0.0, "format": 0.0},
)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>6 * 7</think><answer>42</answer>", FULL),
        ("\n <think>\nsix times seven\n</think>\n\n<answer> 42 </answer>\n\n", FULL),
        ("<think>x</think><answer>42.0000000001</answer>", FULL),
        ("<think>x</think><answer>41</answer>", WRONG),
        ("<think>x</think><answer></answer>", WRONG),
        ("<answer>42</answer>", CORRECT_ONLY),  # no think
        # two answers: the last counts
        ("<think>x</think><answer>41</answer><answer>42</answer>", CORRECT_ONLY),
        ("<think>x</think><answer>42</answer> and more", CORRECT_ONLY),  # trailing text
        ("Sure! <think>x</think><answer>42</answer>", CORRECT_ONLY),  # leading text
        ("<answer>42</answer><think>x</think>", CORRECT_ONLY),  # wrong order
        ("<think>a</think><think>b</think><answer>42</answer>", CORRECT_ONLY),  # two thinks
        ("<think>x<answer>42</answer></think>", CORRECT_ONLY),  # answer inside think
        ("<think>42</think> 42", NOTHING),
        ("", NOTHING),
    ],
)
def test_think_answer_tags(response, expected):
    assert think_answer_tags_reward("What is 6 * 7?", response, answer=42) == expected


def test_think_answer_tags_strings_and_weights():
    response = "<think>capital</think><answer>Paris.</answer>"
    assert think_answer_tags_reward("q", response, answer="paris")["correct"] == 1.0
    assert think_answer_tags_reward("q", response, answer="Lyon", format_weight=0.5)["reward"] == 0.5
    # extra metadata from a dataset row is ignored
    assert think_answer_tags_reward("q", response, answer="Paris", id=7, source="x")["reward"] == 1.1


# ------------------------------------------------------------------ \boxed{}


@pytest.mark.parametrize(
    ("text", "expected"),
    [(r"\boxed{3}", "3"), (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"), (r"\boxed {x^{2}}", "x^{2}"),
     (r"\boxed{1} then \boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),
     (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
     (r"\boxed{\frac{1}{2}", None), ("no box", None), (r"\boxed", None)],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("response", "answer", "correct", "has_format"),
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0, 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0, 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0, 1.0),  # nested braces, equivalent forms
        (r"\boxed{x + 1}", "1+x", 1.0, 1.0),
        (r"\boxed{42}", 42, 1.0, 1.0),
        (r"\boxed{12}", r"\boxed{12}", 1.0, 1.0),  # a boxed ground truth is unboxed
        (r"\boxed{3} no, wait: \boxed{4}", "3", 0.0, 1.0),  # the last box counts
        (r"\boxed{\frac{1}{3}}", "0.5", 0.0, 1.0),
        ("The answer is 0.5", "0.5", 0.0, 0.0),  # no box
        (r"\boxed{\frac{1}{2}", "0.5", 0.0, 0.0),  # unclosed box
    ],
)
def test_boxed(response, answer, correct, has_format):
    result = boxed_reward("q", response, answer=answer)
    assert result == {"reward": pytest.approx(correct + 0.1 * has_format), "correct": correct,
                      "format": has_format,
                      "verifier_unavailable": 0.0}


def test_math_rewards_from_worker_threads():
    cases = [
        (think_answer_tags_reward, "<think>x</think><answer>7</answer>", 7, 1.1),
        (boxed_reward, r"\boxed{\frac{14}{2}}", 7, 1.1),
        (boxed_reward, r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.1),
        (boxed_reward, r"\boxed{6}", 7, 0.1),
    ]
    assert threading.current_thread() is threading.main_thread()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fn, "q", response, answer=answer) for fn, response, answer, _ in cases]
        results = [future.result(timeout=60) for future in futures]
    assert [result["reward"] for result in results] == pytest.approx([expected for *_, expected in cases])


def test_boxed_survives_pathological_answers_off_the_main_thread():
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(boxed_reward, "q", r"\boxed{10^{10^{10}} + 2^{2^{2^{2^{100}}}}}", answer="1",
                             timeout_s=1).result(timeout=30)
    assert result == {"reward": pytest.approx(0.1), "correct": 0.0, "format": 1.0,
                      "verifier_unavailable": 0.0}


def test_math_worker_that_overruns_is_killed_and_restarted():
    stuck = MathVerifyWorker("import time\nprint('ready', flush=True)\ntime.sleep(600)")
    assert stuck.equal("1", "2", timeout_s=0.1) is False
    assert stuck._process is None and stuck.timeouts == 1
    assert MathVerifyWorker("raise SystemExit(1)").equal("1", "1", timeout_s=1) is None


# ------------------------------------------------------------------ code: extraction


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("```python\nprint(1)\n```", "print(1)\n"),
        ("```\nprint(2)\n```", "print(2)\n"),
        ("```py\nprint(3)\n```", "print(3)\n"),
        ("```python\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```\ndone", "print(2)\n"),
        ("```python\nprint(1)\n```\n```cpp\nint main() {}\n```", "print(1)\n"),  # not the C++ block
        ("```python\nprint(1)\n```\n```python\nprint(2)", "print(1)\n"),  # the unclosed last block is skipped
        ("use `print` or ```print(1)```", None),  # inline, not a block
        ("print(1)", None),
        ("```python\n\n```", None),
    ],
)
def test_last_python_block(response, expected):
    assert last_python_block(response) == expected


# ------------------------------------------------------------------ code: scoring

DOUBLE_TESTS = [{"input": "2\n", "output": "4\n"}, {"input": "5", "output": "10"},
                {"input": "-3\n", "output": "-6"}]


def test_code_correct_partial_and_wrong_solutions(no_leftovers):
    assert code_reward("q", _block("print(int(input()) * 2)"), DOUBLE_TESTS) == {
        "reward": 1.0, "correct": 1.0, "format": 1.0}
    partial = code_reward("q", _block("n = int(input())\nprint(n * 2 if n > 0 else n)"), DOUBLE_TESTS)
    assert partial["reward"] == pytest.approx(2 / 3)
    assert code_reward("q", _block("print(int(input()) + 2)"), DOUBLE_TESTS)["reward"] == pytest.approx(1 / 3)
    # trailing whitespace per line and trailing blank lines do not matter, leading whitespace does
    spaced = [{"input": "", "output": "a\nb"}]
    assert code_reward("q", _block("print('a   ')\nprint('b')\nprint()\n"), spaced)["correct"] == 1.0
    assert code_reward("q", _block("print(' a')\nprint('b')"), spaced)["correct"] == 0.0
    # a crash after printing the right output fails
    assert code_reward("q", _block("print('a\\nb')\nraise ValueError"), spaced)["correct"] == 0.0


def test_code_assert_tests(no_leftovers):
    tests = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add('a', 'b') == 'ab'",
             "assert add(2, 2) == 5"]
    assert code_reward("q", _block("def add(a, b):\n    return a + b"), tests)["correct"] == 0.75
    assert code_reward("q", _block("def add(a, b):\n    return 0"), tests)["correct"] == 0.25
    # a main guard does not run (no stdin), and exiting early neither passes nor skips the tests
    guarded = ("def add(a, b):\n    return a + b\n"
               "if __name__ == '__main__':\n    print(add(*map(int, input().split())))")
    assert code_reward("q", _block(guarded), tests[:1])["correct"] == 1.0
    exits = "import sys\ndef add(a, b):\n    return a + b\nsys.exit(0)"
    assert code_reward("q", _block(exits), tests[:2])["correct"] == 1.0
    cheats = "import os\nos._exit(0)"
    assert code_reward("q", _block(cheats), tests)["correct"] == 0.0
    # asserts and stdin/stdout tests mix
    mixed = ["assert square(3) == 9", {"input": "4", "output": "16"}]
    program = "def square(x):\n    return x * x\nif __name__ == '__main__':\n    print(square(int(input())))"
    assert code_reward("q", _block(program), mixed)["correct"] == 1.0


def test_code_malformed_responses_and_tests():
    assert code_reward("q", "print(int(input()) * 2)",
                       DOUBLE_TESTS) == {"reward": 0.0, "correct": 0.0, "format": 0.0}
    assert code_reward("q", _block("int main() { return 0; }", "cpp"), DOUBLE_TESTS)["format"] == 0.0
    assert code_reward("q", _block("print(int(input(( * 2)"), DOUBLE_TESTS) == {
        "reward": 0.0, "correct": 0.0, "format": 1.0}
    with pytest.raises(ValueError, match="non-empty"):
        code_reward("q", _block("pass"), [])
    with pytest.raises(ValueError, match="assert string"):
        code_reward("q", _block("pass"), [{"input": "1"}])


@pytest.fixture
def secret_env(monkeypatch):
    monkeypatch.setenv("DETACHED_RL_TEST_SECRET", SECRET)


HOSTILE = {
    "fork_bomb": "import os\nwhile True:\n    os.fork()",
    "subprocess": "import subprocess\nsubprocess.run(['sh', '-c', 'echo done'])",
    "infinite_loop": "while True:\n    pass",
    "huge_allocation": "x = bytearray(10**10)",
    "huge_file": "with open('big.bin', 'wb') as f:\n    f.write(b'x' * (8 * 2**20))",
    "many_files": "for i in range(1000):\n    open(f'f{i}', 'w').close()",
    "env_secret": "import os\nassert os.environ['DETACHED_RL_TEST_SECRET']",
    "parent_env_secret": (
        "import os\nassert b'DETACHED_RL_TEST_SECRET' in open(f'/proc/{os.getppid()}/environ', 'rb').read()"
    ),
    "read_outside": "open('/etc/hostname').read()",
    "socket": "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=1)",
    "unix_socket": "import socket\nsocket.socket(socket.AF_UNIX).connect('/tmp/nothing-here')",
    "signal_parent": "import os\nos.kill(os.getppid(), 0)",
    "raise_limits": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
    "ctypes": "import ctypes\nctypes.CDLL(None).fork()",
    "output_flood": "while True:\n    print('x' * 10000)",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_code_gets_zero_and_harms_nothing(name, secret_env, no_leftovers):
    # each snippet prints "done" only if its attack went through, which would earn the reward
    response = _block(HOSTILE[name] + "\nprint('done')")
    start = time.monotonic()
    assert code_reward("q", response, [{"input": "", "output": "done"}], timeout_s=1.0) == {
        "reward": 0.0, "correct": 0.0, "format": 1.0}
    assert time.monotonic() - start < 5


def test_hostile_write_outside_the_directory(tmp_path, no_leftovers):
    target = tmp_path / "escaped.txt"
    for attack in (f"open({str(target)!r}, 'w').write('x')",
                   f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')",
                   f"import os\nos.chdir({str(tmp_path)!r})\nopen('escaped.txt', 'w').write('x')",
                   f"import os\nos.mkdir({str(tmp_path / 'dir')!r})"):
        assert code_reward("q", _block(attack + "\nprint('done')"),
                           [{"input": "", "output": "done"}])["reward"] == 0
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the sandbox itself


def test_run_python_basics(secret_env, no_leftovers):
    result = run_python(
        "import os, sys\nprint(sys.stdin.read().upper())\nprint(os.listdir('.'))\nprint(sorted(os.environ))\n"
        "print(os.getcwd())\nopen('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read(), "
        "file=sys.stderr)",
        stdin="hello",
    )
    assert result.ok and result.stderr == "ok\n" and not result.timed_out and result.killed_reason is None
    shouted, listing, env, cwd = result.stdout.splitlines()
    assert shouted == "HELLO" and listing == "[]"  # starts in an empty directory
    assert env == str(["HOME", "LANG", "MALLOC_ARENA_MAX", "PATH", "PWD"])  # nothing inherited
    assert cwd == "/tmp" and not os.path.exists("/tmp/scratch.txt")  # a private tmpfs, gone afterwards
    assert run_python("import sys\nsys.exit(3)").returncode == 3


def test_run_python_limits_report_why(no_leftovers):
    start = time.monotonic()
    looping = run_python("while True:\n    pass", timeout_s=0.5)
    assert looping.timed_out and looping.killed_reason == "timeout" and time.monotonic() - start < 3
    flood = run_python("while True:\n    print('x' * 1000)", max_output_kb=4)
    assert flood.killed_reason == "output_limit" and len(flood.stdout) == 4096 and not flood.timed_out
    spinning = run_python("while True:\n    pass", timeout_s=10, cpu_s=1)
    assert spinning.killed_reason in ("cpu_limit", "killed") and not spinning.timed_out
    memory = run_python("x = bytearray(300 * 2**20)", memory_mb=256)
    assert memory.returncode == 1 and "MemoryError" in memory.stderr
    assert run_python("x = bytearray(100 * 2**20)\nprint(len(x))", memory_mb=256).stdout == f"{100 * 2**20}\n"
    disk = run_python("f = open('big', 'wb')\nfor _ in range(8):\n    f.write(b'x' * 2**20)", max_file_mb=4)
    assert disk.returncode == 1 and "File too large" in disk.stderr
    full = run_python("for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * 2**20)", max_file_mb=1,
                      max_tmp_mb=4)
    assert full.returncode == 1 and "No space left" in full.stderr
    assert run_python("print(1)\0").killed_reason == "invalid_code"
    assert run_python("x = 1\n" * 100_000).killed_reason == "invalid_code"


def test_run_python_confinement_as_the_code_sees_it(no_leftovers):
    status = run_python("print(open('/proc/self/status').read())", audit_hook=False).stdout
    fields = {key: value.split() for key, _, value in (line.partition(":") for line in status.splitlines())}
    assert fields["Uid"] == ["65534"] * 4 and fields["Gid"] == ["65534"] * 4 and fields["Groups"] == []
    assert fields["CapEff"] == fields["CapPrm"] == fields["CapBnd"] == ["0000000000000000"]
    assert fields["NoNewPrivs"] == ["1"] and fields["Seccomp"] == ["2"]
    seen = run_python("import os\nprint(sorted(os.listdir('/')), sorted(p for p in os.listdir('/proc') if "
                      "p.isdigit()))",
                      audit_hook=False).stdout
    assert "etc" not in seen and "home" not in seen and "['1', '2']" in seen  # only its own PID namespace


# Each prints "escaped" only if the OS layers let it through; run without the audit hook (second layer).
OS_LAYER_ATTACKS = {
    "fork": "import os\nos.fork()",
    "ctypes_fork": "import ctypes\nassert ctypes.CDLL(None).fork() >= 0",
    "subprocess": "import subprocess\nsubprocess.run(['/usr/bin/true'])",
    "new_user_namespace": "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0",
    "ptrace_init": "import ctypes\nassert ctypes.CDLL(None).ptrace(16, 1, 0, 0) == 0",
    "mount": "import ctypes\nassert ctypes.CDLL(None).mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0",
    "tiocsti_high_bits": "import ctypes\nc = ctypes.c_char(b'x')\n"
                         "assert ctypes.CDLL(None).ioctl(0, ctypes.c_ulong(0x100005412), "
                         "ctypes.byref(c)) == 0",
    "inet_socket": "import socket\nsocket.socket().connect(('1.1.1.1', 53))",
    "netlink_socket": "import socket\nsocket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)",
    "pidfd_kill": "import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(1), signal.SIGKILL)",
    "kill_init": "import os\nos.kill(1, 9)",
    "setuid_root": "import os\nos.setuid(0)",
    "read_passwd": "open('/etc/passwd').read()",
    "list_root": "import os\nos.listdir('/root')",
    "write_usr": "open('/usr/escaped', 'w')",
    "raise_limits": "import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
}


@pytest.mark.parametrize("name", sorted(OS_LAYER_ATTACKS))
def test_os_layers_hold_without_the_audit_hook(name, no_leftovers):
    result = run_python(OS_LAYER_ATTACKS[name] + "\nprint('escaped')", timeout_s=3, audit_hook=False)
    assert "escaped" not in result.stdout and result.returncode != 0, result


def test_no_process_outlives_the_call(no_leftovers):
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        time.sleep(60)  # {marker}\n    os._exit(0)\nprint('parent done'){tail}")

    def marked(marker: str) -> bool:
        return any(marker.encode() in _cmdline(pid) for pid in Path("/proc").iterdir() if pid.name.isdigit())

    # the parent exits at once (the daemon holds its stdout), or runs into the timeout
    for marker, tail, timeout_s in (("DAEMON_A", "", 5.0), ("DAEMON_B", "\ntime.sleep(30)", 0.5)):
        result = run_python(daemon.format(marker=marker, tail=tail), timeout_s=timeout_s, max_processes=4,
                            audit_hook=False)
        assert result.timed_out == (timeout_s < 1) and not marked(marker)


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_refuses_to_run_without_bubblewrap_or_libseccomp(monkeypatch):
    monkeypatch.setattr(sandbox, "_verified", False)
    monkeypatch.setenv("DETACHED_RL_BWRAP", "/nonexistent/bwrap")
    isolation.find_bwrap.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="bwrap"):
            run_python("print(1)")
        with pytest.raises(SandboxUnavailable, match="bwrap"):  # code_reward fails loudly, not 0
            code_reward("q", _block("print(1)"), [{"input": "", "output": "1"}])
        monkeypatch.delenv("DETACHED_RL_BWRAP")
        isolation.find_bwrap.cache_clear()
        monkeypatch.setitem(sys.modules, "pyseccomp", None)
        isolation.seccomp_program.cache_clear()
        with pytest.raises(SandboxUnavailable, match="libseccomp"):
            run_python("print(1)")
    finally:
        isolation.find_bwrap.cache_clear()
        isolation.seccomp_program.cache_clear()


def test_run_python_is_safe_from_threads(no_leftovers):
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(f"print({i} * {i})"), range(8)))
    assert [result.stdout for result in results] == [f"{i * i}\n" for i in range(8)]


# ------------------------------------------------------------------ through FunctionReward


def test_rewards_through_function_reward_on_a_tiny_tokenizer(no_leftovers):
    tokenizer = tiny_tokenizer()
    samples = [
        ("What is 6 * 7?", "<think>6 * 7 = 42</think> <answer>42</answer>", {"answer": 42},
         "think_answer_tags"),
        ("Half of one?", r"It is \boxed{\frac{1}{2}}", {"answer": "0.5"}, "boxed"),
        ("Double n.", "```python\nprint(int(input()) * 2)\n```", {"tests": DOUBLE_TESTS}, "code"),
    ]
    for prompt, response, metadata, name in samples:
        exps = [Experience(torch.tensor(tokenizer(prompt)["input_ids"]),
                           torch.tensor(tokenizer(response)["input_ids"]),
                           torch.full((len(tokenizer(response)["input_ids"]),), -1.0), torch.tensor(0.0))]
        batch = collate(exps, tokenizer.pad_token_id)
        scorer = FunctionReward(get_reward_function(name), tokenizer)
        rewards, parts = scorer.score_detailed(batch.sequences, batch.attention_mask, batch.response_mask,
                                               [metadata])
        expected = 1.0 if name == "code" else 1.1
        extra = {"verifier_unavailable": 0.0} if name == "boxed" else {}
        assert rewards.tolist() == pytest.approx([expected]) and parts == [{"correct": 1.0, "format": 1.0,
                                                                            **extra}]
