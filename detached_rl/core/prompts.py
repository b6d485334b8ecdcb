"""Prompt sources for experience makers: prompts with optional metadata (e.g. ground-truth answers)."""

from __future__ import annotations

import csv
import json
import math
import os
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from detached_rl.core.sampling import SamplingConfig


@dataclass(frozen=True)
class PromptItem:
    """A prompt (text or chat messages) and the metadata its reward function receives."""

    prompt: Any
    metadata: dict[str, Any] = field(default_factory=dict)


def as_prompt_item(item: Any) -> PromptItem:
    """Normalise a str, a `PromptItem`, or anything with `.prompt` and `.metadata` (e.g. a task `Problem`)."""
    if isinstance(item, PromptItem):
        return item
    if isinstance(item, str):
        return PromptItem(item)
    if hasattr(item, "prompt"):
        prompt = item.messages if hasattr(item, "messages") else item.prompt  # task problems: chat messages
        return PromptItem(prompt, dict(getattr(item, "metadata", {}) or {}))
    raise TypeError(f"cannot use {type(item).__name__} as a prompt (need str, PromptItem or .prompt)")


def prompt_text(prompt: Any) -> str:
    """A prompt as one line of text: the text itself, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Sequence) and prompt and isinstance(prompt[-1], dict):
        users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
        return str(users[-1] if users else prompt[-1].get("content", ""))
    return str(prompt)


_INT = re.compile(r"[+-]?\d+")


def _parse_number(text: str) -> Any:
    """`text` as an int or a finite float if it parses as one, else unchanged."""
    stripped = text.strip()
    if _INT.fullmatch(stripped):
        return int(stripped)
    if "_" not in stripped:  # float() accepts "1_000"; a CSV answer with underscores is text
        try:
            value = float(stripped)
        except ValueError:
            return text
        if math.isfinite(value):
            return value
    return text


def _read_jsonl(path: Path) -> list[tuple[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {number}: malformed JSON: {e.msg}") from e
    return rows


def _read_json(path: Path) -> list[tuple[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: line {e.lineno}: malformed JSON: {e.msg}") from e
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
    return [(f"item {index}", row) for index, row in enumerate(data)]


def _read_csv(path: Path, prompt_key: str) -> list[tuple[str, Any]]:
    rows = []
    # utf-8-sig drops the byte-order mark spreadsheet programs put before the header.
    with path.open(encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None:
            return []
        if prompt_key not in reader.fieldnames:
            raise ValueError(f"{path}: no {prompt_key!r} column (columns: {reader.fieldnames})")
        for row in reader:
            where = f"line {reader.line_num}"
            if None in row:
                raise ValueError(f"{path}: {where}: more fields than the header has columns")
            # Short rows get None for the missing columns; drop them so they count as absent.
            rows.append((where, {key: value for key, value in row.items() if value is not None}))
    return rows


#: The fields of ColossalChat's prompt lines, read when a line has no `prompt` (with the default keys).
COLOSSALCHAT_PROMPT_KEY = "messages"
COLOSSALCHAT_ANSWER_KEY = "gt_answer"


def _check_messages(prompt: list[Any], where: str) -> list[Any]:
    if not prompt:
        raise ValueError(f"{where}: empty message list")
    for message in prompt:
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(f"{where}: chat messages need str 'role' and 'content', got {message!r}")
    return prompt


def _make_item(
    row: Any,
    where: str,
    prompt_key: str,
    answer_key: str | None,
    metadata_keys: Sequence[str] | None,
    system_prompt: str | None,
    from_csv: bool,
) -> PromptItem:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
    if not from_csv and prompt_key == "prompt" and answer_key == "answer" and prompt_key not in row \
            and COLOSSALCHAT_PROMPT_KEY in row:
        # ColossalChat's distributed-GRPO lines: {"messages": one message or a list, "gt_answer": ...}.
        prompt_key, answer_key = COLOSSALCHAT_PROMPT_KEY, COLOSSALCHAT_ANSWER_KEY
    prompt = row.get(prompt_key)
    if isinstance(prompt, Mapping):
        prompt = [prompt]
    if prompt is None or (from_csv and prompt == ""):
        raise ValueError(f"{where}: missing prompt field {prompt_key!r}")
    if isinstance(prompt, str):
        if system_prompt is not None:
            prompt = [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        prompt = _check_messages(prompt, where)
        if system_prompt is not None and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}, *prompt]
    else:
        raise ValueError(f"{where}: {prompt_key!r} must be a str or a list of chat messages (or "
                         f"one message), got {type(prompt).__name__}")

    if metadata_keys is None:
        metadata = {key: value for key, value in row.items() if key not in (prompt_key, answer_key)}
    else:
        missing = [key for key in metadata_keys if key not in row]
        if missing:
            raise ValueError(f"{where}: missing metadata field(s) {missing}")
        metadata = {key: row[key] for key in metadata_keys}
    if answer_key is not None and answer_key in row:
        answer = row[answer_key]
        metadata["answer"] = _parse_number(answer) if from_csv and isinstance(answer, str) else answer
    return PromptItem(prompt, metadata)


def load_prompt_file(
    path: str | os.PathLike[str],
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    metadata_keys: Sequence[str] | None = None,
    system_prompt: str | None = None,
) -> list[PromptItem]:
    """Load prompts from a `.jsonl`, `.json` (list of objects) or `.csv` (with a header row) file.

    `prompt_key` holds a str or (JSON/JSONL only) a `{"role", "content"}` message or a list of them; with
    `system_prompt`, a str prompt becomes a system + user message pair and a message list without a
    leading system message gets one. Metadata (the reward function's keyword arguments) holds the
    `answer_key` value under `"answer"` when the row has it, plus the `metadata_keys` fields, or by
    default every other field. CSV values stay strings, except that a CSV answer which parses as an int
    or a finite float becomes that number, so numeric rewards can compare it. With the default keys,
    a JSON/JSONL row without `prompt` but with `messages` is read in ColossalChat's format: the prompt
    from `messages`, the answer from `gt_answer` (the other fields are metadata as usual).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _read_jsonl(path)
    elif suffix == ".json":
        rows = _read_json(path)
    elif suffix == ".csv":
        rows = _read_csv(path, prompt_key)
    else:
        raise ValueError(f"{path}: unknown prompt file extension {path.suffix!r} (use .jsonl, .json or .csv)")
    if not rows:
        raise ValueError(f"{path}: no prompts in file")
    return [
        _make_item(row, f"{path}: {where}", prompt_key, answer_key, metadata_keys, system_prompt,
                   suffix == ".csv")
        for where, row in rows
    ]


class PromptBatch(list[PromptItem]):
    """A `next_batch` answer that carries its own sampling: the maker samples this batch with `sampling`
    instead of its own (e.g. a response length fit to these prompts' width); None: the maker's."""

    def __init__(self, items: Iterable[PromptItem] = (), sampling: SamplingConfig | None = None) -> None:
        super().__init__(items)
        self.sampling = sampling


@runtime_checkable
class PromptSource(Protocol):
    """Where a maker gets its prompts."""

    def next_batch(self, count: int) -> list[PromptItem]:
        """The next `count` prompts; a `PromptBatch` may say how to sample them."""
        ...


class CyclingPrompts:
    """Cycles over a fixed list of prompts in epochs, reshuffled each epoch with a seeded RNG."""

    def __init__(self, items: Sequence[Any], shuffle: bool = True, seed: int = 0) -> None:
        if len(items) == 0:
            raise ValueError("CyclingPrompts: no prompts")
        self.items = [as_prompt_item(item) for item in items]
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.cursor = 0
        self._order = self._epoch_order()

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], shuffle: bool = True, seed: int = 0, **load_kwargs: Any
    ) -> CyclingPrompts:
        """Cycle over the prompts of a file; `load_kwargs` go to `load_prompt_file`."""
        return cls(load_prompt_file(path, **load_kwargs), shuffle=shuffle, seed=seed)

    def __len__(self) -> int:
        return len(self.items)

    def _epoch_order(self) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next_batch(self, count: int) -> list[PromptItem]:
        """The next `count` prompts, continuing into the next epoch when this one runs out."""
        batch = []
        while len(batch) < count:
            if self.cursor == len(self._order):
                self.epoch += 1
                self.cursor = 0
                self._order = self._epoch_order()
            batch.append(self.items[self._order[self.cursor]])
            self.cursor += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        """Position in the stream, for exact resume (the order is a function of seed and epoch)."""
        return {"epoch": self.epoch, "cursor": self.cursor, "size": len(self.items)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Restore a position saved by `state_dict`; refuses one saved for a different dataset size."""
        missing = [key for key in ("epoch", "cursor", "size") if key not in state]
        if missing:
            raise ValueError(f"CyclingPrompts state lacks field(s) {missing}")
        epoch, cursor, size = int(state["epoch"]), int(state["cursor"]), int(state["size"])
        if size != len(self.items):
            raise ValueError(f"CyclingPrompts state field 'size' is {size}, but this source has "
                             f"{len(self.items)}")
        if epoch < 0:
            raise ValueError(f"CyclingPrompts state field 'epoch' is {epoch}, must be >= 0")
        # cursor == size is a finished epoch; the next batch starts the following one.
        if not 0 <= cursor <= size:
            raise ValueError(f"CyclingPrompts state field 'cursor' is {cursor}, must be in [0, {size}]")
        self.epoch, self.cursor = epoch, cursor
        self._order = self._epoch_order()
