"""Faults on a real local Ray cluster (tiny models, CPU): a maker or a trainer process is killed with SIGKILL
by its PID mid-run, and the run goes on without losing or double counting experience."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from detached_rl.actors.maker import ExperienceMakerHolder
from detached_rl.actors.trainer import DetachedGRPOTrainer
from detached_rl.algorithms.grpo import GRPOConfig
from detached_rl.cli import jobs
from detached_rl.core.prompts import CyclingPrompts
from detached_rl.maker.experience_maker import MakerConfig
from detached_rl.models import SamplingConfig
from detached_rl.trainer.config import TrainerConfig

from .conftest import marked_processes
from .helpers import arithmetic_prompts, gpu_options, grpo_maker_models, tiny_policy, wait_for

pytestmark = pytest.mark.ray

NAMESPACE = "detached_rl_tests"
SAMPLING = SamplingConfig(max_new_tokens=8)
TIMEOUT = 180
STEPS = 16


def new_trainer(name: str, **config):
    # A small buffer throttles makers to the trainer's pace, so a fault lands mid-run, not after it.
    config = {"train_batch_size": 8, "buffer_max_samples": 16, "batch_timeout_s": 120, **config}
    # Detached, as `detached-rl trainer` starts it: a dead detached actor's name is free at once for a
    # successor (a non-detached one keeps it while its owner holds a handle).
    return DetachedGRPOTrainer.options(name=name, namespace=NAMESPACE, lifetime="detached",
                                       **gpu_options("trainer")).remote(
        name, tiny_policy, TrainerConfig(**config), GRPOConfig(sampling=SAMPLING), NAMESPACE)


def new_maker(name: str, trainers: list[str], max_restarts: int = 2, state_path: str | None = None):
    config = MakerConfig(experience_batch_size=2, group_size=4, sampling=SAMPLING, max_pushes_in_flight=1,
                         wait_for_ack=True, max_restarts=max_restarts)
    return ExperienceMakerHolder.options(name=name, namespace=NAMESPACE, max_restarts=max_restarts,
                                         **gpu_options("maker")).remote(
        name, trainers, grpo_maker_models, CyclingPrompts(arithmetic_prompts()), config, NAMESPACE,
        state_path=state_path)


def status_or_none(ray, handle):
    try:
        return ray.get(handle.status.remote(), timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_a_maker_killed_mid_generation_restarts_takes_the_latest_weights_and_the_run_completes(ray_cluster,
                                                                                               tmp_path):
    ray = ray_cluster
    trainer = new_trainer("fault_trainer")
    maker = new_maker("fault_maker", ["fault_trainer"], state_path=str(tmp_path / "maker_state"))
    try:
        ray.get(maker.start.remote(), timeout=TIMEOUT)
        assert ray.get(trainer.start_fit.remote(STEPS), timeout=TIMEOUT)
        wait_for(lambda: ray.get(trainer.policy_version.remote()) >= 2, "two training steps", timeout=TIMEOUT,
                 interval=0.2)
        before = ray.get(maker.status.remote(), timeout=TIMEOUT)
        assert not before["restarted"] and before["state"] == "running"
        os.kill(before["pid"], signal.SIGKILL)

        # Ray restarts the process; the new maker resumes by itself, re-attached and re-synced.
        after = wait_for(lambda: (s := status_or_none(ray, maker)) and s["pid"] != before["pid"]
                         and s["first_batch_version"] is not None and s, "the restarted maker's first batch",
                         timeout=TIMEOUT, interval=0.2)
        version_at_restart = after["first_batch_version"]
        # not -1 / 0: it pulled the trainer's weights first
        assert after["restarted"] and version_at_restart >= 2
        # its prompt cursor and counters went on from the saved state
        assert after["batches"] > before["batches"]
        summary = wait_for(lambda: (s := ray.get(trainer.status.remote())) and s["state"] == "done" and s,
                           "the trainer to finish", timeout=TIMEOUT, interval=0.2)
        assert summary["policy_version"] == STEPS
        # A weight push that met the maker while it was restarting is reported, naming it,
        # and did not stop training.
        assert summary["last_error"] is None or "fault_maker" in summary["last_error"]
        stats = ray.get(trainer.buffer_stats.remote())
        # Every sample that reached the trainer is trained, in the buffer or dropped
        # with a reason; none twice.
        assert stats["accounting_ok"] and stats["duplicates"] == 0
        assert stats["sampled"] == STEPS * 8
        final = wait_for(lambda: (s := status_or_none(ray, maker)) and s["state"] != "running" and s,
                         "the maker to be stopped by the trainer", timeout=TIMEOUT, interval=0.2)
        assert final["policy_version"] == STEPS and final["pid"] == after["pid"]
    finally:
        ray.kill(maker, no_restart=True)
        ray.kill(trainer)


def test_a_killed_trainer_resumes_from_its_checkpoint_and_its_makers_re_attach_by_name(ray_cluster, tmp_path):
    ray = ray_cluster
    checkpoints = str(tmp_path / "ckpt")
    trainer = new_trainer("resumed_trainer")
    maker = new_maker("resumed_maker", ["resumed_trainer"])
    replacement = None
    try:
        ray.get(maker.start.remote(), timeout=TIMEOUT)
        ray.get(trainer.start_fit.remote(STEPS, checkpoint_every=1, checkpoint_dir=checkpoints),
                timeout=TIMEOUT)
        wait_for(lambda: ray.get(trainer.policy_version.remote()) >= 3, "three training steps",
                 timeout=TIMEOUT,
                 interval=0.2)
        first = ray.get(trainer.status.remote(), timeout=TIMEOUT)
        os.kill(first["pid"], signal.SIGKILL)
        wait_for(lambda: status_or_none(ray, trainer) is None, "the trainer to be gone", timeout=TIMEOUT,
                 interval=0.2)
        wait_for(lambda: _name_free(ray, "resumed_trainer"), "the trainer's name to be released",
                 timeout=TIMEOUT,
                 interval=0.2)
        # `detached-rl status` shows the dead trainer, and the maker's pushes fail with an error naming it.
        rows = {row["name"]: row for row in jobs.all_status(NAMESPACE)}
        assert rows["resumed_trainer"]["state"] == "dead" and rows["resumed_trainer"]["role"] == "trainer"
        assert "worker process has died" in rows["resumed_trainer"]["last_error"]
        assert rows["resumed_maker"]["state"] == "running"
        wait_for(lambda: "resumed_trainer" in (ray.get(maker.status.remote())["push"]["last_error"] or ""),
                 "the maker to report the dead trainer by name", timeout=60, interval=0.2)

        # A new trainer under the same name resumes from the last whole checkpoint.
        replacement = new_trainer("resumed_trainer")
        assert ray.get(replacement.start_fit.remote(STEPS, checkpoint_every=1, checkpoint_dir=checkpoints,
                                                    resume_from=checkpoints), timeout=TIMEOUT)
        done = wait_for(lambda: (s := ray.get(replacement.status.remote()))
                        and s["state"] in ("done", "failed") and s,
                        "the resumed trainer to finish", timeout=TIMEOUT, interval=0.2)
        assert done["state"] == "done" and done["policy_version"] == STEPS, done["last_error"]
        assert done["trainer_run"] != first["trainer_run"]
        history = ray.get(replacement.metrics.remote())
        # picked up, not from scratch
        assert history and history[0]["policy_version"] >= first["policy_version"]
        assert ray.get(replacement.buffer_stats.remote())["accounting_ok"]

        # The maker never restarted: it found the new trainer by name and follows its run and versions.
        maker_status = wait_for(lambda: (s := ray.get(maker.status.remote())) and s["state"] != "running"
                                and s,
                                "the maker to be stopped by the new trainer", timeout=TIMEOUT, interval=0.2)
        assert not maker_status["restarted"]
        assert maker_status["trainer_run"] == done["trainer_run"] and maker_status["policy_version"] == STEPS
        push = maker_status["push"]
        pushed = (push["accepted"] + push["duplicates"] + push["dropped_stale_by_trainer"]
                  + sum(push["dropped"].values()))
        assert pushed == push["samples_pushed"]  # every push acked or dropped with a reason
    finally:
        ray.kill(maker, no_restart=True)
        for handle in (trainer, replacement):
            if handle is not None:
                ray.kill(handle)


def _name_free(ray, name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return True
    return False


def test_the_local_cluster_binds_to_loopback(ray_cluster, ray_cluster_marker):
    ray = ray_cluster
    assert [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]] == ["127.0.0.1"]
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    # The shared cluster only (its processes carry the marker), not another cluster on the machine.
    own = marked_processes(ray_cluster_marker)
    ray_processes = {proc.pid for proc in own
                     if any(part in proc.name() for part in ("gcs_server", "raylet"))}
    assert len(ray_processes) == 2, f"expected this cluster's GCS and raylet, found {[p.name() for p in own]}"
    listening = {conn.laddr.ip for conn in psutil.net_connections("inet")
                 if conn.status == psutil.CONN_LISTEN and conn.pid in ray_processes}
    assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
