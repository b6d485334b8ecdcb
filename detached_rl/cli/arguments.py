"""Argument types that refuse bad numbers while the command line is parsed, and a parser that says so in one line."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_ERROR = 2


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line on stderr (`<prog>: error: ...`) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        """Print `message` on one line and exit with status 2."""
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(EXIT_ERROR)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low`."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def float_at_least(low: float, strictly: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= `low` (> `low` with `strictly`)."""

    def parse(text: str) -> float:
        value = _number(text)
        if value < low or (strictly and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strictly else '>='} {low:g}, got {text}")
        return value

    parse.__name__ = f"number {'>' if strictly else '>='} {low:g}"
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
positive_float = float_at_least(0.0, strictly=True)
non_negative_float = float_at_least(0.0)
finite_float = _number
