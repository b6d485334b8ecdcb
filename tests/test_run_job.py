"""`detached-rl run --model tiny`: the main job's entry point end to end, and every artefact it writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import marked_processes
from tests.helpers import assert_mismatch_gated, plotted_panels
from tests.test_run_sockets import on_loopback
from tests.tiny_run import EVAL_SIZE, STEPS, TinyRun

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def finished_run(tiny_run: TinyRun) -> tuple[Path, str, str, dict[tuple[str, str, int], str]]:
    """The session's tiny run (tests/tiny_run.py): its directory, output, marker and sockets."""
    return tiny_run.directory, tiny_run.stdout, tiny_run.marker, tiny_run.sockets


def test_reports_accuracy_before_and_after_with_examples(finished_run):
    _, stdout, *_ = finished_run
    assert "held-out before training: accuracy" in stdout
    assert "held-out after training: accuracy" in stdout
    assert "held-out accuracy" in stdout and "before" in stdout and "after" in stdout
    assert stdout.count("  Q: ") == 4  # run.examples decoded examples, before and after
    assert f"{STEPS} steps" in stdout


def test_metrics_jsonl_has_one_row_per_step(finished_run):
    from detached_rl.cli.reporting import read_metrics

    directory, *_ = finished_run
    rows = read_metrics(directory / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for key in ("reward/mean", "loss/kl_avg", "response_length/mean", "time/weight_sync", "info/correct",
                    "weight_sync/bytes", "maker_versions"):
            assert key in row, key
        assert set(row["maker_versions"]) == {"tiny-test-maker-0"}
    assert_mismatch_gated(rows, "hf:float32")  # the engine/trainer mismatch, gated (tests/helpers.py)
    # LoRA-only updates after the first full one: a few hundred kB, not the whole model.
    assert rows[-1]["weight_sync/bytes"] < 1_000_000


def test_the_held_out_curve_is_graded_while_the_makers_generate(finished_run):
    """`run.eval_every`: points between before (step 0) and after (the last step), each an evaluation row
    of the whole held-out split with its standard error and the versions that answered; the makers grade
    in their own concurrency group while `run` generates (a point taken inside `compute` would only be
    answered after training)."""
    from detached_rl.cli.reporting import read_metrics

    directory, stdout, *_ = finished_run
    points = sorted(read_metrics(directory / "metrics.jsonl", kind="eval"), key=lambda row: row["step"])
    labels = [row["eval/label"] for row in points]
    assert labels[0] == "before training" and labels[-1] == "after training" and len(points) >= 3, labels
    assert points[0]["step"] == 0 and points[-1]["step"] == STEPS
    for row in points[1:-1]:
        assert 0 < row["eval/policy_version_min"] < STEPS, row  # taken during training
        assert row["eval/policy_version_min"] <= row["eval/policy_version_max"] <= STEPS, row
        assert row["step"] == row["eval/policy_version_min"] and row["eval/count"] == EVAL_SIZE
    for row in points:
        share = row["eval/accuracy"]
        assert row["eval/accuracy_se"] == pytest.approx((share * (1 - share) / EVAL_SIZE) ** 0.5)
    assert stdout.count("held-out at step ") == len(points) - 2


def test_tensorboard_events_hold_the_scalars(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    directory, *_ = finished_run
    events = EventAccumulator(str(directory / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "reward/mean" in scalars and "time/weight_sync" in scalars
    assert [e.step for e in events.Scalars("reward/mean")] == list(range(1, STEPS + 1))
    assert {0, STEPS} <= {e.step for e in events.Scalars("eval/accuracy")}


def test_the_plot_draws_the_runs_series(finished_run):
    directory, *_ = finished_run
    # Held-out accuracy, reward, KL and response length: every panel holds a line of the run's steps.
    assert plotted_panels(directory / "metrics.png") == [True, True, True, True]


def test_eval_and_summary_parse(finished_run):
    directory, *_ = finished_run
    evaluation = json.loads((directory / "eval.json").read_text())
    assert len(evaluation["before"]) == len(evaluation["after"]) == EVAL_SIZE
    assert {r["policy_version"] for r in evaluation["before"]} == {0}
    assert {r["policy_version"] for r in evaluation["after"]} == {STEPS}
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert set(summary["held_out_before"]) >= {"accuracy", "accuracy_se", "format_rate", "reward"}
    assert "grpo" in (directory / "config.yaml").read_text()


def test_adapter_and_merged_model_load_and_agree(finished_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from detached_rl.models import load_causal_lm

    directory, *_ = finished_run
    merged = AutoModelForCausalLM.from_pretrained(directory / "merged").eval()
    tokenizer = AutoTokenizer.from_pretrained(directory / "merged")
    base, _ = load_causal_lm("tiny", seed=0)
    adapted = PeftModel.from_pretrained(base, directory / "adapter").eval()
    ids = torch.tensor([tokenizer("Mia has 3 apples.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-4, rtol=1e-4)
    config = json.loads((directory / "adapter" / "adapter_config.json").read_text())
    # all-linear, as run.yaml says
    assert config["r"] == 16 and set(config["target_modules"]) >= {"q_proj", "down_proj"}


def test_leaves_no_process_behind(finished_run):
    """The job shut down what it started: no process of its cluster (GCS, raylet, workers) is still alive.
    Only the run's own processes count (they carry its marker), not another Ray cluster on the machine."""
    _, _, marker, _ = finished_run
    deadline = time.monotonic() + 60  # the driver has exited; a loaded machine may take a while to reap
    while (left_over := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left_over == []  # a psutil.Process shows its pid and name


def test_every_socket_the_run_listened_on_is_on_loopback(finished_run):
    """`detached-rl run` from a plain shell (none of the suite's RAY_* settings): every socket its processes
    listened on, the GCS's and the raylet's among them, is on 127.0.0.0/8."""
    *_, sockets = finished_run
    names = set(sockets.values())
    assert {"gcs_server", "raylet"} <= names, f"the GCS and raylet were never seen listening: {sockets}"
    outside = sorted(f"{kind} {address}:{port} ({name})" for (kind, address, port), name in sockets.items()
                     if not on_loopback(address))
    assert not outside, f"listening outside 127.0.0.0/8: {outside}"
