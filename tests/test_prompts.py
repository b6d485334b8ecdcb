"""Prompt files (JSONL, CSV, JSON) and the resumable cycling prompt source."""

from __future__ import annotations

import json
import re

import pytest
import torch

from detached_rl.core.prompts import CyclingPrompts, PromptItem, PromptSource, load_prompt_file
from detached_rl.rewards.functions import numeric_answer_reward

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(tmp_path, rows, name="p.jsonl"):
    return write(tmp_path, name, "".join(json.dumps(row) + "\n" for row in rows))


def test_jsonl_answers_chat_messages_and_blank_lines(tmp_path):
    path = write(tmp_path, "p.jsonl", "\n".join([
        json.dumps({"prompt": "What is 1 + 2?", "answer": 3, "source": "math"}),
        "",
        "   ",
        json.dumps({"prompt": MESSAGES, "answer": "4"}),
        json.dumps({"prompt": "Write a haiku."}),
    ]) + "\n")
    items = load_prompt_file(path)
    assert items == [
        PromptItem("What is 1 + 2?", {"answer": 3, "source": "math"}),
        PromptItem(MESSAGES, {"answer": "4"}),  # JSON keeps its own types: no number conversion
        PromptItem("Write a haiku.", {}),
    ]


def test_csv_prompt_column_numeric_answers_and_extra_columns(tmp_path):
    path = write(tmp_path, "p.csv", (
        "\ufeffid,prompt,answer,level\n"  # a spreadsheet's byte-order mark is dropped
        '1,"What is 1 + 2, exactly?",3,easy\n'
        "2,Half of 5?,2.5,hard\n"
        "3,Name a colour,red,easy\n"
        "4,Big?,1e3,\n"
        "5,Odd,nan,\n"
        '6,"Two\nlines",-7,\n'
    ))
    items = load_prompt_file(path)
    assert [item.prompt for item in items] == ["What is 1 + 2, exactly?", "Half of 5?", "Name a colour",
                                               "Big?", "Odd", "Two\nlines"]
    answers = [item.metadata["answer"] for item in items]
    assert answers == [3, 2.5, "red", 1000.0, "nan", -7]
    assert isinstance(answers[0], int) and isinstance(answers[1], float)
    assert items[0].metadata == {"id": "1", "answer": 3, "level": "easy"}  # other columns stay strings
    assert numeric_answer_reward(items[0].prompt, "It is 3.", answer=items[0].metadata["answer"])["correct"]


def test_answer_key_metadata_keys_and_custom_prompt_key(tmp_path):
    path = write(tmp_path, "p.csv", "question,solution,level,id\nWhat is 6 * 7?,42,hard,a\n")
    items = load_prompt_file(path, prompt_key="question", answer_key="solution", metadata_keys=["level"])
    assert items == [PromptItem("What is 6 * 7?", {"level": "hard", "answer": 42})]
    only_answer = load_prompt_file(path, prompt_key="question", answer_key="solution", metadata_keys=[])
    assert only_answer[0].metadata == {"answer": 42}
    no_answer = load_prompt_file(path, prompt_key="question", answer_key=None)
    assert no_answer[0].metadata == {"solution": "42", "level": "hard", "id": "a"}


def test_json_list(tmp_path):
    path = write(tmp_path, "p.json",
                 json.dumps([{"prompt": "a", "answer": 1}, {"prompt": MESSAGES}], indent=2))
    assert load_prompt_file(path) == [PromptItem("a", {"answer": 1}), PromptItem(MESSAGES, {})]


def test_system_prompt_wraps_str_prompts_and_prefixes_message_lists(tmp_path):
    user_only = [{"role": "user", "content": "Hi"}]
    path = jsonl(tmp_path, [{"prompt": "What is 1 + 1?"}, {"prompt": user_only}, {"prompt": MESSAGES}])
    items = load_prompt_file(path, system_prompt="Think step by step.")
    system = {"role": "system", "content": "Think step by step."}
    assert items[0].prompt == [system, {"role": "user", "content": "What is 1 + 1?"}]
    assert items[1].prompt == [system, *user_only]
    assert items[2].prompt == MESSAGES  # an existing system message is kept, not doubled


def test_missing_file_and_unknown_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompt_file(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"p\.txt.*unknown prompt file extension '\.txt'"):
        load_prompt_file(write(tmp_path, "p.txt", "hello\n"))


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("p.jsonl", '{"prompt": "a"}\n\n{"question": "b"}\n',
         r"p\.jsonl: line 3: missing prompt field 'prompt'"),
        ("p.jsonl", '{"prompt": "a"}\n{"prompt": "b",\n', r"p\.jsonl: line 2: malformed JSON"),
        ("p.jsonl", '{"prompt": "a"}\n["b"]\n', r"p\.jsonl: line 2: expected an object, got list"),
        ("p.jsonl", '{"prompt": 5}\n',
         r"p\.jsonl: line 1: 'prompt' must be a str or a list of chat messages"),
        ("p.jsonl", '{"prompt": [{"role": "user"}]}\n', r"p\.jsonl: line 1: chat messages need str 'role'"),
        ("p.jsonl", '{"prompt": []}\n', r"p\.jsonl: line 1: empty message list"),
        ("p.json", '[{"prompt": "a"}, {"answer": 1}]', r"p\.json: item 1: missing prompt field 'prompt'"),
        ("p.json", '[{"prompt": "a"},\n {"prompt": }]', r"p\.json: line 2: malformed JSON"),
        ("p.json", '{"prompt": "a"}', r"p\.json: expected a JSON list of objects, got dict"),
        ("p.csv", "question,answer\nq,1\n", r"p\.csv: no 'prompt' column"),
        ("p.csv", "prompt,answer\na,1\n,2\n", r"p\.csv: line 3: missing prompt field 'prompt'"),
        ("p.csv", "answer,prompt\n1,a\n2\n", r"p\.csv: line 3: missing prompt field 'prompt'"),
        ("p.csv", "prompt,answer\na,1,extra\n", r"p\.csv: line 2: more fields than the header"),
    ],
)
def test_malformed_rows_name_file_line_and_key(tmp_path, name, text, message):
    with pytest.raises(ValueError, match=message):
        load_prompt_file(write(tmp_path, name, text))


def test_missing_metadata_key_names_line(tmp_path):
    path = jsonl(tmp_path, [{"prompt": "a", "level": 1}, {"prompt": "b"}])
    with pytest.raises(ValueError, match=r"p\.jsonl: line 2: missing metadata field\(s\) \['level'\]"):
        load_prompt_file(path, metadata_keys=["level"])


@pytest.mark.parametrize(("name", "text"), [("p.jsonl", ""), ("p.jsonl", "\n  \n"), ("p.csv", ""),
                                            ("p.csv", "prompt,answer\n"), ("p.json", "[]")])
def test_empty_file_names_the_file(tmp_path, name, text):
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name}: no prompts")):
        load_prompt_file(write(tmp_path, name, text))


def numbered(tmp_path, count=7):
    return jsonl(tmp_path, [{"prompt": f"q{i}", "answer": i} for i in range(count)])


def answers(batch):
    return [item.metadata["answer"] for item in batch]


def test_from_file_epochs_shuffle_and_seed(tmp_path):
    path = numbered(tmp_path)
    source = CyclingPrompts.from_file(path, seed=3)
    assert isinstance(source, PromptSource) and len(source) == 7
    epochs = [answers(source.next_batch(7)) for _ in range(4)]
    assert all(sorted(epoch) == list(range(7)) for epoch in epochs)  # every item once per epoch
    assert len({tuple(epoch) for epoch in epochs}) > 1  # reshuffled between epochs
    assert answers(CyclingPrompts.from_file(path, seed=3).next_batch(28)) == sum(epochs, [])
    assert answers(CyclingPrompts.from_file(path, seed=4).next_batch(28)) != sum(epochs, [])
    assert answers(CyclingPrompts.from_file(path, shuffle=False).next_batch(10)) == [*range(7), 0, 1, 2]
    wrapped = CyclingPrompts.from_file(path, seed=3, system_prompt="S")
    assert wrapped.items[0].prompt[0] == {"role": "system", "content": "S"}


@pytest.mark.parametrize("consumed", [0, 3, 7, 9, 14, 20])  # start, mid-epoch, epoch end, later epochs
def test_state_dict_resume_reproduces_later_batches(tmp_path, consumed):
    path = numbered(tmp_path)
    source = CyclingPrompts.from_file(path, seed=11)
    source.next_batch(consumed)
    state = source.state_dict()
    assert state["size"] == 7
    expected = [answers(source.next_batch(size)) for size in (2, 5, 7, 3, 10)]
    resumed = CyclingPrompts.from_file(path, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a round trip through a checkpoint
    assert [answers(resumed.next_batch(size)) for size in (2, 5, 7, 3, 10)] == expected


@pytest.mark.parametrize(
    ("state", "field"),
    [({"epoch": 0, "cursor": 8, "size": 7}, "cursor"), ({"epoch": 0, "cursor": -1, "size": 7}, "cursor"),
     ({"epoch": -1, "cursor": 0, "size": 7}, "epoch"), ({"epoch": 0, "cursor": 2, "size": 6}, "size"),
     ({"epoch": 0, "cursor": 2}, "size")],
)
def test_load_state_dict_refuses_bad_state(tmp_path, state, field):
    source = CyclingPrompts.from_file(numbered(tmp_path), seed=1)
    before = source.state_dict()
    with pytest.raises(ValueError, match=f"'{field}'"):
        source.load_state_dict(state)
    assert source.state_dict() == before


def test_items_encode_with_a_real_chat_template(tmp_path):
    from detached_rl.models import Actor, tiny_causal_lm

    path = jsonl(tmp_path, [{"prompt": "What is 1 + 2?", "answer": 3}, {"prompt": MESSAGES, "answer": 4}])
    actor = Actor(*tiny_causal_lm("llama"))
    for items in (load_prompt_file(path), load_prompt_file(path, system_prompt="Be brief.")):
        ids = actor.encode_prompts([item.prompt for item in items])
        assert len(ids) == 2 and all(t.dtype == torch.long and t.numel() > 0 for t in ids)
    text = actor.tokenizer.decode(actor.encode_prompts([items[0].prompt])[0])
    assert "Be brief." in text and "What is 1 + 2?" in text
