"""Grade a candidate program against tests so that the candidate cannot forge the verdict.

* Input/output tests: the candidate runs in the sandbox with the test's stdin; this process compares
  its stdout with the expected output (after stripping trailing whitespace per line).
* Assert-style tests (`"assert add(1, 2) == 3"`): the test never runs in the candidate's interpreter.
  Two sandboxes start: the CANDIDATE runs the solution (as module `solution`) and then serves
  requests; the JUDGE, a fresh interpreter, runs the trusted test code. A name the test uses that is
  neither a builtin nor defined by the test resolves in the candidate: the judge sends
  (operation, handle, arguments) as a Python literal over a pipe, the candidate calls its object and
  answers with a literal. The judge accepts only what `ast.literal_eval` reads back (int, float,
  complex, str, bytes, bool, None and lists, tuples, dicts, sets of them): an object whose `__eq__`
  always returns True cannot cross. Other results come back as opaque handles that support calls,
  attribute access, len/iter/next/indexing/truth (so `Solution().method(...)` works) but compare
  equal only to themselves; `in` on one is decided judge-side by iterating it. Exceptions come back
  as the builtin exception of that name (else `SolutionError`). Builtin names always mean the
  judge's builtins.
* The verdict is what the judge writes on a pipe only it holds, after the test code ran to the end;
  the parent reads it together with the judge's exit status. The two sandboxes share nothing but the
  two request/answer pipes (separate PID, IPC, network and mount namespaces), so the candidate can
  influence the judge only through the literal values it answers. Each call has a deadline
  (`call_timeout_s`); the whole test has `timeout_s`, after which both are killed; both are always
  killed at the end.

What this cannot grade: tests that pass judge-side objects other than literals (lambdas, test-defined
classes) into the solution, or that compare solution-defined objects by value (`==` on a handle is
identity).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from detached_rl.rewards import sandbox

MAX_MESSAGE_KB = 1024  # the largest answer the judge reads back

# The solution's side: runs the solution, then answers the judge's requests. It runs in the candidate's
# interpreter, which the solution controls; nothing here needs to be trusted.
_CANDIDATE = r'''
import builtins, os, sys
sys.set_int_max_str_digits(0)
_requests, _answers, _source = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
del sys.argv[1:]


def _serve(requests, answers, source):
    import ast
    handles = {}
    scalars = (int, float, complex, str, bytes, bool, type(None))

    def is_literal(value, depth=0):
        kind = type(value)
        if kind in scalars:
            return True
        if depth > 64:
            return False
        if kind in (list, tuple, set):
            return all(is_literal(item, depth + 1) for item in value)
        if kind is dict:
            return all(is_literal(k, depth + 1) and is_literal(v, depth + 1) for k, v in value.items())
        return False

    def encode(value):
        if is_literal(value):
            return ("v", value)
        handles[len(handles) + 1] = value
        return ("h", len(handles))

    def decode(item):
        return handles[item[1]] if item[0] == "h" else item[1]

    class NonFinite(ast.NodeTransformer):
        def visit_Name(self, node):
            return ast.Constant(float(node.id)) if node.id in ("inf", "nan") else node

    def failure(error):
        try:
            message = str(error)[:2000]
        except BaseException:
            message = ""
        return ("err", type(error).__name__, message)

    def send(message):
        data = repr(message).encode("utf-8", "surrogatepass")
        data = len(data).to_bytes(4, "big") + data
        while data:
            data = data[os.write(answers, data):]

    def read_exactly(size):
        data = b""
        while len(data) < size:
            chunk = os.read(requests, size - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    operations = {"len": len, "iter": iter, "next": next, "bool": bool,
                  "getitem": lambda obj, key: obj[key], "contains": lambda obj, item: item in obj}
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
        ready = ("ready",)
    except SystemExit:
        ready = ("ready",)
    except BaseException as error:
        ready = failure(error)
    send(ready)
    while ready == ("ready",):
        header = read_exactly(4)
        body = header and read_exactly(int.from_bytes(header, "big"))
        if not body:
            return
        tree = ast.parse(body.decode("utf-8", "surrogatepass"), mode="eval")
        request = ast.literal_eval(NonFinite().visit(tree))
        try:
            if request[0] == "get":
                if request[1] not in namespace:
                    raise NameError(f"name {request[1]!r} is not defined")
                result = namespace[request[1]]
            elif request[0] == "call":
                keywords = {k: decode(v) for k, v in request[3].items()}
                result = decode(request[1])(*map(decode, request[2]), **keywords)
            elif request[0] == "getattr":
                result = getattr(decode(request[1]), request[2])
            else:
                result = operations[request[1]](*map(decode, request[2]))
            answer = ("ok", encode(result))
            repr(answer)
        except BaseException as error:
            answer = failure(error)
        send(answer)


_serve(_requests, _answers, _source)
'''

# The trusted side: a fresh interpreter running the test code; the solution's names are remote proxies.
_JUDGE = r'''
import ast, builtins, os, select, sys, time, traceback
sys.set_int_max_str_digits(0)
_REQUESTS, _ANSWERS, _VERDICT = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
_CALL_TIMEOUT, _MAX_MESSAGE, _TEST = float(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
del sys.argv[1:]


class SolutionTimeout(Exception):
    """The solution did not answer within the per-call deadline."""


class SolutionError(Exception):
    """The solution raised an exception that is not a builtin one, or answered something malformed."""


def _is_literal(value, depth=0):
    kind = type(value)
    if kind in (int, float, complex, str, bytes, bool, type(None)):
        return True
    if depth > 64:
        return False
    if kind in (list, tuple, set):
        return all(_is_literal(item, depth + 1) for item in value)
    if kind is dict:
        return all(_is_literal(k, depth + 1) and _is_literal(v, depth + 1) for k, v in value.items())
    return False


def _wait(fd, writing, deadline):
    remaining = deadline - time.monotonic()
    ready = select.select([], [fd], [], max(remaining, 0))[1] if writing else \
        select.select([fd], [], [], max(remaining, 0))[0]
    if not ready:
        raise SolutionTimeout(f"the solution did not answer within {_CALL_TIMEOUT} s")


def _read_exactly(size, deadline):
    data = b""
    while len(data) < size:
        _wait(_ANSWERS, False, deadline)
        chunk = os.read(_ANSWERS, min(size - len(data), 1 << 20))
        if not chunk:
            raise SolutionError("the solution exited")
        data += chunk
    return data


def _receive(deadline):
    size = int.from_bytes(_read_exactly(4, deadline), "big")
    if size > _MAX_MESSAGE:
        raise SolutionError(f"the solution's answer is larger than {_MAX_MESSAGE} bytes")
    text = _read_exactly(size, deadline).decode("utf-8", "surrogatepass")
    try:
        return ast.literal_eval(_NonFinite().visit(ast.parse(text, mode="eval")))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise SolutionError("the solution's answer is not a literal") from None


class _NonFinite(ast.NodeTransformer):
    """repr() writes inf and nan as bare names: read exactly those two as floats."""

    def visit_Name(self, node):
        if node.id in ("inf", "nan"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        return node


def _remote_exception(name, message):
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:
            pass
    return SolutionError(f"{name}: {message}")


def _result(answer):
    if type(answer) is tuple and len(answer) == 2 and answer[0] == "ok" and type(answer[1]) is tuple \
            and len(answer[1]) == 2:
        tag, value = answer[1]
        if tag == "v":
            return value
        if tag == "h" and type(value) is int:
            return Remote(value)
    if type(answer) is tuple and len(answer) == 3 and answer[0] == "err" and type(answer[1]) is str \
            and type(answer[2]) is str:
        raise _remote_exception(answer[1], answer[2])
    raise SolutionError("malformed answer from the solution")


def _encode(value):
    if type(value) is Remote:
        return ("h", object.__getattribute__(value, "_handle"))
    if _is_literal(value):
        return ("v", value)
    raise TypeError(f"cannot pass a {type(value).__name__} to the solution: only literals and its own "
                    "objects")


def _exchange(request):
    deadline = time.monotonic() + _CALL_TIMEOUT
    data = repr(request).encode("utf-8", "surrogatepass")
    data = len(data).to_bytes(4, "big") + data
    while data:
        _wait(_REQUESTS, True, deadline)
        data = data[os.write(_REQUESTS, data[:65536]):]
    return _result(_receive(deadline))


class Remote:
    """An object living in the solution's interpreter; equal only to itself."""

    __slots__ = ("_handle",)

    def __init__(self, handle):
        object.__setattr__(self, "_handle", handle)

    def __getattr__(self, name):
        return _exchange(("getattr", ("h", self._handle), name))

    def __call__(self, *args, **kwargs):
        return _exchange(("call", ("h", self._handle), tuple(map(_encode, args)),
                          {key: _encode(value) for key, value in kwargs.items()}))

    def _operation(self, name, *args):
        return _exchange(("op", name, (("h", self._handle),) + tuple(map(_encode, args))))

    def __len__(self):
        return self._operation("len")

    def __bool__(self):
        return self._operation("bool")

    def __iter__(self):
        return self._operation("iter")

    def __next__(self):
        return self._operation("next")

    def __getitem__(self, key):
        return self._operation("getitem", key)

    def __contains__(self, item):
        # Decided here, by iterating: a solution object answering "yes" to every `in` must not pass.
        return any(element is item or element == item for element in self)

    def __repr__(self):
        return f"<solution object {self._handle}>"


class _Names(dict):
    """The test's globals: builtins first, then the test's own names, then the solution's (objects cached)."""

    def __missing__(self, name):
        if hasattr(builtins, name):
            return getattr(builtins, name)
        value = _exchange(("get", name))
        if type(value) is Remote:
            self[name] = value
        return value


def _main():
    verdict = b"fail"
    try:
        deadline = time.monotonic() + _CALL_TIMEOUT
        answer = _receive(deadline)
        if answer != ("ready",):
            _result(answer)
            raise SolutionError("the solution did not start")
        exec(compile(_TEST, "test.py", "exec"), _Names(__name__="__main__", __builtins__=builtins))
        verdict = b"pass"
    except SolutionTimeout:
        verdict = b"timeout"
        traceback.print_exc()
    except BaseException:
        traceback.print_exc()
    os.write(_VERDICT, verdict)


_main()
'''


@dataclass(frozen=True)
class Verdict:
    """One test's outcome; `detail` is the judge's or the program's stderr tail, for debugging."""

    passed: bool
    timed_out: bool
    detail: str = ""


def normalise_output(text: str) -> str:
    """Trailing whitespace dropped from every line and trailing blank lines dropped."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def run_io_test(program: str, stdin: str, expected: str, *, timeout_s: float = 5.0,
                memory_mb: int = 256) -> Verdict:
    """Run `program` with `stdin`; passes on exit status 0 and stdout equal to `expected` (normalised)."""
    result = sandbox.run_python(program, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb)
    passed = result.ok and normalise_output(result.stdout) == normalise_output(expected)
    return Verdict(passed, result.timed_out, result.stderr[-2000:])


def run_assert_test(
    program: str,
    test: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    call_timeout_s: float | None = None,
    max_message_kb: int = MAX_MESSAGE_KB,
) -> Verdict:
    """Run assert-style `test` in a judge sandbox against `program` served from a candidate sandbox."""
    if not (sandbox.code_is_valid(program) and sandbox.code_is_valid(test)):
        return Verdict(False, False, "sandbox: code too long or contains NUL bytes")
    sandbox.ensure_available()
    limits = sandbox.limits_for(timeout_s, memory_mb)
    deadline = time.monotonic() + timeout_s
    requests_read, requests_write = os.pipe()
    answers_read, answers_write = os.pipe()
    verdict_read, verdict_write = os.pipe()
    ours = {requests_read, requests_write, answers_read, answers_write, verdict_read, verdict_write}
    candidate = judge = None
    verdict, returncode = b"", -1
    try:
        candidate = sandbox.SandboxedProcess(
            _CANDIDATE, limits, args=(str(requests_read), str(answers_write), program),
            pass_fds=(requests_read, answers_write), capture=False,
        )
        call_timeout = timeout_s if call_timeout_s is None else call_timeout_s
        judge = sandbox.SandboxedProcess(
            _JUDGE, limits, pass_fds=(requests_write, answers_read, verdict_write),
            args=(str(requests_write), str(answers_read), str(verdict_write), repr(float(call_timeout)),
                  str(max_message_kb * 1024), test),
        )
        for fd in ours - {verdict_read}:  # only the sandboxes hold the pipes now: an exit is seen as EOF
            os.close(fd)
        ours = {verdict_read}
        _, stderr, reason = judge.communicate(b"", deadline, 64 * 1024)
        os.set_blocking(verdict_read, False)
        with contextlib.suppress(BlockingIOError):
            verdict = os.read(verdict_read, 16)
    finally:
        if judge is not None:
            returncode = judge.close()
        if candidate is not None:
            candidate.close()
        for fd in ours:
            os.close(fd)
    passed = reason is None and returncode == 0 and verdict == b"pass"
    timed_out = reason == "timeout" or verdict == b"timeout"
    return Verdict(passed, timed_out, stderr.decode("utf-8", "replace")[-2000:])
