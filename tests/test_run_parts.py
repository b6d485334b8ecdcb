"""The pieces of `detached-rl run` that need no Ray: task, reward, config,
recorder, plot, export, evaluation."""

from __future__ import annotations

import json
import re

import pytest
import torch

from detached_rl.cli.held_out import curve_steps, describe
from detached_rl.cli.reporting import (
    MetricsRecorder,
    evaluation_row,
    evaluation_summary,
    plot_metrics,
    plot_series,
    read_metrics,
    side_by_side,
    standard_error,
)
from detached_rl.cli.run import DEFAULT_RUN_CONFIG, run_config, split_evenly
from detached_rl.cli.run_report import progress_line
from detached_rl.config import ConfigError, load_config
from detached_rl.models import LoraSettings, apply_lora, load_causal_lm
from detached_rl.models.export import policy_files, save_adapter, save_merged, write_files
from detached_rl.models.lora import all_linear_targets, lora_state_dict
from detached_rl.rewards.functions import answer_line_format, answer_line_reward, extract_answer_line
from detached_rl.rewards.tasks import make_problems, word_problems
from detached_rl.trainer.core import info_means
from tests.helpers import lane_device, make_experience, model_device

# ------------------------------------------------------------------ task


def _numbers(prompt) -> tuple[int, int]:
    question = prompt if isinstance(prompt, str) else dict(prompt)["user"]
    a, b = (int(x) for x in re.findall(r"\d+", question)[:2])
    return a, b


def test_word_problems_are_deterministic_and_answers_follow_the_operation():
    problems = word_problems(300, seed=7)
    assert problems == word_problems(300, seed=7) and problems != word_problems(300, seed=8)
    for problem in problems:
        a, b = _numbers(problem.prompt)
        assert problem.answer in (a + b, a - b)
        system = dict(problem.prompt)["system"]
        assert "'Answer: <number>'" in system and "Answer: 7" in system  # the instruction and its example
        assert problem.messages[1] == {"role": "user", "content": dict(problem.prompt)["user"]}
        if problem.answer == a - b:
            assert problem.answer > 0  # subtraction keeps a > b


def test_word_problem_splits_share_no_numbers_and_operation():
    def keys(split: str) -> set[tuple[int, int, int]]:
        return {(*_numbers(p.prompt), p.answer) for p in word_problems(400, seed=1, split=split)}

    assert not keys("train") & keys("test")


def test_held_out_problems_are_distinct_and_unknown_tasks_are_refused():
    held_out = make_problems("word_problems", 64, split="test")
    assert len({p.prompt for p in held_out}) == 64
    with pytest.raises(ValueError, match="unknown task 'riddles'"):
        make_problems("riddles", 4)
    with pytest.raises(ValueError, match="split"):
        word_problems(4, split="dev")


# ------------------------------------------------------------------ reward


@pytest.mark.parametrize(("response", "correct", "format_score"), [
    ("7 + 5 = 12\nAnswer: 12", 1.0, 1.0),
    ("She has 7 + 5 = 12 apples.\n\n**Answer: 12.**", 1.0, 1.0),
    ("Answer: 12", 1.0, 0.5),  # right, but no calculation shown
    ("7 + 5 = 12\nAnswer: 12\nThe answer is 12.", 1.0, 0.5),  # the answer line is not the last
    ("7 + 5 = 13\nAnswer: 13", 0.0, 1.0),
    ("7 + 5 = 12", 0.0, 0.0),  # right number, not in the asked format: not graded
    ("Answer: twelve", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_answer_line_reward(response, correct, format_score):
    result = answer_line_reward("q", response, 12)
    assert result["correct"] == correct and result["format"] == format_score
    assert result["reward"] == pytest.approx(correct + 0.2 * format_score)
    assert result["lenient"] == float(response.count("12") > 0 and "13" not in response)


def test_answer_line_takes_the_last_answer_line():
    assert extract_answer_line("Answer: 3\nno, wait\nAnswer: 1,204") == 1204
    assert extract_answer_line("The Answer: is 4") is None
    assert answer_line_format("1 - 1 = 0\nanswer: -0") == 1.0


# ------------------------------------------------------------------ config


def test_run_defaults_load_and_flags_override():
    config = run_config()
    assert config.algorithm == "grpo" and config.model.policy == "smollm2"
    assert config.trainer.weight_sync == "lora" and config.task.name == "word_problems"
    assert config.run.makers == 2 and config.model.lora.target_modules == ("all-linear",)
    config = run_config(steps=3, makers=1, model="tiny", task="addition", name="x1",
                        overrides=["grpo.kl_coef=0"])
    assert (config.run.steps, config.run.makers, config.model.policy) == (3, 1, "tiny")
    assert (config.task.name, config.task.reward, config.run.name, config.grpo.kl_coef) == (
        "addition", "numeric_answer", "x1", 0.0)


def test_run_config_file_is_laid_over_the_defaults(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("run:\n  steps: 7\ngrpo:\n  actor_optimizer:\n    lr: 1.0e-5\n")
    config = run_config(path)
    assert config.run.steps == 7 and config.grpo.actor_optimizer.lr == 1e-5
    assert config.model.policy == "smollm2" and config.run.makers == 2  # the rest stays the packaged default


@pytest.mark.parametrize(("override", "key"), [
    ("run.makers=0", "run.makers"), ("run.name=a/b", "run.name"), ("run.stepz=3", "run.stepz"),
    ("task.eval_size=0", "task.eval_size"),
])
def test_bad_run_settings_name_the_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, [override], base=DEFAULT_RUN_CONFIG)


def test_shards_of_the_training_prompts_are_disjoint():
    config = run_config(overrides=["task.train_size=40"])
    shards = [config.prompts(shard=i, num_shards=2).items for i in range(2)]
    assert len(shards[0]) == len(shards[1]) == 20
    assert not {str(p.prompt) for p in shards[0]} & {str(p.prompt) for p in shards[1]}
    with pytest.raises(ValueError, match="shard"):
        config.prompts(shard=2, num_shards=2)


def test_a_trainer_group_counts_every_rank_in_cpu_slots_and_gpu_shares():
    from detached_rl.cli.run import RunError, run_cpu_slots, run_gpus

    group = run_config(overrides=["trainer_group.world_size=2", "trainer_group.strategy=ddp", "run.makers=2"])
    assert run_cpu_slots(group) == 4  # two ranks and two makers, one CPU each
    assert run_gpus(group, 0) is group
    shared = run_gpus(group, 3)  # a GPU per rank; the two makers share the third
    assert (shared.trainer_group.num_gpus_per_rank, shared.maker.num_gpus) == (1.0, 0.5)
    with pytest.raises(RunError, match="a trainer group of 2 ranks takes one GPU each.*has 2 GPUs"):
        run_gpus(group, 2)
    assert run_gpus(run_config(overrides=["trainer_group.world_size=2", "trainer_group.strategy=ddp",
                                          "run.gpus=manual"]), 2).trainer_group.num_gpus_per_rank == 0


def test_split_evenly():
    assert split_evenly(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split_evenly([1], 3) == [[1]]


# ------------------------------------------------------------------ metrics, plot, evaluation


def test_recorder_writes_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsRecorder(tmp_path) as recorder:
        recorder.record(1, {"reward/mean": 0.5, "maker_versions": {"m0": 1}, "bad": float("nan")})
        recorder.record(2, {"reward/mean": 0.75, "time/weight_sync": 0.01})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0] == {"step": 1, "reward/mean": 0.5, "maker_versions": {"m0": 1}, "bad": None}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]
    assert "maker_versions" not in events.Tags()["scalars"]


@pytest.fixture(scope="module")
def ppo_metrics_row():
    """The metrics of one real PPO step with a reference model (KL in the reward), as the run records them."""
    from detached_rl.models import Actor
    from tests.helpers import tiny_lm
    from tests.test_ppo import make_experiences, make_learner

    learner = make_learner(kl_coef=0.1, kl_kind="k3")  # k3 >= 0
    experiences = make_experiences(learner, reference=Actor(*tiny_lm("llama", seed=5)))
    return {"step": 1, **learner.train_step(experiences, policy_version=0)}


def test_the_progress_line_shows_kl_for_a_ppo_run(ppo_metrics_row):
    status, versions = {"samples_trained": 8}, {"m0": 1, "m1": 1}
    line = progress_line(ppo_metrics_row, status, 2.0, versions)
    assert f"KL {ppo_metrics_row['loss/kl_avg']:.4f}" in line and ppo_metrics_row["loss/kl_avg"] > 0
    assert "4.00 samples/s" in line and "makers m0:v1 m1:v1" in line
    # A row written before the rename (PPO's old "loss/kl") still shows its KL; a row without any says so.
    assert "KL 0.1250" in progress_line({"reward/mean": 0.5, "loss/kl": 0.125}, status, 2.0, versions)
    assert "KL n/a" in progress_line({"reward/mean": 0.5}, status, 2.0, versions)


def test_the_plot_draws_kl_for_a_ppo_run(ppo_metrics_row, tmp_path):
    later = {**ppo_metrics_row, "step": 2}
    series = plot_series([ppo_metrics_row, later])
    assert series["loss/kl_avg"] == [(1, ppo_metrics_row["loss/kl_avg"]), (2, ppo_metrics_row["loss/kl_avg"])]
    assert [step for step, _ in series["reward/mean"]] == [1, 2] and series["eval/accuracy"] == []
    assert plot_series([{"step": 3, "loss/kl": 0.5}])["loss/kl_avg"] == [(3, 0.5)]  # an old row
    assert plot_metrics([ppo_metrics_row, later], tmp_path / "m.png").is_file()


def test_evaluation_summary_and_side_by_side():
    before = [{"prompt": "q1", "response": "x", "correct": 0.0, "format": 0.0, "lenient": 1.0, "reward": 0.0,
               "response_length": 4}]
    after = [{"prompt": "q1", "response": "1 + 1 = 2\nAnswer: 2", "correct": 1.0, "format": 1.0,
              "lenient": 1.0,
              "reward": 1.2, "response_length": 8}]
    assert evaluation_summary(after) == {"accuracy": 1.0, "accuracy_se": 0.0, "reward": 1.2,
                                         "response_length": 8.0, "count": 1.0, "format_rate": 1.0,
                                         "lenient_accuracy": 1.0}
    text = side_by_side(before, after, 1)
    assert "[wrong] x" in text and "[right] 1 + 1 = 2 | Answer: 2" in text


def test_standard_error_and_evaluation_rows():
    """The binomial standard error beside every accuracy, and an evaluation as a metrics.jsonl row that
    training-row readers skip."""
    assert standard_error(0.5, 256) == pytest.approx(0.03125) and standard_error(0.0, 0) == 0.0
    results = [{"correct": float(i % 4 == 0), "reward": 1.0, "response_length": 5, "policy_version": v}
               for i, v in enumerate([7, 7, 8, 8])]
    row = evaluation_row(results, 2.5, "step 7")
    assert row["kind"] == "eval" and row["eval/accuracy"] == 0.25 and row["eval/count"] == 4.0
    assert row["eval/accuracy_se"] == pytest.approx((0.25 * 0.75 / 4) ** 0.5)
    assert (row["eval/policy_version_min"], row["eval/policy_version_max"]) == (7, 8)
    assert describe(row) == "accuracy 25.0% ± 21.7 on 4 problems (policy versions 7-8, 2.5 s)"


def test_read_metrics_keeps_training_and_evaluation_rows_apart(tmp_path):
    with MetricsRecorder(tmp_path, tensorboard=False) as recorder:
        recorder.record(0, evaluation_row([{"correct": 1.0, "policy_version": 0}], 1.0, "before training"))
        recorder.record(1, {"reward/mean": 0.5})
        recorder.record(1, evaluation_row([{"correct": 0.0, "policy_version": 1}], 1.0, "step 1"))
    path = tmp_path / "metrics.jsonl"
    assert [row["step"] for row in read_metrics(path)] == [1]
    assert [row["eval/label"] for row in read_metrics(path, kind="eval")] == ["before training", "step 1"]
    assert len(read_metrics(path, kind=None)) == 3


def test_curve_points_fall_between_before_and_after():
    assert curve_steps(8, 24) == [8, 16] and curve_steps(8, 8) == [] and curve_steps(0, 24) == []
    assert curve_steps(1, 3) == [1, 2]
    assert split_evenly(list(range(5)), 2) == [[0, 1, 2], [3, 4]] and split_evenly([1], 3) == [[1]]


def test_the_plot_shades_one_standard_error_around_held_out_accuracy(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    closed, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda figure=None: (closed.append(figure), close(figure)))
    rows = [{"step": 2, "reward/mean": 0.1},
            {"step": 4, **evaluation_row([{"correct": 1.0}, {"correct": 0.0}], 1.0, "after training")},
            {"step": 0, **evaluation_row([{"correct": 0.0}, {"correct": 0.0}], 1.0, "before training")}]
    plot_metrics(rows, tmp_path / "m.png")
    (accuracy_axis, *_), = [figure.axes for figure in closed]
    (line,) = accuracy_axis.get_lines()
    assert list(line.get_xdata()) == [0, 4] and list(line.get_ydata()) == [0.0, 0.5]
    (band,) = accuracy_axis.collections
    low, high = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert (low, high) == (pytest.approx(0.0), pytest.approx(0.5 + 0.5 / 2 ** 0.5))


def test_info_means_average_what_every_sample_reports():
    experiences = [make_experience(info={"correct": 1.0, "finished": True, "note": "a"}),
                   make_experience(info={"correct": 0.0, "finished": False})]
    assert info_means(experiences) == {"info/correct": 0.5, "info/finished": 0.5}


# ------------------------------------------------------------------ export


@pytest.fixture
def trained_lora_model():
    model, tokenizer = load_causal_lm("tiny", seed=3)
    model = apply_lora(model, LoraSettings(r=4, alpha=8, target_modules=("all-linear",)))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)  # as if trained: B = 0 would merge to the base weights
    return model.to(lane_device()).eval(), tokenizer


def test_all_linear_targets_every_linear_layer_but_the_head(trained_lora_model):
    model, _ = trained_lora_model
    assert all_linear_targets(load_causal_lm("tiny")[0]) == (
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
    assert not any("lm_head" in key for key in lora_state_dict(model))


def test_exported_adapter_and_merged_model_reproduce_the_policy(tmp_path, trained_lora_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, tokenizer = trained_lora_model
    files = policy_files(model, tokenizer)
    assert "adapter/adapter_config.json" in files and "merged/config.json" in files
    write_files(files, tmp_path)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        expected = model(ids.to(model_device(model))).logits.cpu()  # the files load on the CPU
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-4, rtol=1e-4)
        adapted = PeftModel.from_pretrained(load_causal_lm("tiny", seed=3)[0], tmp_path / "adapter").eval()
        torch.testing.assert_close(adapted(ids).logits, expected, atol=1e-4, rtol=1e-4)
    assert json.loads(files["adapter/adapter_config.json"])["r"] == 4


def test_loralib_adapter_and_plain_models_export(tmp_path):
    model, tokenizer = load_causal_lm("tiny", seed=1)
    model.to(lane_device())
    save_merged(model, tokenizer, tmp_path / "plain")  # no adapter: the model as it is
    assert (tmp_path / "plain" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="no LoRA adapter"):
        save_adapter(model, tmp_path / "none")
    lora = apply_lora(model, LoraSettings(backend="loralib", r=2, alpha=4))
    save_adapter(lora, tmp_path / "loralib")
    assert json.loads((tmp_path / "loralib" / "lora_config.json").read_text())["backend"] == "loralib"


def test_write_files_refuses_paths_outside_the_root(tmp_path):
    with pytest.raises(ValueError, match="leaves"):
        write_files({"../escape.txt": b"x"}, tmp_path / "root")
    assert not (tmp_path / "escape.txt").exists()


def test_a_run_config_file_round_trips_for_separate_jobs(tmp_path):
    """runs/<name>/config.yaml is what `detached-rl trainer|maker --config` read
    to run the same job as jobs."""
    from detached_rl.config import dump_config

    config = run_config(model="tiny", steps=3)
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    assert load_config(path) == config


def test_a_curve_point_starts_when_its_step_is_seen_and_never_once_training_is_over():
    from detached_rl.cli.held_out import HeldOutCurve

    class Handle:
        def __init__(self) -> None:
            self.calls: list[list[int]] = []
            self.min_versions: list[int | None] = []
            self.evaluate = self

        def remote(self, chunk, sampling=None, min_version=None):
            self.calls.append(chunk)
            self.min_versions.append(min_version)
            return object()

    late, handle = HeldOutCurve(list(range(5)), 1, 3, print), Handle()
    late.poll(3, {"m": handle}, recorder=None)  # the driver saw the last step first: the after evaluation
    assert handle.calls == [] and late.due_steps == []
    curve, first, second = HeldOutCurve(list(range(5)), 2, 6, print), Handle(), Handle()
    curve.poll(1, {"a": first, "b": second}, recorder=None)
    assert first.calls == [] and curve.due_steps == [2, 4]
    curve.poll(3, {"a": first, "b": second}, recorder=None)  # step 2 came due; 3 is what the driver saw
    assert first.calls == [[0, 1, 2]] and second.calls == [[3, 4]] and curve.due_steps == [4]
    # graded once each maker serves the step the driver saw (a push may still be on its way)
    assert first.min_versions == second.min_versions == [3]
