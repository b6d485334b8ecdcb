"""The console script: --version, --help and the end-to-end check on a tiny model."""

import subprocess
import sys

import pytest

import detached_rl
from detached_rl.cli.check import run_check
from detached_rl.cli.main import main

from .helpers import lane_device


def test_version_and_help():
    out = subprocess.run([sys.executable, "-m", "detached_rl.cli", "--version"], capture_output=True,
                         text=True,
                         check=True)
    assert out.stdout.strip() == f"detached-rl {detached_rl.__version__}"
    out = subprocess.run([sys.executable, "-m", "detached_rl.cli.main", "check", "--help"],
                         capture_output=True, text=True,
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


def test_the_defaults_the_help_names_are_the_configs_and_the_actors(monkeypatch):
    """The CLI copies no default: `--help` names `RunConfig()`'s; the maker's attach wait is the actor's."""
    import dataclasses
    import inspect

    from detached_rl.actors.maker import MakerShell
    from detached_rl.cli.main import build_parser
    from detached_rl.config import RunConfig
    from detached_rl.maker.config import ATTACH_TIMEOUT_S

    real = RunConfig()
    shifted = dataclasses.replace(
        real, run=dataclasses.replace(real.run, steps=97, makers=5),
        trainer_group=dataclasses.replace(real.trainer_group, placement_strategy="SPREAD"))
    monkeypatch.setattr("detached_rl.cli.main.RunConfig", lambda: shifted)
    commands = build_parser()._subparsers._group_actions[0].choices
    helps = {(name, action.dest): action.help
             for name, parser in commands.items() for action in parser._actions}
    assert "(default 97)" in helps["run", "steps"] and "(default 5)" in helps["run", "makers"]
    assert "(default SPREAD)" in helps["trainer", "placement"]
    assert f"(default {real.maker.backend})" in helps["maker", "backend"]
    assert inspect.signature(MakerShell).parameters["attach_timeout_s"].default == ATTACH_TIMEOUT_S


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--steps", "-5"], "argument --steps: must be >= 1, got -5"),
        (["run", "--makers", "0"], "argument --makers: must be >= 1"),
        (["trainer", "--name", "t", "--update-steps", "0"], "argument --update-steps: must be >= 1"),
        (["trainer", "--name", "t", "--checkpoint-every", "-1"], "argument --checkpoint-every: must be >= 0"),
        (["trainer", "--name", "t", "--num-gpus-per-rank", "inf"],
         "argument --num-gpus-per-rank: expected a finite"),
        (["maker", "--name", "m", "--trainers", "t", "--batches", "0"], "argument --batches: must be >= 1"),
        (["inspect", "t", "--last", "-1"], "argument --last: must be >= 0"),
        (["inspect", "t", "--min-reward", "nan"], "argument --min-reward: expected a finite number"),
        (["stop", "--timeout", "0"], "argument --timeout: must be > 0"),
        (["ppo-on-ray", "--prompt_csv", "p.csv", "--num_episodes", "0"], "argument --num_episodes"),
        (["run", "--steps", "x"], "argument --steps: expected an integer, got 'x'"),
        (["run", "--steps", "99999999999999999999999"], "argument --steps: must be <= 1000000000"),
        (["trainer", "--name", "t", "--steps", "10000000000"], "argument --steps: must be <= 1000000000"),
        (["check", "--seed", "5000000000"], "argument --seed: must be <= 1000000000"),
        (["ppo-on-ray", "--prompt_csv", "p.csv", "--num_episodes", "1" + "0" * 30],
         "argument --num_episodes/--num-episodes: must be <="),
    ],
)
def test_bad_numbers_are_refused_while_parsing_in_one_line(capsys, nothing_starts, args, message):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_non_finite_config_values_are_refused_naming_the_key():
    from detached_rl.config import ConfigError, load_config

    for text in ("trainer.batch_timeout_s=inf", "trainer.weight_push_timeout_s=nan",
                 "sampling.temperature=-inf"):
        with pytest.raises(ConfigError, match=text.split("=")[0] + ": expected a finite number"):
            load_config(None, [text])


def test_run_refuses_an_unknown_model_before_starting_anything(capsys, tmp_path):
    assert main(["run", "--model", "./no-such-model", "--output", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("detached-rl: error: model.policy: "
                           "'./no-such-model' is neither") and "\n" not in line
    # A name that can be a Hub id is looked up in the Hugging Face cache (the Makefile runs offline).
    assert main(["run", "--model", "no-such-model", "--output", str(tmp_path)]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("detached-rl: error: model.policy: 'no-such-model' is not in the Hugging Face "
                           "cache") and "\n" not in line
    assert main(["run", "--model", str(tmp_path), "--output", str(tmp_path)]) == 2
    assert "without config.json" in capsys.readouterr().err
    assert not list(tmp_path.glob("*/"))  # no run directory was made


def test_status_shows_makers_behind_and_the_version_a_maker_swaps_in_next():
    from detached_rl.cli.jobs import format_status

    table = format_status([
        {"name": "t", "role": "trainer", "state": "training", "policy_version": 9, "steps": 9,
         "buffer_size": 3,
         "buffer_max_samples": 64, "makers_behind": {"m1": 5},
         "provenance": {"quarantined": {"m9": "quarantined at v3: ..."}, "makers": {}}},
        {"name": "m1", "role": "maker", "state": "running", "policy_version": 4, "batches": 7,
         "weight_updates": {"pending_version": 9}, "reward_refused": {"timeout": 8, "non_finite": 4}},
    ]).splitlines()
    assert "9 (behind: m1 by 5) (quarantined: m9)" in table[1] and "4 (v9 next)" in table[2]
    assert "7 (reward refused: 4 non_finite, 8 timeout)" in table[2]


@pytest.fixture
def nothing_starts(monkeypatch) -> list[str]:
    """Make starting a run, joining a cluster or starting an embedded Ray record it
    and fail; returns the record."""
    from detached_rl.cli import jobs, run

    started: list[str] = []

    def refuse(what: str):
        def record(*args, **kwargs):
            started.append(what)
            raise RuntimeError(f"{what} was called")

        return record

    monkeypatch.setattr(run, "run_job", refuse("run_job"))
    monkeypatch.setattr(jobs, "connect", refuse("connect"))
    monkeypatch.setattr(jobs, "init_local_ray", refuse("init_local_ray"))
    return started


def one_error_line(capsys) -> str:
    """The only line on stderr (asserted), which is the command's error."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--set", "run.steps=99999999999999999999999"], "run.steps: must be <= 1000000000"),
        (["run", "--set", "model.lora.r=-1"], "model.lora.r: must be an int >= 1, got -1"),  # LoraSettings
        (["run", "--set", "maker.seed=-5"], "maker.seed: must be >= 0, got -5"),
        (["run", "--set", "trainer.buffer_max_bytes=1152921504606846976"],
         "trainer.buffer_max_bytes: must be <="),
        (["trainer", "--name", "t", "--set", "trainer.metrics_history=-1"],
         "trainer.metrics_history: must be >= 0"),
        (["trainer", "--name", "t", "--set", "trainer.max_reuse=0"], "trainer.max_reuse: must be >= 1"),
        (["maker", "--name", "m", "--trainers", "t", "--set", "grpo.actor_optimizer.total_steps=-3"],
         "grpo.actor_optimizer.total_steps: must be >= 1"),
    ],
)
def test_out_of_range_config_integers_are_refused_before_anything_starts(capsys, tmp_path, nothing_starts,
                                                                         args,
                                                                         message):
    assert main([*args, *(["--output", str(tmp_path / "runs")] if args[0] == "run" else [])]) == 2
    line = one_error_line(capsys)
    assert line.startswith("detached-rl: error: ") and message in line, line
    assert nothing_starts == [] and not (tmp_path / "runs").exists()


def test_restarting_for_ever_is_a_valid_config_integer():
    from detached_rl.cli.arguments import check_config_integers
    from detached_rl.config import load_config

    check_config_integers(load_config(None, ["maker.max_restarts=-1", "trainer.buffer_max_bytes=8589934592"]))


@pytest.mark.parametrize("command",
                         [["run"], ["trainer", "--name", "t"], ["maker", "--name", "m", "--trainers", "t"]])
def test_an_unknown_tiny_model_is_refused_before_anything_starts(capsys, tmp_path, nothing_starts, command):
    extra = ["--model", "tiny-bogus", "--output", str(tmp_path / "runs")] if command == ["run"] else [
        "--set", "model.policy=tiny-bogus"]
    assert main([*command, *extra]) == 2
    line = one_error_line(capsys)
    assert line == ("detached-rl: error: model.policy: 'tiny-bogus': 'bogus' is not a causal-LM "
                    "model_type of transformers (e.g. tiny-llama, tiny-qwen2, tiny-gpt2)"), line
    assert nothing_starts == [] and not (tmp_path / "runs").exists()


def test_check_and_ppo_on_ray_refuse_an_unknown_tiny_model_at_once(capsys, tmp_path, nothing_starts):
    assert main(["check", "--model", "tiny-t5"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == (
        "detached-rl: error: --model: 'tiny-t5': 't5' is not a causal-LM model_type of transformers "
        "(e.g. tiny-llama, tiny-qwen2, tiny-gpt2)")
    prompts = tmp_path / "p.csv"
    prompts.write_text("prompt,answer\n1+1?,2\n")
    assert main(["ppo-on-ray", "--prompt_csv", str(prompts), "--model", "bogus"]) == 2
    assert "--model: 'tiny-bogus': 'bogus' is not a causal-LM model_type" in one_error_line(capsys)
    assert nothing_starts == []


def test_resume_from_must_hold_a_checkpoint_of_every_rank(capsys, tmp_path, nothing_starts):
    from detached_rl.cli.command_config import checkpoint_problem

    missing = tmp_path / "missing"
    assert checkpoint_problem(str(missing), [0]) == "no such directory"
    assert checkpoint_problem(str(tmp_path), [0]).startswith("not a checkpoint of this trainer (no rank_0 "
                                                              "checkpoint")
    rank_0 = tmp_path / "rank_0"
    rank_0.mkdir()
    (rank_0 / "state.json").write_text("{}")
    (rank_0 / "tensors.safetensors").write_bytes(b"")
    assert "(no rank_1 checkpoint in it" in checkpoint_problem(str(tmp_path), [0, 1])
    assert checkpoint_problem(str(tmp_path), [0]) is None
    # The trainer reads the path on its own host, which may be another: checked there once it is placed
    # (tests/test_multihost_jobs.py), not on this one.
    assert main(["trainer", "--name", "t", "--resume-from", str(missing)]) == 2
    assert nothing_starts == ["connect"]


def test_a_config_that_is_a_directory_or_binary_is_refused_naming_it(capsys, tmp_path, nothing_starts):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(128, 256)))
    for command in (["run", "--output", str(tmp_path / "runs")], ["trainer", "--name", "t"], ["scorers"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--config", str(tmp_path)])
        assert exit_info.value.code == 2
        assert f"argument --config: config file {str(tmp_path)!r} is a directory, not a YAML file" in \
            one_error_line(capsys)
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--config", str(binary)])
        assert exit_info.value.code == 2
        expected = f"argument --config: config file {str(binary)!r} is not UTF-8 text (byte 0x80 at offset 0)"
        assert expected in one_error_line(capsys)
    assert nothing_starts == [] and not (tmp_path / "runs").exists()


def test_maker_without_trainer_names_is_refused_before_joining(capsys, nothing_starts):
    assert main(["maker", "--name", "m", "--trainers", " , "]) == 2
    assert one_error_line(capsys) == ("detached-rl: error: --trainers ' , ': no trainer names "
                                      "(comma-separated, e.g. trainer_0,trainer_1)")
    assert nothing_starts == []


def test_an_actor_that_failed_to_start_is_reported_with_its_constructor_error():
    from detached_rl.cli.run import actor_death_reason

    class CreationFailed(Exception):
        actor_init_failed = True

    error = CreationFailed("The actor died because of an error raised in its creation task, "
                           "\x1b[36mray::M.__init__()\x1b[39m (pid=1)\n  File \"x.py\", line 6, in "
                           "__init__\nValueError: unknown model_type 'x'")
    assert actor_death_reason(error) == "its constructor raised ValueError: unknown model_type 'x'"
    died = "The actor died unexpectedly."
    assert actor_death_reason(RuntimeError(f"{died}\nmore")) == died


def test_cli_and_config_modules_hold_one_job_each_in_at_most_450_lines():
    from pathlib import Path

    import detached_rl

    package = Path(detached_rl.__file__).parent
    sizes = {str(path.relative_to(package)): len(path.read_text().splitlines())
             for folder in ("cli", "config") for path in (package / folder).glob("*.py")}
    assert {name: lines for name, lines in sizes.items() if lines > 450} == {}
    from detached_rl.cli import jobs, run  # the split modules' public names stay where callers import them

    assert {"connect", "init_local_ray", "status_of", "export", "start_trainer", "stop"} <= set(dir(jobs))
    assert {"run_job", "run_config", "JobRunner", "RunError", "run_gpus",
            "DEFAULT_RUN_CONFIG"} <= set(dir(run))
