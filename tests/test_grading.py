"""Grading the candidate cannot forge: known hacks never score, honest solutions
score 1.0 (both test styles)."""

from __future__ import annotations

import os

import pytest

from detached_rl.rewards.functions import code_reward
from detached_rl.rewards.grading import normalise_output, run_assert_test, run_io_test

from .helpers import processes_with

# No solution can pass these: the first does not involve it, the second needs one value to equal 3 and 4.
IMPOSSIBLE = ["assert 1 == 2", "x = add(1, 2)\nassert x == 3 and x == 4"]
IMPOSSIBLE_IO = [{"input": "", "output": "never printed"}]

HACKS = {
    "replace_exec": "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\ndef add(a, b):\n    "
                    "return a + b",
    "replace_compile": (
        "import builtins\n_compile = builtins.compile\n"
        "builtins.compile = lambda source, *args, **kwargs: _compile('pass', *args, **kwargs)\n"
        "def add(a, b):\n    return a + b"
    ),
    "token_from_cmdline": (  # prints every command line it can see, in case one holds a pass token
        "import os\nfor pid in os.listdir('/proc'):\n    try:\n"
        "        print(open(f'/proc/{pid}/cmdline', 'rb').read().decode(errors='replace'))\n"
        "    except OSError:\n        pass\ndef add(a, b):\n    return a + b"
    ),
    "caller_frame_constants": (  # prints every constant of every frame above it
        "import sys\nframe = sys._getframe(0)\nwhile frame is not None:\n    print(frame.f_code.co_consts)\n"
        "    print(list(frame.f_globals))\n    frame = frame.f_back\ndef add(a, b):\n    return a + b"
    ),
    "os_exit_early": "import os\nos._exit(0)",
    "sys_exit_early": "import sys\nsys.exit(0)",
    "patch_assertion_error": (
        "import builtins\nclass Quiet(BaseException):\n    pass\nbuiltins.AssertionError = Quiet\n"
        "def add(a, b):\n    return a + b"
    ),
    "eq_always_true": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Anything()"
    ),
    "int_subclass_eq": "class Sly(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n "
                       "   return Sly(3)",
    "fake_verdict": (  # writes what a verdict might look like on every descriptor it has
        "import os\nfor fd in range(64):\n    for word in (b'pass', b'PASS', b'ok\\n'):\n        try:\n"
        "            os.write(fd, word)\n        except OSError:\n            pass\nprint('pass')\n"
        "def add(a, b):\n    return a + b"
    ),
    "kill_parent_and_judge": (
        "import os, signal\nfor pid in [os.getppid(), -1] + list(range(1, 200)):\n    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\ndef add(a, b):\n    "
        "return a + b"
    ),
    "sleep_past_the_timeout": "import time\ntime.sleep(30)\ndef add(a, b):\n    return a + b",
    "slow_answer": "import time\ndef add(a, b):\n    time.sleep(30)",
    "huge_output": "import sys\nsys.stdout.write('pass\\n' * 5_000_000)\ndef add(a, b):\n    return 'x' "
                   "* 50_000_000",
    "raise_system_exit_in_call": "def add(a, b):\n    raise SystemExit(0)",
    "forge_protocol_answers": (  # answers every request with 4 itself, and claims readiness twice
        "import os, sys\n"
        "frame = sys._getframe(0)\nwhile '_answers' not in frame.f_globals:\n    frame = frame.f_back\n"
        "answers = frame.f_globals['_answers']\n"
        "for message in (b\"('ready',)\", b\"('ok', ('h', 1))\", b\"('ok', ('v', 4))\"):\n"
        "    os.write(answers, len(message).to_bytes(4, 'big') + message)\n"
        "def add(a, b):\n    return 3"
    ),
    "non_literal_answer": "def add(a, b):\n    return type('T', (), {'__repr__': lambda self: '4'})()",
}


MARKER = f"graded-by-{os.getpid()}"  # in every program here: other test runs may be sandboxing code meanwhile


def _sandbox_processes() -> set[int]:
    """Live processes running one of this module's programs (their command line holds the marker)."""
    return processes_with(MARKER.encode())


@pytest.fixture
def nothing_left_behind():
    before = _sandbox_processes()
    yield
    assert not _sandbox_processes() - before


def _block(code: str) -> str:
    return f"Here you go.\n```python\n{code}\n# {MARKER}\n```\n"


@pytest.mark.parametrize("name", sorted(HACKS))
def test_known_hacks_never_score(name, nothing_left_behind):
    response = _block(HACKS[name])
    assert code_reward("q", response, IMPOSSIBLE, timeout_s=1.5, stop_on_timeout=True)["correct"] == 0.0
    assert os.getpid() > 0  # (still here: the caller survives)


@pytest.mark.parametrize("name", ["fake_verdict", "huge_output", "caller_frame_constants"])
def test_known_hacks_never_score_io_tests(name, nothing_left_behind):
    assert code_reward("q", _block(HACKS[name]), IMPOSSIBLE_IO, timeout_s=1.5)["correct"] == 0.0


def test_answer_from_the_candidate_is_only_a_literal(nothing_left_behind):
    # a forged answer counts as what the solution returned, never as a verdict: 4 != 3
    verdict = run_assert_test(HACKS["forge_protocol_answers"], "assert add(1, 2) == 3", timeout_s=2.0)
    assert not verdict.passed and "AssertionError" in verdict.detail
    slow = run_assert_test(HACKS["slow_answer"], "assert add(1, 2) is None", timeout_s=5.0,
                           call_timeout_s=0.5)
    assert not slow.passed and slow.timed_out and "did not answer" in slow.detail
    huge = run_assert_test(HACKS["huge_output"], "assert len(add(1, 2)) > 0", timeout_s=5.0)
    assert not huge.passed and "larger than" in huge.detail


HONEST_ASSERTS = [
    ("def add(a, b):\n    return a + b", ["assert add(1, 2) == 3", "assert add('a', 'b') == 'ab'",
                                          "assert add([1], [2]) == [1, 2]", "assert add(0.5, 0.25) == 0.75"]),
    ("class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
     "        for i, n in enumerate(nums):\n            if target - n in seen:\n                return "
     "[seen[target - n], i]\n            seen[n] = i\n",
     ["assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]",
                              "s = Solution()\nassert s.twoSum([3, 3], 6) == [0, 1]\nassert s.twoSum([1, 5, "
                              "2], 7) == [1, 2]"]),
    ("class Counter:\n    def __init__(self):\n        self.n = 0\n    def tick(self):\n        self.n += 1\n"
     "        return self.n\n", ["c = Counter()\nc.tick()\nassert c.tick() == 2 and c.n == 2"]),
    ("def squares(n):\n    for i in range(n):\n        yield i * i\n",
     ["assert list(squares(4)) == [0, 1, 4, 9]", "assert 9 in squares(4) and sum(squares(3)) == 5"]),
    ("def parse(s):\n    if not s:\n        raise ValueError('empty')\n    return {int(x) for x in "
     "s.split(',')}\n",
     ["assert parse('1,2,2') == {1, 2}",
      "try:\n    parse('')\nexcept ValueError as error:\n    assert 'empty' in str(error)\nelse:\n    "
      "assert False"]),
    ("import math\nLIMIT = 10 ** 30\ndef big(n):\n    return math.factorial(n)\ndef inf():\n    return "
     "float('inf')",
     ["assert LIMIT == 10 ** 30 and big(2000) == __import__('math').factorial(2000)",
      "assert inf() == float('inf')"]),
    ("import sys\ndef add(a, b):\n    return a + b\nprint('debug output')\nsys.exit(0)",
     ["assert add(2, 2) == 4"]),
]


@pytest.mark.parametrize("program,tests", HONEST_ASSERTS)
def test_honest_solutions_score_one_with_assert_tests(program, tests, nothing_left_behind):
    assert code_reward("q", _block(program), tests) == {"reward": 1.0, "correct": 1.0, "format": 1.0}


def test_honest_solutions_score_one_with_io_and_mixed_tests(nothing_left_behind):
    program = ("def solve(n):\n    return n * (n + 1) // 2\nif __name__ == '__main__':\n"
               "    print(solve(int(input())))\n")
    tests = [{"input": "3\n", "output": "6\n"}, {"input": "100", "output": "5050"}, "assert solve(4) == 10"]
    assert code_reward("q", _block(program), tests)["correct"] == 1.0
    assert run_io_test(program, "10\n", "55  \n\n").passed
    assert not run_io_test(program, "10\n", " 55").passed
    assert normalise_output("a  \nb\n\n") == "a\nb"


def test_a_wrong_or_crashing_solution_fails_only_its_tests(nothing_left_behind):
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert missing(1) == 1"]
    assert code_reward("q", _block("def add(a, b):\n    return a + b"),
                       tests)["correct"] == pytest.approx(1 / 3)
    assert code_reward("q", _block("def add(a, b):\n    return a + b\nraise RuntimeError"),
                       tests)["correct"] == 0.0
    # judge-side objects other than literals do not cross into the solution
    crossing = run_assert_test("def apply(f, x):\n    return f(x)", "assert apply(lambda x: x, 1) == 1")
    assert not crossing.passed and "cannot pass" in crossing.detail
