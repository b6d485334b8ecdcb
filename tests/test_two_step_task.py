"""The second shipped task (examples/tasks/two_step), as a user runs it: its config, data and reward load
from its folder through the public paths only (no Ray)."""

from __future__ import annotations

import json

from detached_rl.config.loading import load_config
from detached_rl.rewards.specs import resolve

from .conftest import ROOT

FOLDER = ROOT / "examples" / "tasks" / "two_step"


def test_the_two_step_task_loads_from_its_folder_and_grades(monkeypatch):
    monkeypatch.chdir(FOLDER)
    monkeypatch.syspath_prepend(str(FOLDER))  # as `detached-rl run` puts the directory it runs in
    config = load_config("task.yaml")
    data = config.task_data()
    assert (len(data.train), len(data.held_out)) == (2048, 256) and len(config.eval_problems()) == 256
    assert data.train[0].prompt[0]["role"] == "system"
    assert set(data.train[0].metadata) == {"answer", "operations"}
    train = {json.dumps(item.prompt) for item in data.train}
    assert not any(json.dumps(item.prompt) in train for item in data.held_out)
    correct, format_ = (resolve(spec) for spec in config.task.reward_specs)
    completions = ["3 + 4 = 7\n7 - 2 = 5\nAnswer: 5", "Answer: 6", "5"]
    assert correct(["q"] * 3, completions, answer=[5, 5, 5], operations=["+-"] * 3) == [1.0, 0.0, 0.0]
    assert format_(["q"] * 3, completions)[0] == 1.0
