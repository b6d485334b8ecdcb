"""The built-in rewards in the signature of every reward `task.reward` names (docs/your-task.md).

A reward takes the batch's prompts and completions (decoded text) and the problems' metadata, one list per
column, and returns one value per completion: a float, or a dict with the total under "reward" and other
numbers to log beside it ("correct", "format"):

    def score(prompts: list[str], completions: list[str], **metadata: list) -> list[float]

Each built-in here wraps the per-sample function of `detached_rl.rewards.functions` of the same name; a config
names one as `detached_rl:<name>` or `<name>` (`task.reward: detached_rl:answer_line`, `rewards.specs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from detached_rl.rewards import functions

Value = float | dict[str, float]


def _batched(per_sample: Callable[..., Any], name: str, doc: str) -> Callable[..., list[Value]]:
    """`per_sample(prompt, completion, **metadata)` as a batch reward; None metadata values are left out."""

    def reward(prompts: Sequence[str], completions: Sequence[str], **metadata: Sequence[Any]) -> list[Value]:
        rows = []
        for index, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            fields = {key: column[index] for key, column in metadata.items() if column[index] is not None}
            rows.append(per_sample(prompt, completion, **fields))
        return rows

    reward.__name__ = reward.__qualname__ = name
    reward.__doc__ = doc
    return reward


answer_line = _batched(functions.answer_line_reward, "answer_line",
                       "correct + 0.2 * format for a last line 'Answer: <number>' (metadata: answer).")
numeric_answer = _batched(functions.numeric_answer_reward, "numeric_answer",
                          "1 for a right last number, plus 0.1 for writing one (metadata: answer).")
think_answer_tags = _batched(functions.think_answer_tags_reward, "think_answer_tags",
                             "correct + 0.1 * <think>…</think><answer>…</answer> format (metadata: answer).")
boxed = _batched(functions.boxed_reward, "boxed",
                 "correct (math-verify equivalence of the last \\boxed{}) + 0.1 * format (metadata: answer).")
code = _batched(functions.code_reward, "code",
                "The fraction of `tests` the last Python block passes in the sandbox (metadata: tests).")


def format(prompts: Sequence[str], completions: Sequence[str], **_metadata: Sequence[Any]) -> list[float]:  # noqa: A001
    """How closely each completion ends with 'Answer: <number>' after its working, in [0, 1]
    (`functions.answer_line_format`)."""
    return [functions.answer_line_format(completion) for completion in completions]


#: The built-in rewards by name: `task.reward: answer_line` is `task.reward: detached_rl:answer_line`.
BUILTIN_REWARDS: dict[str, Callable[..., list[Any]]] = {
    "answer_line": answer_line, "numeric_answer": numeric_answer, "think_answer_tags": think_answer_tags,
    "boxed": boxed, "code": code, "format": format,
}
