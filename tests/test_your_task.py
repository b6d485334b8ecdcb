"""docs/your-task.md run verbatim from a temporary directory and a plain shell; bad data and bad rewards stop
the command before Ray starts, with one line naming the file and column."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CLUSTER_MARKER, ROOT, new_cluster_marker
from tests.test_run_sockets import plain_environment, stop_tree

DOC = ROOT / "docs" / "your-task.md"
BLOCK = re.compile(r"```(\w+)( [\w.]+)?\n(.*?)```", re.DOTALL)


def example() -> tuple[dict[str, str], str]:
    """The doc's example: its files (blocks whose info string names one) and its command (the first bash
    block)."""
    files, command = {}, None
    for language, name, text in BLOCK.findall(DOC.read_text()):
        if name.strip():
            files[name.strip()] = text
        elif language == "bash" and command is None:
            command = text
    assert set(files) == {"my_rewards.py", "questions.jsonl"} and command, (files.keys(), command)
    return files, command


def user_shell(home: Path) -> dict[str, str]:
    """A plain shell whose PATH finds the installed `detached-rl` (as an activated virtualenv does)."""
    env = plain_environment(home)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


def shell(command: str, cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    process = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_tree(process, {})
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


@pytest.mark.ray
def test_the_docs_example_runs_verbatim_in_an_empty_directory(tmp_path):
    files, command = example()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {**user_shell(tmp_path), CLUSTER_MARKER: new_cluster_marker()}
    done = shell(command, tmp_path, env, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    run = next((tmp_path / "runs").iterdir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "reward/score_mean" in row]
    assert len(steps) == 2, rows  # the user's reward graded every trained sample, logged under its label
    graded = json.loads((run / "eval.json").read_text())
    assert graded and all("reward:score" in row for row in graded["after"]), graded


# The issue 47 bar's command end to end (make test-e2e); its code paths are tested above in make test.
@pytest.mark.ray
@pytest.mark.e2e
def test_a_reward_named_by_absolute_file_path_runs_the_tiny_job(tmp_path):
    """The issue 47 bar: `task.reward=/abs/path/rewards.py:fn`, the file in a directory on no path, the
    command typed in another one."""
    files, _ = example()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_rewards.py").write_text(files["my_rewards.py"])
    work = tmp_path / "work"
    work.mkdir()
    (work / "questions.jsonl").write_text(files["questions.jsonl"])
    command = (f"detached-rl run --model tiny --steps 2 --set task.dataset=questions.jsonl "
               f"--set task.reward={tmp_path / 'lib' / 'my_rewards.py'}:score")
    done = shell(command, work, {**user_shell(work), CLUSTER_MARKER: new_cluster_marker()}, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    run = next((work / "runs").iterdir())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([row for row in rows if "reward/score_mean" in row]) == 2, rows


BAD = [
    ({"questions.jsonl": None}, "task.dataset=missing.jsonl", r"missing\.jsonl: no such file"),
    ({"questions.jsonl": '{"question": "What is 1 + 1?", "answer": 2}\n'}, "task.dataset=questions.jsonl",
     r"questions\.jsonl: no column 'prompt' \(task\.columns\.prompt\)"),
    ({"questions.jsonl": ""}, "task.dataset=questions.jsonl", r"questions\.jsonl: .*no rows"),
    ({"questions.jsonl": '{"prompt": "What is 1 + 1?", "answer": 2}\n{"prompt": \n'},
     "task.dataset=questions.jsonl", r"questions\.jsonl: line 2: malformed JSON"),
]


@pytest.mark.parametrize(("files", "setting", "message"), BAD)
def test_bad_data_exits_2_before_ray_with_one_line_naming_the_file(tmp_path, files, setting, message):
    example_files, _ = example()
    (tmp_path / "my_rewards.py").write_text(example_files["my_rewards.py"])
    for name, text in files.items():
        if text is not None:
            (tmp_path / name).write_text(text)
    done = shell(f"detached-rl run --model tiny --set {setting} --set task.reward=my_rewards:score",
                 tmp_path, user_shell(tmp_path), timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), done.stderr


@pytest.mark.parametrize(("reward", "message"), [
    ("no_such_module:score", "task.reward: cannot import module 'no_such_module'"),
    ("my_rewards:grade", "task.reward: module 'my_rewards' has no 'grade'"),
])
def test_a_reward_that_cannot_be_imported_exits_2_before_ray(tmp_path, reward, message):
    files, _ = example()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    command = f"detached-rl run --model tiny --set task.dataset=questions.jsonl --set task.reward={reward}"
    done = shell(command, tmp_path, user_shell(tmp_path), timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"detached-rl: error: {message}"), done.stderr
