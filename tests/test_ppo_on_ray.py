"""`detached-rl ppo-on-ray`: flags map onto groups and steps; the launcher runs end to end on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from detached_rl.cli.main import build_parser
from detached_rl.cli.ppo_on_ray import (
    OPTIMIZER_FILE,
    checkpoint_dir_of,
    cpu_slots,
    launch_requests_of,
    launcher_config,
    prompt_path,
    save_optimizer_states,
    save_policy,
    training_steps,
)
from tests.conftest import ROOT
from tests.helpers import MAKER_GPU_SHARE, group_gpus_per_rank, lane_device, set_flags, tiny_lm

# train_prompts_on_ray.py's flags (--prompt_csv is ours, --prompt_csv_url the ancestor's name of it).
FLAGS = ("prompt_csv", "prompt_csv_url", "model", "pretrain", "strategy", "save_path", "need_optim_ckpt",
         "num_episodes", "max_timesteps", "update_timesteps", "train_batch_size", "experience_batch_size",
         "num_actor_nodes", "num_critic_nodes", "num_initial_nodes", "num_reward_nodes", "num_gpus_per_node")


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
        match = re.search(rf"--{flag}( \S+)?(, --\S+ \S+)*\s+(\S.*)", help_text)
        assert match, f"--{flag} is not documented"


def test_flags_map_onto_the_groups_the_batch_and_the_steps(prompt_csv):
    args = parse("--prompt_csv", str(prompt_csv), "--model", "opt", "--num_episodes", "3", "--max_timesteps",
                 "4",
                 "--update_timesteps", "2", "--experience_batch_size", "5", "--num_actor_nodes", "2",
                 "--strategy",
                 "ddp", "--num_critic_nodes", "3", "--num_initial_nodes", "2", "--num_reward_nodes", "1",
                 "--num_makers", "2", "--name", "exp")
    config = launcher_config(args)
    assert training_steps(args) == 6 and config.trainer.train_batch_size == 10
    assert config.model.policy == "tiny-opt" and config.task.reward == "numeric_answer"
    assert (config.trainer_group.world_size, config.trainer_group.strategy) == (2, "ddp")
    assert config.maker.scorers == {"reward": "exp-reward", "reference": "exp-initial",
                                    "critic": "exp-critic"}
    assert [getattr(config.scorers, r).num_workers for r in ("critic", "reference", "reward")] == [3, 2, 1]
    assert cpu_slots(config, 2) == 2 + 3 + 2 + 1 + 2
    assert len(config.prompts(1, 2).items) == 4  # the second maker's half of the 9 prompts


def test_gpus_make_one_worker_per_gpu_and_no_answers_means_a_reward_model(tmp_path):
    path = tmp_path / "prompts.csv"
    path.write_text("prompt\nSay hello.\nTell a joke.\n")
    config = launcher_config(parse("--prompt_csv", str(path), "--num_gpus_per_node", "2", "--num_actor_nodes",
                                   "2",
                                   "--strategy", "ddp", "--num_critic_nodes", "2"))
    assert config.trainer_group.world_size == 4 and config.trainer_group.num_gpus_per_rank == 1
    assert config.scorers.critic.num_workers == 4 and config.scorers.critic.bundle() == {"CPU": 1.0, "GPU": 1}
    assert config.model.reward_model == config.model.policy == "tiny-llama"


def test_gpus_per_node_give_a_naive_trainer_and_every_maker_a_gpu(prompt_csv):
    config = launcher_config(parse("--prompt_csv", str(prompt_csv), "--num_gpus_per_node", "2",
                                   "--num_makers", "2"))
    assert (config.trainer_group.strategy, config.trainer_group.world_size) == ("naive", 1)
    assert config.trainer_group.num_gpus_per_rank == 1 and config.maker.num_gpus == 1
    cpu = launcher_config(parse("--prompt_csv", str(prompt_csv)))
    assert cpu.trainer_group.num_gpus_per_rank == 0 and cpu.maker.num_gpus == 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--update_timesteps", "9"], "--update_timesteps 9 is more than the run's 4"),
    (["--num_actor_nodes", "2"], "trainer_group.world_size: must be 1 with strategy 'naive'"),
    (["--reward", "nonsense"], "task.reward"),
])
def test_bad_flags_are_refused_naming_the_flag(prompt_csv, argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        launcher_config(parse("--prompt_csv", str(prompt_csv), *argv))


def test_a_missing_prompt_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="--prompt_csv: no file"):
        launcher_config(parse("--prompt_csv", str(tmp_path / "nope.csv")))


@pytest.fixture(scope="module")
def tiny_gpt2_dir(tmp_path_factory):
    """A local Hugging Face directory of a tiny random GPT-2 (what --pretrain names
    instead of the hub's gpt2)."""
    path = tmp_path_factory.mktemp("pretrain") / "tiny-gpt2"
    model, tokenizer = tiny_lm("gpt2", device="cpu")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_prompt_csv_url_takes_a_path_or_a_file_url(prompt_csv):
    assert prompt_path(prompt_csv.as_uri()) == prompt_csv and prompt_path(str(prompt_csv)) == prompt_csv
    assert prompt_path(f"file://localhost{prompt_csv}") == prompt_csv
    config = launcher_config(parse("--prompt_csv_url", prompt_csv.as_uri()))
    assert config.task.prompt_file == str(prompt_csv.resolve())
    with pytest.raises(ValueError,
                       match="--prompt_csv_url: 'https://x.org/p.csv' is a https URL and nothing is "
                                         "downloaded"):
        prompt_path("https://x.org/p.csv")
    with pytest.raises(ValueError, match="names a file on host 'remote'"):
        prompt_path("file://remote/p.csv")


def test_pretrain_takes_a_local_directory_or_the_packaged_model_and_refuses_a_hub_name(
        prompt_csv, tiny_gpt2_dir):
    assert launcher_config(parse("--prompt_csv", str(prompt_csv), "--pretrain", str(tiny_gpt2_dir))
                           ).model.policy == str(tiny_gpt2_dir)
    assert launcher_config(parse("--prompt_csv", str(prompt_csv), "--pretrain",
                                 "smollm2")).model.policy == "smollm2"
    with pytest.raises(ValueError) as refused:
        launcher_config(parse("--prompt_csv", str(prompt_csv), "--pretrain", "gpt2"))
    message = str(refused.value)
    assert message.startswith("--pretrain: 'gpt2'") and "nothing is downloaded" in message
    assert "\n" not in message


@pytest.mark.parametrize(("argv", "expected"), [([], False), (["--need_optim_ckpt"], True),
                                                (["--need_optim_ckpt", "True"], True),
                                                (["--need_optim_ckpt", "false"], False)])
def test_need_optim_ckpt_is_a_truth_value(prompt_csv, argv, expected):
    assert parse("--prompt_csv", str(prompt_csv), *argv).need_optim_ckpt is expected


def test_need_optim_ckpt_refuses_other_words(prompt_csv):
    with pytest.raises(SystemExit):
        parse("--prompt_csv", str(prompt_csv), "--need_optim_ckpt", "maybe")


def test_train_batch_size_is_the_samples_per_optimizer_step(prompt_csv):
    config = launcher_config(parse("--prompt_csv", str(prompt_csv), "--train_batch_size", "3"))
    assert config.ppo.mini_batch_size == 3 and config.trainer.train_batch_size == 8
    assert launcher_config(parse("--prompt_csv", str(prompt_csv))).ppo.mini_batch_size is None
    with pytest.raises(ValueError,
                       match="--train_batch_size 9 is more than the 8 samples of a training step"):
        launcher_config(parse("--prompt_csv", str(prompt_csv), "--train_batch_size", "9"))


def test_gpus_a_cpu_cluster_lacks_are_refused_naming_the_role(prompt_csv):
    from detached_rl.core.resources import unplaceable

    config = launcher_config(parse("--prompt_csv", str(prompt_csv), "--num_gpus_per_node", "1"))
    reason = unplaceable(launch_requests_of(config, "ppo", ["ppo-maker-0"]), {"CPU": 16.0})
    assert reason == "trainer ppo-trainer asks for 1 GPU; the cluster has 0"


def test_a_pt_save_path_gets_a_state_dict_and_a_directory_gets_from_pretrained_files(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from detached_rl.models import LoraSettings, apply_lora
    from detached_rl.models.export import policy_files

    model, tokenizer = tiny_lm("gpt2", device="cpu")
    files = policy_files(model, tokenizer)
    saved = save_policy(files, tmp_path / "out" / "actor_checkpoint_prompts.pt")
    state = torch.load(saved)
    fresh, _ = tiny_lm("gpt2", seed=1, device="cpu")
    fresh.load_state_dict(state)
    assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
    # --save_path DIR: DIR itself loads with from_pretrained (a LoRA adapter, if any, in DIR/adapter).
    directory = save_policy(files, tmp_path / "actor")
    assert directory == tmp_path / "actor" and not (directory / "merged").exists()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "actor").config.model_type == "gpt2"
    with_adapter = policy_files(apply_lora(model, LoraSettings(r=2, alpha=4)), tokenizer)
    lora = save_policy(with_adapter, tmp_path / "lora")
    assert AutoModelForCausalLM.from_pretrained(lora).config.model_type == "gpt2"
    assert (lora / "adapter" / "adapter_config.json").is_file()


def test_optimizer_states_are_written_beside_the_policy_from_the_trainer_checkpoint(tmp_path):
    import torch

    from detached_rl.core.checkpoint import save_atomic

    save_path = tmp_path / "actor.pt"
    checkpoint = checkpoint_dir_of(save_path)
    assert checkpoint == tmp_path / "actor.pt.trainer_checkpoint"
    for rank in (0, 1):
        save_atomic({"learner": {"actor_optimizer": {"state": {},
                                                     "param_groups": [{"lr": 0.1 * (rank + 1)}]}}},
                    checkpoint / f"rank_{rank}")
    written = save_optimizer_states(checkpoint, save_path)
    assert written == [tmp_path / OPTIMIZER_FILE.format(rank=rank) for rank in (0, 1)]
    assert torch.load(written[1])["param_groups"][0]["lr"] == pytest.approx(0.2)
    with pytest.raises(FileNotFoundError, match="--need_optim_ckpt: no trainer checkpoint"):
        save_optimizer_states(tmp_path / "nowhere", save_path)


def group_overrides() -> list[str]:
    """On the GPU lane: a GPU per trainer rank where there are enough (else gloo on
    the CPU), a share per maker."""
    if lane_device().type != "cuda":
        return []
    return [f"trainer_group.num_gpus_per_rank={group_gpus_per_rank(2)}", f"maker.num_gpus={MAKER_GPU_SHARE}"]


@pytest.mark.ray
def test_the_ancestors_readme_command_line_runs_end_to_end_on_cpu(prompt_csv, tmp_path, tiny_gpt2_dir):
    """train_prompts_on_ray.py's README line, translated only where unavoidable: a tiny local GPT-2 for the
    hub's gpt2 (nothing is downloaded), ddp and no GPUs on a CPU machine for colossalai_zero2 on 4 GPUs a
    node; then our flags for a short run with two makers, the .pt save and the optimizer state."""
    import torch

    save = tmp_path / "actor_checkpoint_prompts.pt"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    readme = ["--prompt_csv_url", prompt_csv.as_uri(), "--model", "gpt2", "--pretrain", str(tiny_gpt2_dir),
              "--strategy", "ddp", "--num_episodes", "10", "--num_actor_nodes", "2"]
    ours = ["--max_timesteps", "1", "--update_timesteps", "5", "--experience_batch_size", "1",
            "--train_batch_size", "2", "--save_path", str(save), "--need_optim_ckpt", "True",
            "--num_makers", "2", "--namespace", "ppo_on_ray_test", "--max_new_tokens", "8",
            *set_flags(group_overrides())]
    command = [sys.executable, "-m", "detached_rl.cli.main", "ppo-on-ray", *readme, *ours]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-4000:]}"
    assert "ppo-trainer_0, ppo-trainer_1 (ddp); 2 training steps of 5 samples" in done.stdout
    assert all(f"ppo-{role}_0" in done.stdout for role in ("critic", "initial", "reward"))
    assert "ppo-maker-0, ppo-maker-1" in done.stdout and "done: 2 steps, policy v2" in done.stdout
    model, _ = tiny_lm("gpt2", seed=1, device="cpu")
    model.load_state_dict(torch.load(save))  # the ancestor's format: the actor's state dict
    for rank in (0, 1):
        optimizer = torch.load(tmp_path / OPTIMIZER_FILE.format(rank=rank))
        assert optimizer["state"] and optimizer["param_groups"]
    assert (checkpoint_dir_of(save) / "rank_1").is_dir()
