"""Verifiable reward functions: plain Python functions of (prompt, response, **metadata).

Each returns a dict with the total under "reward" and its components ("correct", "format",
both in [0, 1]), the shape `detached_rl.models.FunctionReward` turns into a batch scorer.
`REWARD_FUNCTIONS` / `get_reward_function` look them up by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence

from detached_rl.rewards.grading import run_assert_test, run_io_test
from detached_rl.rewards.math_verify import MathVerifyWorker

_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in `text` (commas as thousands separators allowed), or None.

    The last, not the first: asked "What is a + b?", small models answer "a + b = c".
    """
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return float(matches[-1].replace(",", ""))


def numeric_answer_reward(
    prompt: str, response: str, answer: float, format_weight: float = 0.1, tolerance: float = 1e-6
) -> dict[str, float]:
    """1 for a correct final number (plus `format_weight` for writing any number at all), else 0 / format."""
    if not math.isfinite(answer):
        raise ValueError(f"numeric_answer_reward: answer must be finite, got {answer}")
    value = last_number(response)
    has_number = float(value is not None)
    correct = float(value is not None and abs(value - answer) <= tolerance)
    return {"reward": correct + format_weight * has_number, "correct": correct, "format": has_number}


# ------------------------------------------------------------------ answer normalisation

_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_FRACTION = re.compile(r"([-+]?\d+)\s*/\s*(\d+)")


def as_number(text: str) -> float | None:
    """`text` as a finite number ("1,234", "-0.5", "3/4", "1e-3", "$12"), or None."""
    text = text.strip().strip("$").strip()
    if _PLAIN_NUMBER.fullmatch(text):
        return float(text.replace(",", ""))
    if match := _FRACTION.fullmatch(text):
        denominator = int(match[2])
        return int(match[1]) / denominator if denominator else None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def normalise_answer(text: str) -> str:
    """Case-folded, whitespace-collapsed, without a trailing full stop."""
    return " ".join(text.casefold().split()).rstrip(".").strip()


def answers_match(predicted: str, answer: object, tolerance: float = 1e-6) -> bool:
    """Numerically equal (relative and absolute `tolerance`) when both are numbers,
    else equal after normalising."""
    gold = str(answer)
    predicted_value, gold_value = as_number(predicted), as_number(gold)
    if predicted_value is not None and gold_value is not None:
        return math.isclose(predicted_value, gold_value, rel_tol=tolerance, abs_tol=tolerance)
    return normalise_answer(predicted) == normalise_answer(gold)


def _result(correct: float, has_format: float, format_weight: float) -> dict[str, float]:
    """The dict every reward function returns."""
    return {"reward": correct + format_weight * has_format, "correct": correct, "format": has_format}


# ------------------------------------------------------------------ final "Answer: <number>" line

_EQUATION = re.compile(r"\d\s*[-+*/x×]\s*\d[^=\n]*=\s*-?\d")
_ANSWER_LINE = re.compile(r"^[*\s]*answer\s*:\s*\$?\s*(-?\d+(?:,\d{3})*(?:\.\d+)?)[\s.*]*$",
                          re.IGNORECASE | re.MULTILINE)


def extract_answer_line(response: str) -> float | None:
    """The number of the last line of the form 'Answer: <number>' anywhere in the response, or None."""
    matches = _ANSWER_LINE.findall(response)
    return float(matches[-1].replace(",", "")) if matches else None


_ANSWER_MENTION = re.compile(r"\banswer\b\W{0,3}(?:is|=|:)?\W{0,3}-?\d", re.IGNORECASE)


def answer_line_format(response: str) -> float:
    """How closely the response follows 'calculation, then a last line Answer: <number>', in four steps.

    1.0: the last non-empty line is 'Answer: <number>' and an equation ('12 - 5 = 7') comes before it;
    0.5: an 'Answer: <number>' line somewhere; 0.25: the answer stated in words ('the answer is 7');
    0.0: none of these. The steps give a policy that never writes the format a gradient towards it.
    """
    lines = [line for line in response.strip().splitlines() if line.strip()]
    if extract_answer_line(response) is None:
        return 0.25 if _ANSWER_MENTION.search(response) else 0.0
    ends = bool(_ANSWER_LINE.fullmatch(lines[-1]))
    shows_work = _EQUATION.search("\n".join(lines[:-1])) is not None
    return 1.0 if ends and shows_work else 0.5


def answer_line_reward(
    prompt: str, response: str, answer: float, format_weight: float = 0.2, tolerance: float = 1e-6,
    **_metadata: object,
) -> dict[str, float]:
    """reward = correct + format_weight * format, for prompts that ask for a final 'Answer: <number>' line.

    correct = 1 when the number on the last 'Answer: <number>' line (case-insensitive, optional
    '$', '*' and full stop) equals `answer` within `tolerance`; an answer not given on such a
    line is not graded. format (see `answer_line_format`) is 0, 0.25, 0.5 or 1. `lenient` = 1 when
    the last number anywhere in the response is right: reported, never rewarded.
    """
    predicted = extract_answer_line(response)
    correct = float(predicted is not None and abs(predicted - answer) <= tolerance)
    last = last_number(response)
    result = _result(correct, answer_line_format(response), format_weight)
    result["lenient"] = float(last is not None and abs(last - answer) <= tolerance)
    return result


# ------------------------------------------------------------------ <think>…</think><answer>…</answer>

_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_THINK_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def has_think_answer_format(response: str) -> bool:
    """Exactly one <think>…</think> then exactly one <answer>…</answer>, with only whitespace around."""
    return all(response.count(tag) == 1 for tag in _TAGS) and _THINK_ANSWER.fullmatch(response) is not None


def extract_tagged_answer(response: str) -> str | None:
    """The stripped text of the last <answer>…</answer>, or None."""
    answers = _ANSWER.findall(response)
    return answers[-1].strip() if answers else None


def think_answer_tags_reward(
    prompt: str, response: str, answer: object, format_weight: float = 0.1, tolerance: float = 1e-6,
    **_metadata: object,
) -> dict[str, float]:
    """reward = correct + format_weight * format.

    format = 1 for exactly one <think>…</think> followed by exactly one <answer>…</answer> and
    nothing but whitespace around them; correct = 1 when the last <answer> (whatever the format)
    equals `answer`: numerically within `tolerance` if both are numbers, else as normalised
    strings. Other metadata is ignored.
    """
    predicted = extract_tagged_answer(response)
    correct = float(predicted is not None and answers_match(predicted, answer, tolerance))
    return _result(correct, float(has_think_answer_format(response)), format_weight)


# ------------------------------------------------------------------ \boxed{…}

_BOXED = re.compile(r"\\boxed\s*\{")
_MAX_MATH_CHARS = 1000  # no real answer is longer; sympy would only burn time on it

_MATH_VERIFY = MathVerifyWorker()


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{…} (nested and escaped braces allowed), or
    None if absent or unclosed."""
    starts = [match.end() for match in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, index = 1, starts[-1]
    while index < len(text):
        char = text[index]
        if char == "\\":
            index += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[starts[-1]:index].strip()
        index += 1
    return None


def math_equal_or_none(predicted: str, answer: str, timeout_s: float = 3.0) -> bool | None:
    """Mathematically equivalent per math-verify; None when its worker is down (and the strings differ).

    Safe from any thread; a comparison that overruns `timeout_s` counts as not equal. Raises
    `MathVerifyUnavailable` when math-verify is not installed.
    """
    if "".join(predicted.split()) == "".join(answer.split()):
        return True
    if max(len(predicted), len(answer)) > _MAX_MATH_CHARS:
        return False
    return _MATH_VERIFY.equal(predicted, answer, timeout_s)


def math_equal(predicted: str, answer: str, timeout_s: float = 3.0) -> bool:
    """`math_equal_or_none`, a down worker counting as not equal
    (whitespace-insensitive strings still match)."""
    return bool(math_equal_or_none(predicted, answer, timeout_s))


def boxed_reward(
    prompt: str, response: str, answer: object, format_weight: float = 0.1, timeout_s: float = 3.0,
    **_metadata: object,
) -> dict[str, float]:
    """reward = correct + format_weight * format.

    format = 1 when the response has a closed \\boxed{…}; correct = 1 when the last one is
    mathematically equivalent to `answer` (math-verify in a helper process, counted as wrong
    after `timeout_s` per step). While its worker is down, only whitespace-insensitive string
    equality counts and the component `verifier_unavailable` is 1 (a metric, never silent);
    without math-verify installed it raises. A boxed `answer` is unboxed first. Other metadata
    is ignored.
    """
    predicted = last_boxed(response)
    if predicted is None:
        return {**_result(0.0, 0.0, format_weight), "verifier_unavailable": 0.0}
    gold = str(answer)
    gold = last_boxed(gold) or gold
    equal = math_equal_or_none(predicted, gold, timeout_s)
    return {**_result(float(bool(equal)), 1.0, format_weight), "verifier_unavailable": float(equal is None)}


# ------------------------------------------------------------------ code

_FENCE = "```"
_PYTHON_LANGUAGES = ("", "python", "python3", "py")


def last_python_block(response: str) -> str | None:
    """The code of the last closed ``` fenced block tagged python/py/python3 or untagged, or None."""
    parts = response.split(_FENCE)
    for block in reversed(parts[1:-1:2]):  # odd parts lie between an opening and a closing fence
        language, newline, body = block.partition("\n")
        if newline and language.strip().lower() in _PYTHON_LANGUAGES and body.strip():
            return body
    return None


def _run_test(program: str, test: str | Mapping[str, str], timeout_s: float,
              memory_mb: int) -> tuple[bool, bool]:
    """(passed, timed out) for one test of `program` (`detached_rl.rewards.grading`)."""
    if isinstance(test, str):
        verdict = run_assert_test(program, test, timeout_s=timeout_s, memory_mb=memory_mb)
    else:
        verdict = run_io_test(program, test.get("input", ""), test["output"], timeout_s=timeout_s,
                              memory_mb=memory_mb)
    return verdict.passed, verdict.timed_out


def _check_tests(tests: Sequence[str | Mapping[str, str]]) -> None:
    """Reject empty or malformed test lists (a configuration error, not a bad response)."""
    if not tests or isinstance(tests, str):
        raise ValueError(f"code_reward: tests must be a non-empty list, got {tests!r}")
    for test in tests:
        if not isinstance(test, str) and not (isinstance(test, Mapping) and "output" in test):
            raise ValueError(f"code_reward: a test is an assert string or {{'input', 'output'}} dict, "
                             f"got {test!r}")


def code_reward(
    prompt: str,
    response: str,
    tests: Sequence[str | Mapping[str, str]],
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    format_weight: float = 0.0,
    stop_on_timeout: bool = True,
    **_metadata: object,
) -> dict[str, float]:
    """reward = correct + format_weight * format, correct = fraction of `tests` passed.

    format = 1 when the response has a closed fenced Python block; the last one is graded in the
    sandbox (`detached_rl.rewards.grading`) once per test. A test is either {"input": stdin,
    "output": expected stdout} (passes on exit status 0 and equal output after stripping trailing
    whitespace per line, compared by this process), or an assert string run by a separate judge
    interpreter that calls into the solution and accepts only literal values back (passes when it
    completes). After a timeout the remaining tests count as failed unless `stop_on_timeout` is
    False (a looping solution would otherwise cost len(tests) * timeout_s). Other metadata is
    ignored. Raises `SandboxUnavailable` where the sandbox cannot be set up (never scores 0 silently).
    """
    _check_tests(tests)
    program = last_python_block(response)
    if program is None:
        return _result(0.0, 0.0, format_weight)
    passed = 0
    for test in tests:
        ok, timed_out = _run_test(program, test, timeout_s, memory_mb)
        passed += ok
        if timed_out and stop_on_timeout:
            break
    return _result(passed / len(tests), 1.0, format_weight)


# ------------------------------------------------------------------ registry

REWARD_FUNCTIONS: dict[str, Callable[..., dict[str, float]]] = {
    "numeric_answer": numeric_answer_reward,
    "answer_line": answer_line_reward,
    "think_answer_tags": think_answer_tags_reward,
    "boxed": boxed_reward,
    "code": code_reward,
}


def get_reward_function(name: str) -> Callable[..., dict[str, float]]:
    """The reward function registered as `name`."""
    if name not in REWARD_FUNCTIONS:
        raise ValueError(f"unknown reward function {name!r}; choose one of {sorted(REWARD_FUNCTIONS)}")
    return REWARD_FUNCTIONS[name]
