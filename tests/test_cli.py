"""The console script: --version, --help and the end-to-end check on a tiny model."""

import subprocess
import sys

import pytest

import detached_rl
from detached_rl.cli.check import run_check
from detached_rl.cli.main import main

from .helpers import lane_device


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "detached_rl.cli.main", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == f"detached-rl {detached_rl.__version__}"
    out = subprocess.run([sys.executable, "-m", "detached_rl.cli.main", "check", "--help"], capture_output=True, text=True,
                         check=True)
    assert "--model" in out.stdout


def test_check_on_a_tiny_model(capsys):
    # The command as users run it: on the first accelerator when there is one, whatever --device says.
    assert main(["check", "--model", "tiny", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "log_prob_recompute_max_abs_diff" in out and "result: OK" in out


def test_check_report_figures():
    report = run_check(model="tiny-gpt2", num_prompts=2, group_size=2, max_new_tokens=6, device=lane_device())
    assert report.ok, report.failures
    assert report.figures["responses"] == 4 and report.figures["log_prob_recompute_max_abs_diff"] < 1e-4
    assert 0 < report.figures["trainable_parameters"] < report.figures["parameters"]


def test_every_command_has_help_and_a_scorers_command_without_groups_is_refused(capsys):
    from detached_rl.cli.main import build_parser, main

    commands = build_parser()._subparsers._group_actions[0].choices
    assert {"run", "ppo-on-ray", "check", "trainer", "maker", "scorers", "status", "inspect", "export",
            "stop"} <= set(commands)
    for name, parser in commands.items():
        assert parser.description, f"{name} has no description"
    assert main(["scorers", "--address", "127.0.0.1:1"]) == 2
    assert "no scorer groups configured: set maker.reward_scorer" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--steps", "-5"], "argument --steps: must be >= 1, got -5"),
        (["run", "--makers", "0"], "argument --makers: must be >= 1"),
        (["trainer", "--name", "t", "--update-steps", "0"], "argument --update-steps: must be >= 1"),
        (["trainer", "--name", "t", "--checkpoint-every", "-1"], "argument --checkpoint-every: must be >= 0"),
        (["trainer", "--name", "t", "--num-gpus-per-rank", "inf"], "argument --num-gpus-per-rank: expected a finite"),
        (["maker", "--name", "m", "--trainers", "t", "--batches", "0"], "argument --batches: must be >= 1"),
        (["inspect", "t", "--last", "-1"], "argument --last: must be >= 0"),
        (["inspect", "t", "--min-reward", "nan"], "argument --min-reward: expected a finite number"),
        (["stop", "--timeout", "0"], "argument --timeout: must be > 0"),
        (["ppo-on-ray", "--prompt_csv", "p.csv", "--num_episodes", "0"], "argument --num_episodes"),
        (["run", "--steps", "x"], "argument --steps: expected an integer, got 'x'"),
    ],
)
def test_bad_numbers_are_refused_while_parsing_in_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_non_finite_config_values_are_refused_naming_the_key():
    from detached_rl.config import ConfigError, load_config

    for text in ("trainer.batch_timeout_s=inf", "trainer.weight_push_timeout_s=nan", "sampling.temperature=-inf"):
        with pytest.raises(ConfigError, match=text.split("=")[0] + ": expected a finite number"):
            load_config(None, [text])


def test_run_refuses_an_unknown_model_before_starting_anything(capsys, tmp_path):
    assert main(["run", "--model", "no-such-model", "--output", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("detached-rl: error: model.policy: 'no-such-model' is neither") and "\n" not in line
    assert main(["run", "--model", str(tmp_path), "--output", str(tmp_path)]) == 2
    assert "without config.json" in capsys.readouterr().err
    assert not list(tmp_path.glob("*/"))  # no run directory was made


def test_status_shows_makers_behind_and_the_version_a_maker_swaps_in_next():
    from detached_rl.cli.jobs import format_status

    table = format_status([
        {"name": "t", "role": "trainer", "state": "training", "policy_version": 9, "steps": 9, "buffer_size": 3,
         "buffer_max_samples": 64, "makers_behind": {"m1": 5}},
        {"name": "m1", "role": "maker", "state": "running", "policy_version": 4, "batches": 7,
         "weight_updates": {"pending_version": 9}},
    ]).splitlines()
    assert "9 (behind: m1 by 5)" in table[1] and "4 (v9 next)" in table[2]
