"""Unit tests of `detached_rl.core.task_data`: reading a user's dataset into train and held-out prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from detached_rl.core.prompts import PromptItem
from detached_rl.core.task_data import DatasetError, TaskData, describe, load_task_data

ROWS = [{"q": f"What is {i} + {i}?", "sol": 2 * i, "level": i % 3, "tags": ["add"]} for i in range(20)]
MAPPING = {"prompt": "q", "answer": "sol"}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def save_dataset_dict(path: Path, splits: dict[str, list[dict[str, Any]]]) -> Path:
    import datasets

    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}) \
        .save_to_disk(str(path))
    return path


def prompts(items: list[PromptItem]) -> list[Any]:
    return [item.prompt for item in items]


def test_import_does_not_load_datasets_or_pyarrow() -> None:
    code = ("import sys, detached_rl.core.task_data; "
            "print(sorted(m for m in ('datasets', 'pyarrow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"


def test_jsonl_with_mapping_keeps_other_columns_and_answer(tmp_path: Path) -> None:
    data = load_task_data(write_jsonl(tmp_path / "q.jsonl", ROWS), MAPPING, held_out=0.25)
    item = (data.train + data.held_out)[0]
    assert isinstance(item.prompt, str) and item.prompt.startswith("What is")
    assert item.metadata.keys() == {"answer", "level", "tags"}  # neither 'q' nor 'sol' under its own name
    assert sorted(i.metadata["answer"] for i in data.train + data.held_out) == sorted(r["sol"] for r in ROWS)


def test_json_list_and_default_mapping_without_answer(tmp_path: Path) -> None:
    path = tmp_path / "q.json"
    path.write_text(json.dumps([{"prompt": f"p{i}", "source": "x"} for i in range(10)]), encoding="utf-8")
    data = load_task_data(path)
    assert len(data.train) == 9 and len(data.held_out) == 1
    assert all(item.metadata == {"source": "x"} for item in data.train + data.held_out)


def test_csv_answers_become_numbers_other_columns_stay_text(tmp_path: Path) -> None:
    path = tmp_path / "q.csv"
    path.write_text("question,solution,level\n" + "".join(f"Q{i},{i}.5,{i}\n" for i in range(10)),
                    encoding="utf-8")
    data = load_task_data(path, {"prompt": "question", "answer": "solution"}, held_out=0.2)
    item = sorted(data.train + data.held_out, key=lambda i: i.prompt)[3]
    assert item.prompt == "Q3" and item.metadata == {"answer": 3.5, "level": "3"}


def test_parquet_values_are_plain_python(tmp_path: Path) -> None:
    rows = [dict(row, score=float(i) / 4, ok=i % 2 == 0) for i, row in enumerate(ROWS)]
    data = load_task_data(write_parquet(tmp_path / "q.parquet", rows), MAPPING, held_out=0.1)
    for item in data.train + data.held_out:
        assert type(item.metadata["answer"]) is int and type(item.metadata["level"]) is int
        assert type(item.metadata["score"]) is float and type(item.metadata["ok"]) is bool
        assert item.metadata["tags"] == ["add"] and type(item.metadata["tags"]) is list


def test_fraction_is_deterministic_disjoint_and_covers_all_rows(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", ROWS)
    first = load_task_data(path, MAPPING, held_out=0.3)
    assert first == load_task_data(path, MAPPING, held_out=0.3)
    train, held = set(prompts(first.train)), set(prompts(first.held_out))
    assert len(held) == 6 and not train & held and train | held == {row["q"] for row in ROWS}
    # Both parts keep the file's order; a different fraction picks a different set.
    assert prompts(first.train) == [row["q"] for row in ROWS if row["q"] in train]
    assert set(prompts(load_task_data(path, MAPPING, held_out=0.05).held_out)) != held


def test_saved_dataset_dict_default_uses_test_split(tmp_path: Path) -> None:
    path = save_dataset_dict(tmp_path / "dd", {"train": ROWS[:15], "test": ROWS[15:]})
    data = load_task_data(path, MAPPING)
    assert prompts(data.train) == [row["q"] for row in ROWS[:15]]
    assert prompts(data.held_out) == [row["q"] for row in ROWS[15:]]
    assert type(data.train[0].metadata["answer"]) is int


def test_saved_plain_dataset_default_holds_out_ten_percent(tmp_path: Path) -> None:
    import datasets

    path = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    data = load_task_data(path, MAPPING)
    assert (len(data.train), len(data.held_out)) == (18, 2)
    assert describe(data) == "18 train, 2 held-out prompts"


def test_held_out_by_split_name_and_train_split(tmp_path: Path) -> None:
    splits = {"main": ROWS[:12], "validation": ROWS[12:16], "test": ROWS[16:]}
    path = save_dataset_dict(tmp_path / "dd", splits)
    data = load_task_data(path, MAPPING, held_out="validation", train_split="main")
    assert prompts(data.train) == [row["q"] for row in ROWS[:12]]
    assert prompts(data.held_out) == [row["q"] for row in ROWS[12:16]]


def test_held_out_by_path(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:15])
    test = write_parquet(tmp_path / "test.parquet", ROWS[15:])
    data = load_task_data(train, MAPPING, held_out=str(test))
    assert len(data.train) == 15 and prompts(data.held_out) == [row["q"] for row in ROWS[15:]]


def test_system_prompt_makes_system_and_user_messages(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "Add 1 and 2."}, {"prompt": "Add 2 and 3."}])
    data = load_task_data(path, held_out=0.5, system_prompt="Solve it.")
    first = next(item for item in data.train + data.held_out if "1 and 2" in item.prompt[1]["content"])
    assert first.prompt == [
        {"role": "system", "content": "Solve it."},
        {"role": "user", "content": "Add 1 and 2."},
    ]


def test_chat_message_prompts_pass_through(tmp_path: Path) -> None:
    rows = [{"msgs": [{"role": "user", "content": f"hi {i}"}]} for i in range(4)]
    data = load_task_data(write_jsonl(tmp_path / "c.jsonl", rows), {"prompt": "msgs"}, held_out=0.25)
    assert sorted(item.prompt[0]["content"] for item in data.train + data.held_out) == [
        f"hi {i}" for i in range(4)]


def _jsonl(rows: list[Any]) -> Callable[[Path], Path]:
    return lambda tmp: write_jsonl(tmp / "q.jsonl", rows)


def _text(name: str, text: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        (tmp / name).write_text(text, encoding="utf-8")
        return tmp / name
    return make


GOOD = [{"q": "a", "sol": 1}, {"q": "b", "sol": 2}, {"q": "c", "sol": 3}]

ERROR_CASES: dict[str, tuple[Callable[[Path], Path], dict[str, Any], list[str]]] = {
    "missing file": (lambda tmp: tmp / "nope.jsonl", {}, ["nope.jsonl", "no such file or directory"]),
    "unknown suffix": (_text("q.txt", "hello"), {}, ["q.txt", "'.txt'", ".parquet", "save_to_disk"]),
    "unknown role": (_jsonl(GOOD), {"columns": {"promt": "q"}}, ["q.jsonl", "'promt'", "task.columns",
                                                                   "'prompt', 'answer'"]),
    "missing prompt column": (_jsonl(GOOD), {"columns": {"prompt": "question"}},
                              ["q.jsonl: no column 'question' (task.columns.prompt); columns: ['q', 'sol']"]),
    "missing answer column": (_jsonl(GOOD), {"columns": {"prompt": "q", "answer": "solution"}},
                              ["q.jsonl: no column 'solution' (task.columns.answer)"]),
    "csv missing prompt column": (_text("q.csv", "a,b\n1,2\n"), {}, ["q.csv: no column 'prompt'",
                                                                       "['a', 'b']"]),
    "malformed jsonl": (_text("q.jsonl", '{"q": "a"}\n{"q": \n'), {"columns": {"prompt": "q"}},
                        ["q.jsonl: line 2: malformed JSON"]),
    "bad parquet": (_text("q.parquet", "not parquet at all"), {}, ["q.parquet: cannot read it as Parquet: "]),
    "not a saved dataset": (lambda tmp: tmp, {}, ["cannot read it as a dataset saved by datasets"]),
    "empty file": (_text("q.jsonl", "\n"), {}, ["q.jsonl: split 'train' has no rows"]),
    "empty prompt": (_jsonl([{"q": "a"}, {"q": "b"}, {"q": "  "}]), {"columns": {"prompt": "q"}},
                     ["q.jsonl: line 3: column 'q' (task.columns.prompt) is empty"]),
    "null prompt": (_jsonl([{"q": "a"}, {"q": None}]), {"columns": {"prompt": "q"}},
                    ["q.jsonl: line 2: column 'q' (task.columns.prompt) is empty"]),
    "prompt not text": (_jsonl([{"q": 7}]), {"columns": {"prompt": "q"}},
                        ["q.jsonl: line 1: column 'q' (task.columns.prompt) is not text (got int)"]),
    "bad chat message": (_jsonl([{"prompt": [{"role": "user"}]}]), {},
                         ["q.jsonl: line 1: chat messages need str 'role' and 'content'"]),
    "fraction out of range": (_jsonl(GOOD), {"held_out": 1.5}, ["q.jsonl", "task.held_out", "1.5"]),
    "fraction empties train": (_jsonl(GOOD[:1]), {"columns": MAPPING},
                               ["q.jsonl", "task.held_out=0.1", "training split empty"]),
    "unknown split name": (_jsonl(GOOD), {"columns": MAPPING, "held_out": "validation"},
                           ["q.jsonl", "'validation'", "splits: ['train']"]),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_errors_are_one_line_and_name_file_and_field(tmp_path: Path, case: str) -> None:
    make, kwargs, expected = ERROR_CASES[case]
    with pytest.raises(DatasetError) as caught:
        load_task_data(make(tmp_path), **kwargs)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(tmp_path))
    for part in expected:
        assert part in message


def test_dataset_dict_split_errors_list_the_splits(tmp_path: Path) -> None:
    path = save_dataset_dict(tmp_path / "dd", {"train": GOOD, "test": GOOD[:1]})
    with pytest.raises(DatasetError, match=r"dd: no split 'main' \(task.train_split\); splits: \['train', "):
        load_task_data(path, MAPPING, train_split="main")
    with pytest.raises(DatasetError, match=r"'dev' is neither a split .* splits: \['train', 'test'\]"):
        load_task_data(path, MAPPING, held_out="dev")
    blank = save_dataset_dict(tmp_path / "blank", {"train": [{"q": "", "sol": 1}]})
    with pytest.raises(DatasetError, match=r"blank: split 'train': row 0: column 'q' \(task.columns.prompt"):
        load_task_data(blank, MAPPING)


def test_empty_held_out_file_is_named(tmp_path: Path) -> None:
    empty = _text("empty.csv", "q,sol\n")(tmp_path)
    with pytest.raises(DatasetError, match=r"empty.csv: split 'train' has no rows .*task.held_out"):
        load_task_data(write_jsonl(tmp_path / "q.jsonl", GOOD), MAPPING, held_out=str(empty))


def test_task_data_is_frozen() -> None:
    data = TaskData([PromptItem("a")], [PromptItem("b")])
    with pytest.raises(AttributeError):
        data.train = []  # type: ignore[misc]


def test_a_shipped_dataset_reads_as_the_original_and_a_split_name_stays_a_split(tmp_path, monkeypatch):
    """`config.shipping`: the actors' config reads the staged copy; a held-out file travels with it, a split
    name of a saved DatasetDict stays a name even where a file of that name lies in the working directory."""
    import datasets

    from detached_rl.config.loading import load_config
    from detached_rl.config.shipping import shipped_config

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"q{i}", "answer": i} for i in range(10)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "held.jsonl").write_text(json.dumps({"prompt": "held", "answer": 1}) + "\n")
    (tmp_path / "test").mkdir()  # a path that is also the DatasetDict's split name below
    sets = ["task.reward=answer_line", "task.dataset=train.jsonl", "task.held_out=held.jsonl"]
    shipped, package = shipped_config(load_config(None, sets))
    assert shipped.task.dataset.startswith("shipped:") and shipped.task.held_out.startswith("shipped:")
    assert [item.prompt for item in shipped.task_data().held_out] == ["held"]
    assert shipped.task_data().train == load_config(None, sets).task_data().train
    assert (package / "train.jsonl").read_text() == (tmp_path / "train.jsonl").read_text()
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:8]),
                          "test": datasets.Dataset.from_list(rows[8:])}).save_to_disk(str(tmp_path / "saved"))
    shipped, _ = shipped_config(load_config(None, ["task.reward=answer_line", "task.dataset=saved",
                                                   "task.held_out=test"]))
    assert shipped.task.held_out == "test"
    assert [item.prompt for item in shipped.task_data().held_out] == ["q8", "q9"]
