"""Bring your own data: a user's dataset (JSONL, JSON, CSV, Parquet or a saved `datasets` directory) read
into training and held-out prompts, with every problem reported as a one-line `DatasetError`."""

from __future__ import annotations

import csv
import os
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detached_rl.core.prompts import PromptItem, _make_item, _read_csv, _read_json, _read_jsonl

#: The roles `task.columns` may map, and the column each reads by default.
DEFAULT_COLUMNS: dict[str, str] = {"prompt": "prompt", "answer": "answer"}
#: Suffixes of the files `load_task_data` reads (a directory is read with `datasets.load_from_disk`).
FILE_KINDS: dict[str, str] = {".jsonl": "JSONL", ".json": "JSON", ".csv": "CSV", ".parquet": "Parquet"}
#: The held-out fraction when `held_out` is None and the dataset has no "test" split.
DEFAULT_HELD_OUT_FRACTION = 0.1
#: Seeds the held-out shuffle: fixed, so the held-out set never depends on a training seed.
HELD_OUT_SEED = 1234
_MAX_REASON = 200


class DatasetError(ValueError):
    """A dataset that cannot be used: one line naming the file (and the column or split)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class TaskData:
    """The training prompts and the held-out prompts of a task's dataset."""

    train: list[PromptItem]
    held_out: list[PromptItem]


@dataclass
class _Split:
    """The rows of one split: `rows` are (where, row) pairs, `where` already prefixed with the file."""

    columns: list[str]
    rows: list[tuple[str, Any]]
    from_csv: bool = False


def _reason(error: BaseException) -> str:
    """The first line of an exception's text, shortened, for a one-line message."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _key_union(rows: list[tuple[str, Any]]) -> list[str]:
    """The keys of the object rows, in order of first appearance."""
    keys: dict[str, None] = {}
    for _, row in rows:
        if isinstance(row, Mapping):
            keys.update(dict.fromkeys(row))
    return list(keys)


def _prefixed(path: Path, rows: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [(f"{path}: {where}", row) for where, row in rows]


def _read_text_file(path: Path, suffix: str) -> _Split:
    """A JSONL, JSON or CSV file as one split, read by prompts.py's readers."""
    kind = FILE_KINDS[suffix]
    try:
        if suffix == ".csv":
            with path.open(encoding="utf-8-sig", newline="") as f:
                header = csv.DictReader(f).fieldnames
            if not header:
                return _Split([], [], from_csv=True)
            # `_read_csv` checks its key against the header; the caller checks the real prompt column.
            return _Split(list(header), _prefixed(path, _read_csv(path, header[0])), from_csv=True)
        rows = _read_jsonl(path) if suffix == ".jsonl" else _read_json(path)
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: cannot read it as {kind}: not UTF-8 text ({_reason(e)})") from e
    except csv.Error as e:
        raise DatasetError(f"{path}: cannot read it as CSV: {_reason(e)}") from e
    except ValueError as e:  # prompts.py's messages already start with the path
        raise DatasetError(str(e)) from e
    except OSError as e:
        raise DatasetError(f"{path}: cannot read it as {kind}: {_reason(e)}") from e
    return _Split(_key_union(rows), _prefixed(path, rows))


def _read_parquet(path: Path) -> _Split:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
        rows = table.to_pylist()  # plain Python values, no numpy scalars
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DatasetError(f"{path}: cannot read it as Parquet: {_reason(e)}") from e
    return _Split(list(table.column_names), [(f"{path}: row {i}", row) for i, row in enumerate(rows)])


def _open_splits(path: Path) -> dict[str, Callable[[], _Split]]:
    """The dataset's splits by name, each read when called: a file or a saved `Dataset` has one, "train"."""
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    if path.is_dir():
        import datasets

        try:
            saved = datasets.load_from_disk(str(path))
        except Exception as e:  # FileNotFoundError for a plain directory, arrow errors for a damaged one
            # datasets 5.2 saves a split with no rows as no shards, then fails reading it with an IndexError.
            hint = " (a split with no rows?)" if isinstance(e, IndexError) else ""
            raise DatasetError(f"{path}: cannot read it as a dataset saved by datasets' save_to_disk: "
                               f"{_reason(e)}{hint}") from e
        named = dict(saved) if isinstance(saved, datasets.DatasetDict) else {"train": saved}

        def reader(name: str, dataset: Any) -> Callable[[], _Split]:
            def read() -> _Split:
                try:
                    rows = dataset.to_list()
                except Exception as e:
                    raise DatasetError(f"{path}: split {name!r}: cannot read it: {_reason(e)}") from e
                where = f"{path}: split {name!r}: row"
                return _Split(list(dataset.column_names), [(f"{where} {i}", r) for i, r in enumerate(rows)])
            return read

        return {name: reader(name, dataset) for name, dataset in named.items()}
    suffix = path.suffix.lower()
    if suffix not in FILE_KINDS:
        raise DatasetError(f"{path}: unknown dataset kind {path.suffix or '(no suffix)'!r} (use a .jsonl, "
                           ".json, .csv or .parquet file, or a directory saved by datasets' save_to_disk)")
    if suffix == ".parquet":
        return {"train": lambda: _read_parquet(path)}
    return {"train": lambda: _read_text_file(path, suffix)}


def _roles(path: Path, columns: Mapping[str, str] | None) -> tuple[str, str | None, bool]:
    """(prompt column, answer column or None, whether the answer column was named explicitly)."""
    columns = {} if columns is None else columns
    if not isinstance(columns, Mapping):
        raise DatasetError(f"{path}: task.columns must be a mapping of roles to columns, "
                           f"got {type(columns).__name__}")
    for role, column in columns.items():
        if role not in DEFAULT_COLUMNS:
            raise DatasetError(f"{path}: unknown key {role!r} in task.columns "
                               f"(roles: {list(DEFAULT_COLUMNS)})")
        if not isinstance(column, str) or not column:
            raise DatasetError(f"{path}: task.columns.{role} must be a column name, got {column!r}")
    prompt = columns.get("prompt", DEFAULT_COLUMNS["prompt"])
    explicit = "answer" in columns
    answer = columns.get("answer", DEFAULT_COLUMNS["answer"])
    if answer == prompt:
        if explicit:
            raise DatasetError(f"{path}: task.columns.prompt and task.columns.answer both name {prompt!r}")
        return prompt, None, False
    return prompt, answer, explicit


def _items(path: Path, name: str, split: _Split, prompt_col: str, answer_col: str | None,
           answer_explicit: bool, system_prompt: str | None) -> list[PromptItem]:
    """A split's rows as prompt items, after checking its columns."""
    if not split.rows:
        raise DatasetError(f"{path}: split {name!r} has no rows")
    if prompt_col not in split.columns:
        raise DatasetError(f"{path}: no column {prompt_col!r} (task.columns.prompt); "
                           f"columns: {split.columns}")
    if answer_col is not None and answer_col not in split.columns:
        if answer_explicit:
            raise DatasetError(f"{path}: no column {answer_col!r} (task.columns.answer); "
                               f"columns: {split.columns}")
        answer_col = None
    items = []
    for where, row in split.rows:
        if not isinstance(row, Mapping):
            raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
        prompt = row.get(prompt_col)
        if prompt is None or (isinstance(prompt, str) and not prompt.strip()) or prompt in ([], {}):
            raise DatasetError(f"{where}: column {prompt_col!r} (task.columns.prompt) is empty")
        if not isinstance(prompt, str | list | Mapping):
            raise DatasetError(f"{where}: column {prompt_col!r} (task.columns.prompt) is not text "
                               f"(got {type(prompt).__name__})")
        try:
            items.append(_make_item(row, where, prompt_col, answer_col, None, system_prompt, split.from_csv))
        except ValueError as e:
            raise DatasetError(str(e)) from e
    return items


def _fraction(path: Path, held_out: Any) -> float | None:
    """`held_out` as a fraction in (0, 1), None for a split name or path; anything else is an error."""
    if isinstance(held_out, str):
        return None
    if isinstance(held_out, int | float) and not isinstance(held_out, bool) and 0 < held_out < 1:
        return float(held_out)
    raise DatasetError(f"{path}: task.held_out must be a fraction in (0, 1), a split name or a path, "
                       f"got {held_out!r}")


def _split_by_fraction(path: Path, items: list[PromptItem], fraction: float) -> TaskData:
    """Hold out round(fraction * n) rows (at least one), picked by a fixed-seed shuffle; file order kept."""
    order = list(range(len(items)))
    random.Random(HELD_OUT_SEED).shuffle(order)
    count = max(1, round(fraction * len(items)))
    picked = set(order[:count])
    train = [item for i, item in enumerate(items) if i not in picked]
    held = [item for i, item in enumerate(items) if i in picked]
    if not train:
        raise DatasetError(f"{path}: holding out {count} of {len(items)} rows (task.held_out={fraction}) "
                           "leaves the training split empty")
    return TaskData(train, held)


def load_task_data(
    path: str | os.PathLike[str],
    columns: Mapping[str, str] | None = None,
    held_out: float | str | None = None,
    system_prompt: str | None = None,
    train_split: str = "train",
) -> TaskData:
    """Read a dataset file or saved `datasets` directory into train and held-out prompts (DatasetError)."""
    path = Path(path)
    prompt_col, answer_col, answer_explicit = _roles(path, columns)
    fraction = _fraction(path, held_out) if held_out is not None else None
    splits = _open_splits(path)
    if train_split not in splits:
        raise DatasetError(f"{path}: no split {train_split!r} (task.train_split); splits: {list(splits)}")

    def items_of(where: Path, name: str, split: _Split) -> list[PromptItem]:
        return _items(where, name, split, prompt_col, answer_col, answer_explicit, system_prompt)

    if held_out == train_split:
        raise DatasetError(f"{path}: task.held_out names the training split {held_out!r}")
    train = items_of(path, train_split, splits[train_split]())
    if held_out is None:
        if "test" in splits and train_split != "test":
            return TaskData(train, items_of(path, "test", splits["test"]()))
        return _split_by_fraction(path, train, DEFAULT_HELD_OUT_FRACTION)
    if fraction is not None:
        return _split_by_fraction(path, train, fraction)
    assert isinstance(held_out, str)
    if held_out in splits:
        return TaskData(train, items_of(path, held_out, splits[held_out]()))
    other = Path(held_out)
    if not other.exists():
        raise DatasetError(f"{path}: task.held_out {held_out!r} is neither a split of this dataset nor an "
                           f"existing file or directory; splits: {list(splits)}")
    if other.resolve() == path.resolve():
        raise DatasetError(f"{path}: task.held_out is the training dataset itself")
    other_splits = _open_splits(other)
    name = "test" if "test" in other_splits else "train"
    if name not in other_splits:
        raise DatasetError(f"{other}: no split 'test' or 'train' to hold out (task.held_out); "
                           f"splits: {list(other_splits)}")
    try:
        return TaskData(train, items_of(other, name, other_splits[name]()))
    except DatasetError as e:
        raise DatasetError(f"{e} (the held-out set, task.held_out)") from e


def describe(data: TaskData) -> str:
    """A one-line count for CLI messages, e.g. "412 train, 46 held-out prompts"."""
    return f"{len(data.train)} train, {len(data.held_out)} held-out prompts"


#: A dataset path inside a module shipped to the actor's host (`config.shipping`): `shipped:<module>/<name>`.
SHIPPED = "shipped:"


def resolve_data_path(path: str) -> str:
    """`path` on this host: a shipped dataset (`shipped:<module>/<name>`) inside the module Ray unpacked here,
    anything else as it is."""
    if not path.startswith(SHIPPED):
        return path
    import importlib.util

    module, _, name = path[len(SHIPPED):].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"{path}: the shipped module {module!r} is not on this host (was the actor "
                           "started without its runtime_env?)")
    return str(Path(list(spec.submodule_search_locations)[0]) / name)
