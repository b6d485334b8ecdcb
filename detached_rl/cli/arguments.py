"""Argument types that refuse bad numbers and files while the command line is parsed, a parser that says so in
one line, and the range check of a loaded config's integers."""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

EXIT_ERROR = 2
MAX_COUNT = 10**9  # the largest count, step number, size or seed a flag or an integer config key takes
MAX_BYTES = 2**40  # the largest `*_bytes` config key (1 TiB)
# Lower bounds of the integer config keys whose own checks leave them open (by dotted key, else by last part);
# every other integer key must be >= 0 (stricter bounds are the schema's).
CONFIG_INT_MINIMUM = {"model.lora.r": 1, "maker.max_restarts": -1, "trainer.max_reuse": 1,
                      "grpo.mini_batch_size": 1, "ppo.mini_batch_size": 1, "total_steps": 1}


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
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_at_least(low: int, high: int = MAX_COUNT) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` and <= `high`."""

    def parse(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        if value > high:
            raise argparse.ArgumentTypeError(f"must be <= {high}, got {text}")
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


def config_file(text: str) -> str:
    """An argparse type: a readable UTF-8 file (the YAML itself is checked when the config loads)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"config file {text!r} is a directory, not a YAML file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"config file {text!r} does not exist")
    try:
        path.read_bytes().decode("utf-8")
    except OSError as error:
        raise argparse.ArgumentTypeError(f"config file {text!r} cannot be read "
                                         f"({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise argparse.ArgumentTypeError(f"config file {text!r} is not UTF-8 text (byte "
                                         f"{error.object[error.start]:#04x} at offset {error.start}); "
                                         "give a YAML file") from None
    return text


def check_config_integers(config: Any, path: str = "") -> None:
    """Refuse, naming the dotted key, an integer of a loaded config outside its range
    (see `CONFIG_INT_MINIMUM`)."""
    # `run` first: values of other sections derive from it (a decaying schedule's total_steps is run.steps),
    # and the key to name is the one the user gave.
    for item in sorted(dataclasses.fields(config), key=lambda item: bool(path) or item.name != "run"):
        value = getattr(config, item.name)
        key = f"{path}.{item.name}" if path else item.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_config_integers(value, key)
        elif isinstance(value, int) and not isinstance(value, bool):
            low = CONFIG_INT_MINIMUM.get(key, CONFIG_INT_MINIMUM.get(item.name, 0))
            high = MAX_BYTES if item.name.endswith("_bytes") else MAX_COUNT
            if value < low:
                raise ValueError(f"{key}: must be >= {low}, got {value}")
            if value > high:
                raise ValueError(f"{key}: must be <= {high}, got {value}")
