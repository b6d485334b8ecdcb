"""The reward of the two-step task, as a user writes one (no detached_rl import needed).

A reward takes the batch's prompts and completions (decoded text) and every metadata column of the
dataset as a keyword argument, one list aligned with the completions, and returns one float each.
"""

from __future__ import annotations

import re

# A line "Answer: 14" (any case, optional "$", "*" bold markers and a full stop), anywhere in the text.
ANSWER_LINE = re.compile(r"^[*\s]*answer\s*:\s*\$?\s*(-?\d+(?:,\d{3})*(?:\.\d+)?)[\s.*]*$",
                         re.IGNORECASE | re.MULTILINE)


def final_answer(completion: str) -> float | None:
    """The number on the last 'Answer: <number>' line of `completion`, or None if it has none."""
    matches = ANSWER_LINE.findall(completion)
    return float(matches[-1].replace(",", "")) if matches else None


def correct(prompts: list[str], completions: list[str], answer: list, **metadata: list) -> list[float]:
    """1.0 where the last 'Answer: <number>' line equals the row's `answer`, else 0.0.

    `metadata` holds the dataset's other columns (here `operations`), unused.
    """
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
        predicted = final_answer(completion)
        scores.append(float(predicted is not None and abs(predicted - float(expected)) < 1e-6))
    return scores
