"""`detached-rl ppo-on-ray`: flags map onto groups and steps; the launcher runs end to end on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from detached_rl.cli.main import build_parser
from detached_rl.cli.ppo_on_ray import cpu_slots, launcher_config, training_steps
from tests.conftest import ROOT
from tests.helpers import gpu_overrides, set_flags

FLAGS = ("prompt_csv", "model", "pretrain", "strategy", "save_path", "num_episodes", "max_timesteps",
         "update_timesteps", "experience_batch_size", "num_actor_nodes", "num_critic_nodes", "num_initial_nodes",
         "num_reward_nodes", "num_gpus_per_node")


@pytest.fixture
def prompt_csv(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("prompt,answer\n" + "".join(f"What is {a} + {b}?,{a + b}\n" for a in range(2, 5)
                                                for b in range(1, 4)))
    return path


def parse(*argv):
    return build_parser().parse_args(["ppo-on-ray", *argv])


def test_help_documents_every_flag_of_the_ancestor():
    help_text = build_parser()._subparsers._group_actions[0].choices["ppo-on-ray"].format_help()
    for flag in FLAGS:
        match = re.search(rf"--{flag} \S+(, --\S+ \S+)?\s+(\S.*)", help_text)
        assert match, f"--{flag} is not documented"


def test_flags_map_onto_the_groups_the_batch_and_the_steps(prompt_csv):
    args = parse("--prompt_csv", str(prompt_csv), "--model", "opt", "--num_episodes", "3", "--max_timesteps", "4",
                 "--update_timesteps", "2", "--experience_batch_size", "5", "--num_actor_nodes", "2", "--strategy",
                 "ddp", "--num_critic_nodes", "3", "--num_initial_nodes", "2", "--num_reward_nodes", "1",
                 "--num_makers", "2", "--name", "exp")
    config = launcher_config(args)
    assert training_steps(args) == 6 and config.trainer.train_batch_size == 10
    assert config.model.policy == "tiny-opt" and config.task.reward == "numeric_answer"
    assert (config.trainer_group.world_size, config.trainer_group.strategy) == (2, "ddp")
    assert config.maker.scorers == {"reward": "exp-reward", "reference": "exp-initial", "critic": "exp-critic"}
    assert [getattr(config.scorers, r).num_workers for r in ("critic", "reference", "reward")] == [3, 2, 1]
    assert cpu_slots(config, 2) == 2 + 3 + 2 + 1 + 2
    assert len(config.prompts(1, 2).items) == 4  # the second maker's half of the 9 prompts


def test_gpus_make_one_worker_per_gpu_and_no_answers_means_a_reward_model(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("prompt\nSay hello.\nTell a joke.\n")
    config = launcher_config(parse("--prompt_csv", str(path), "--num_gpus_per_node", "2", "--num_actor_nodes", "2",
                                   "--strategy", "ddp", "--num_critic_nodes", "2"))
    assert config.trainer_group.world_size == 4 and config.trainer_group.num_gpus_per_rank == 1
    assert config.scorers.critic.num_workers == 4 and config.scorers.critic.bundle() == {"CPU": 1.0, "GPU": 1}
    assert config.model.reward_model == config.model.policy == "tiny-llama"


def test_gpus_per_node_give_a_naive_trainer_and_every_maker_a_gpu(prompt_csv):
    config = launcher_config(parse("--prompt_csv", str(prompt_csv), "--num_gpus_per_node", "2", "--num_makers", "2"))
    assert (config.trainer_group.strategy, config.trainer_group.world_size) == ("naive", 1)
    assert config.trainer_group.num_gpus_per_rank == 1 and config.maker.num_gpus == 1
    cpu = launcher_config(parse("--prompt_csv", str(prompt_csv)))
    assert cpu.trainer_group.num_gpus_per_rank == 0 and cpu.maker.num_gpus == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--update_timesteps", "9"], "--update_timesteps 9 is more than the run's 4"),
    (["--num_critic_nodes", "0"], "--num_critic_nodes must be >= 1"),
    (["--num_actor_nodes", "2"], "trainer_group.world_size: must be 1 with strategy 'naive'"),
    (["--reward", "nonsense"], "task.reward"),
])
def test_bad_flags_are_refused_naming_the_flag(prompt_csv, argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        launcher_config(parse("--prompt_csv", str(prompt_csv), *argv))


def test_a_missing_prompt_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="--prompt_csv: no file"):
        launcher_config(parse("--prompt_csv", str(tmp_path / "nope.csv")))


@pytest.mark.ray
def test_the_launcher_runs_end_to_end_on_cpu_and_saves_a_loadable_policy(prompt_csv, tmp_path):
    from transformers import AutoModelForCausalLM

    save = tmp_path / "actor"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "detached_rl.cli.main", "ppo-on-ray", "--prompt_csv", str(prompt_csv),
               "--model", "gpt2", "--save_path", str(save), "--num_episodes", "2", "--max_timesteps", "2",
               "--update_timesteps", "2", "--experience_batch_size", "3", "--num_critic_nodes", "2",
               "--num_makers", "2", "--namespace", "ppo_on_ray_test", "--max_new_tokens", "8",
               *set_flags(gpu_overrides())]  # with --device cuda the trainer and makers share the GPU
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert "ppo-critic_0, ppo-critic_1" in done.stdout and "ppo-maker-0, ppo-maker-1" in done.stdout
    assert "done: 2 steps, policy v2" in done.stdout
    model = AutoModelForCausalLM.from_pretrained(save / "merged")
    assert model.config.model_type == "gpt2"
