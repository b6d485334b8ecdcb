"""ColossalChat compatibility: its prompt lines load, its launch arguments map onto a RunConfig, and a
ColossalChat-format JSONL trains through `launch_distributed` on a local Ray cluster."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from detached_rl.compat.colossalchat import (
    DERIVED_METRICS,
    METRIC_ALIASES,
    OLD_METRIC_NAMES,
    colossalchat_metrics,
    launch_distributed,
    run_config_of,
)
from detached_rl.core.prompts import load_prompt_file
from tests.helpers import tiny_lm

SYSTEM = "Put the answer in <answer> </answer> tags."


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def colossalchat_jsonl(tmp_path):
    """Lines as ColossalChat's README shows them: one message as a dict, or a list of messages."""
    return write_jsonl(tmp_path / "train.jsonl", [
        {"messages": {"role": "user", "content": "What is 2 + 3?"}, "gt_answer": "5"},
        {"messages": [{"role": "user", "content": "What is 4 + 4?"}], "gt_answer": "8"},
        {"messages": {"role": "user", "content": "What is 1 + 6?"}, "gt_answer": "7", "source": "gsm"},
        {"messages": {"role": "user", "content": "What is 3 + 3?"}, "gt_answer": "6"},
    ])


def test_colossalchat_lines_load_with_gt_answer_as_the_answer(colossalchat_jsonl):
    items = load_prompt_file(colossalchat_jsonl)
    assert items[0].prompt == [{"role": "user", "content": "What is 2 + 3?"}]
    assert items[1].prompt == [{"role": "user", "content": "What is 4 + 4?"}]
    assert [item.metadata["answer"] for item in items] == ["5", "8", "7", "6"]
    assert items[2].metadata == {"answer": "7", "source": "gsm"}  # the other fields stay metadata


def test_a_system_prompt_goes_before_a_single_message(colossalchat_jsonl):
    first = load_prompt_file(colossalchat_jsonl, system_prompt=SYSTEM)[0]
    assert first.prompt == [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.parametrize(("row", "message"), [
    ({"messages": {"role": "user"}, "gt_answer": "1"}, "chat messages need str 'role' and 'content'"),
    ({"messages": 5, "gt_answer": "1"}, "'messages' must be a str or a list of chat messages"),
    ({"question": "What is 1 + 1?", "gt_answer": "2"}, "missing prompt field 'prompt'"),
])
def test_malformed_colossalchat_lines_are_named(tmp_path, row, message):
    with pytest.raises(ValueError, match=message):
        load_prompt_file(write_jsonl(tmp_path / "bad.jsonl", [row]))


def test_a_prompt_field_wins_over_messages(tmp_path):
    item = load_prompt_file(write_jsonl(tmp_path / "p.jsonl",
                                        [{"prompt": "Hi", "messages": "x", "answer": 1}]))[0]
    assert (item.prompt, item.metadata) == ("Hi", {"messages": "x", "answer": 1})


def launch_arguments(tmp_path, model_path, jsonl, **changes):
    """Keyword arguments shaped as ColossalChat's rl_example.py builds them, for a tiny run."""
    arguments = dict(
        num_producers=2, num_proc_per_producer=1, num_consumer_procs=1, num_episodes=1,
        inference_batch_size=1,
        inference_microbatch_size=1, train_batch_size=1, train_minibatch_size=1,
        train_dataset_config={"path": str(jsonl), "max_length": 64, "system_prompt": SYSTEM},
        inference_model_config={"path": str(model_path)},
        generate_config={"top_k": 50, "top_p": 1.0, "temperature": 1.0, "max_length": 64 + 8,
                         "do_sample": True,
                         "max_new_tokens": None},
        train_model_config={"path": str(model_path), "use_flash_attention_2": False},
        grpo_config={"algo": "GRPO", "lr": 1e-4, "train_microbatch_size": 4, "beta": 0.01,
                     "loss_variation": "sample_level", "reward_fn_type": "think_answer_tags",
                     "max_length": 72,
                     "max_new_tokens": 8, "response_format_tags": None},
        plugin_config={"tp_size": 1, "pp_size": 1, "microbatch_size": 1, "zero_stage": 0, "max_norm": 1.0},
        inference_backend="transformers", num_generations=2, core_algo="GRPO", project_name="tiny",
        save_interval=1, save_dir=str(tmp_path / "model"), n_behind=1,
    )
    arguments.update(changes)
    return arguments


def config_of(arguments, update_steps=1, use_gpus=False):
    keep = ("num_producers", "num_proc_per_producer", "num_consumer_procs", "inference_batch_size",
            "train_batch_size", "train_minibatch_size", "train_dataset_config", "inference_model_config",
            "generate_config", "train_model_config", "grpo_config", "plugin_config", "inference_backend",
            "num_generations", "core_algo", "n_behind")
    return run_config_of(**{key: arguments[key] for key in keep}, tokenizer_config=None,
                         update_steps=update_steps,
                         save_dir=Path(arguments["save_dir"]), namespace="ns", name="cc", use_gpus=use_gpus)


def test_launch_arguments_map_onto_makers_trainer_group_and_grpo(tmp_path, colossalchat_jsonl):
    arguments = launch_arguments(tmp_path, "tiny-llama", colossalchat_jsonl, num_consumer_procs=2,
                                 train_batch_size=2, train_minibatch_size=1, n_behind=2, core_algo="DAPO",
                                 grpo_config={"algo": "DAPO", "lr": 3e-4, "clip_eps_low": 0.2,
                                              "clip_eps_high": 0.28,
                                              "loss_variation": "token_level", "reward_fn_type": "boxed",
                                              "dynamic_batching": True},
                                 generate_config={"top_k": -1, "top_p": 0.9, "temperature": 0.7,
                                                  "max_tokens": 12},
                                 inference_backend="vllm", num_generations=8)
    config = config_of(arguments, update_steps=3, use_gpus=True)
    assert (config.algorithm, config.grpo.algorithm, config.grpo.loss_agg) == ("grpo", "dapo", "token-mean")
    assert (config.grpo.clip_low, config.grpo.clip_high, config.grpo.dynamic_sampling) == (0.2, 0.28, True)
    assert config.grpo.actor_optimizer.lr == 3e-4 and config.grpo.mini_batch_size == 1 * 8
    assert (config.maker.group_size, config.maker.experience_batch_size,
            config.maker.backend) == (8, 1, "vllm")
    assert config.trainer.train_batch_size == 2 * 8  # train_batch_size prompts x num_generations, per rank
    # n_behind = 2 rounds of 3 steps behind, plus the round's own
    assert config.trainer.max_staleness == 3 * 3 - 1
    assert (config.trainer_group.world_size, config.trainer_group.strategy) == (2, "ddp")
    assert config.trainer_group.num_gpus_per_rank == 1 and config.maker.num_gpus == 1
    assert (config.sampling.top_k, config.sampling.top_p, config.sampling.max_new_tokens) == (0, 0.9, 12)
    assert config.task.reward == "boxed" and config.namespace == "ns"


def test_the_reference_pages_reinforce_plus_plus_is_colossalchats_reinforce_ppb(tmp_path, colossalchat_jsonl):
    for algo in ("REINFORCE++", "REINFORCE_PPB"):
        config = config_of(launch_arguments(tmp_path, "tiny-llama", colossalchat_jsonl,
                                            core_algo="REINFORCE++", grpo_config={"algo": algo}))
        assert config.grpo.algorithm == "reinforce_pp_baseline"
    with pytest.raises(ValueError, match="differs from core_algo"):
        config_of(launch_arguments(tmp_path, "tiny-llama", colossalchat_jsonl, core_algo="REINFORCE++",
                                   grpo_config={"algo": "DAPO"}))


def test_launch_distributed_starts_a_ray_sized_to_its_job(tmp_path, colossalchat_jsonl, monkeypatch):
    """On 2 cores, 2 producers and 2 consumer ranks ask for 4 CPU slots: the Ray it starts has them."""
    import ray

    from detached_rl.cli import jobs
    from detached_rl.cli.ppo_on_ray import cpu_slots

    class Started(Exception):
        """Stands in for the rest of the run."""

    started: dict = {}

    def init_local_ray(namespace: str, **options) -> None:
        started.update(options, namespace=namespace)
        raise Started

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(jobs, "init_local_ray", init_local_ray)
    arguments = launch_arguments(tmp_path, "tiny-llama", colossalchat_jsonl, num_consumer_procs=2)
    with pytest.raises(Started):
        launch_distributed(**arguments, name="sized")
    assert cpu_slots(config_of(arguments), arguments["num_producers"]) == 4
    assert started["num_cpus"] == 4 and started["namespace"] == "sized"


def test_the_system_prompt_reaches_the_makers_prompt_file(tmp_path, colossalchat_jsonl):
    config = config_of(launch_arguments(tmp_path, "tiny-llama", colossalchat_jsonl))
    assert config.trainer.max_staleness == 1 and config.maker.num_gpus == 0
    first = config.prompts().items[0]
    assert first.prompt[0] == {"role": "system", "content": SYSTEM} and "answer" in first.metadata


@pytest.mark.parametrize(("changes", "message"), [
    ({"plugin_config": {"tp_size": 2}}, r"plugin_config\['tp_size'\] = 2: only data parallelism"),
    ({"core_algo": "Simple"}, "core_algo must be one of"),
    ({"grpo_config": {"algo": "GRPO", "nonsense": 1}}, r"grpo_config: unknown key\(s\) \['nonsense'\]"),
    ({"train_model_config": {"path": "Qwen/Qwen2.5-7B"}}, "the model paths differ"),
    ({"inference_model_config": {"path": "Qwen/Qwen2.5-7B"},
      "train_model_config": {"path": "Qwen/Qwen2.5-7B"}},
     "nothing is downloaded"),
    ({"plugin_config": {"zero_stage": 4}}, r"plugin_config\['zero_stage'\] must be 0, 1, 2 or 3"),
])
def test_bad_launch_arguments_are_named(tmp_path, colossalchat_jsonl, changes, message):
    with pytest.raises(ValueError, match=message):
        config_of(launch_arguments(tmp_path, "tiny-llama", colossalchat_jsonl, **changes))


@pytest.mark.parametrize(("changes", "message"), [
    ({"inference_batch_size": 3, "train_batch_size": 4}, r"\(6\) must be a multiple of train_batch_size"),
    ({"inference_batch_size": 4}, "fewer prompts than one round needs"),
    ({"n_behind": -1}, "n_behind must be an int >= 0"),
    ({"eval_dataset_config": {"math": "eval.jsonl"}}, "eval_dataset_config: evaluation"),
])
def test_launch_distributed_refuses_before_touching_ray(tmp_path, colossalchat_jsonl, changes, message):
    with pytest.raises(ValueError, match=message):
        launch_distributed(**launch_arguments(tmp_path, "tiny-llama", colossalchat_jsonl, **changes))


def test_metrics_carry_colossalchat_names():
    row = {"reward/raw_mean": 0.5, "loss/total_avg": 1.5, "lr/actor": 1e-4, "reward/format_mean": 0.25,
           "dynamic_sampling/dropped_fraction": 0.25}
    named = colossalchat_metrics(row, temperature=0.7)
    assert named == {"metrics/reward": 0.5, "train/loss": 1.5, "train/learning_rate": 1e-4,
                     "metrics/format_acc": 0.25, "metrics/format_reward": 0.25,
                     "train/sample_utilization": 0.75,
                     "rollout/temperature": 0.7}


# Every ColossalChat name a GRPO step reports (the learner's batch metrics carry the reward parts too).
REPORTED_NOW = (*METRIC_ALIASES, *OLD_METRIC_NAMES, *DERIVED_METRICS)


@pytest.mark.ray
def test_a_colossalchat_jsonl_trains_through_launch_distributed(ray_cluster, tmp_path, colossalchat_jsonl):
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_lm("llama", device="cpu")
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    arguments = launch_arguments(tmp_path, tmp_path / "tiny", colossalchat_jsonl, train_batch_size=2)
    result = launch_distributed(**arguments, name="cc", timeout=300)

    # 4 prompts, rounds of 2 producers x 1 prompt: 2 rounds of 1 step (train_batch_size 2 x 1 consumer), each
    # step 2 prompts x 2 generations in two optimizer steps (train_minibatch_size 1).
    assert (result["steps"], result["policy_version"]) == (2, 2)
    assert result["saved"] == str(tmp_path / "model" / "modeling-episode-0-step-2")  # it loads itself
    saved = AutoModelForCausalLM.from_pretrained(result["saved"])
    assert saved.config.model_type == "llama"
    assert (tmp_path / "model" / "checkpoint" / "rank_0").is_dir()
    logged = [json.loads(line) for line in (tmp_path / "model" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == len(result["metrics"]) == 2
    for row in logged:
        assert set(REPORTED_NOW) <= set(row), sorted(set(REPORTED_NOW) - set(row))
        assert row["train/loss"] == row["loss/total_avg"] and row["rollout/temperature"] == 1.0
    assert set(OLD_METRIC_NAMES.values()) <= set(METRIC_ALIASES)
    for _ in range(100):  # ray.kill returns before the names are released
        if not ray_cluster.util.list_named_actors():
            break
        time.sleep(0.2)
    assert ray_cluster.util.list_named_actors() == []  # every actor it started is gone
