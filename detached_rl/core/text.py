"""One line of text from a message or an error, for status rows, logs and one-line CLI errors."""

from __future__ import annotations

from typing import Any


def first_line(value: Any) -> str:
    """The first non-empty line of `value`'s text; for an exception without text, its type's name."""
    text = str(value).strip()
    if text:
        return text.splitlines()[0].strip()
    return type(value).__name__ if isinstance(value, BaseException) else ""
