"""Actors ask Ray for their CPUs and GPUs: what launch creates carries the request, a request the cluster can
never place is refused at once naming the resources, and one it cannot place yet fails
within the command's timeout."""

from __future__ import annotations

import os
import time

import pytest
import torch

from detached_rl.config import load_config

from .conftest import CLUSTER_MARKER, ROOT

pytestmark = pytest.mark.ray
NAMESPACE = "resources_test"


def start_cluster(marker: str, gpus: int):
    """A local cluster with `gpus` GPUs (logical ones where the machine has none);
    its processes carry `marker`."""
    import ray

    from detached_rl.cli.jobs import init_local_ray

    previous = os.environ.get(CLUSTER_MARKER)
    os.environ[CLUSTER_MARKER] = marker
    try:
        init_local_ray(NAMESPACE, num_cpus=4, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
                       runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    finally:
        if previous is None:
            os.environ.pop(CLUSTER_MARKER, None)
        else:
            os.environ[CLUSTER_MARKER] = previous
    return ray


def config(*overrides: str):
    return load_config(None,
                       [f"namespace={NAMESPACE}", "algorithm=grpo", "model.policy=tiny", "task.train_size=16",
                              "sampling.max_new_tokens=4", *overrides])


def exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return False
    return True


class TestCpuOnlyCluster:
    @pytest.fixture(scope="class")
    def cluster(self, cluster_marker):
        ray = start_cluster(cluster_marker, gpus=0)
        yield ray
        ray.shutdown()

    def test_a_maker_asking_for_a_gpu_is_refused_at_once(self, cluster):
        from detached_rl.cli import jobs

        start = time.monotonic()
        with pytest.raises(jobs.JobError, match="^maker gm asks for 1 GPU; the cluster has 0$"):
            jobs.start_maker(config("maker.num_gpus=1"), "gm", ["t"], num_batches=1)
        assert time.monotonic() - start < 10 and not exists("gm")

    def test_a_naive_trainer_asking_for_a_gpu_is_refused_at_once(self, cluster):
        from detached_rl.cli import jobs

        start = time.monotonic()
        with pytest.raises(jobs.JobError, match="^trainer gt asks for 0.5 GPU; the cluster has 0$"):
            jobs.start_trainer(config("trainer_group.num_gpus_per_rank=0.5"), "gt", total_steps=1,
                               update_steps=1)
        assert time.monotonic() - start < 10 and not exists("gt")

    def test_run_refuses_gpus_before_creating_any_actor(self, cluster, tmp_path):
        from detached_rl.cli.run import JobRunner, RunError

        runner = JobRunner(config("run.name=gpurun", "maker.num_gpus=0.25", "run.makers=2"), tmp_path,
                           echo=lambda line: None)
        start = time.monotonic()
        with pytest.raises(RunError, match="^maker gpurun-maker-0 asks for 0.25 GPU; the cluster has 0$"):
            runner.start_actors()
        assert time.monotonic() - start < 10 and not runner.handles
        assert not any(exists(n) for n in ("gpurun-trainer", "gpurun-maker-0", "gpurun-maker-1"))


class TestClusterWithOneGpu:
    """One GPU: a real one on the GPU lane, a logical one here (actors then warn and
    keep their models on the CPU)."""

    @pytest.fixture(scope="class")
    def cluster(self, cluster_marker):
        ray = start_cluster(cluster_marker, gpus=1)
        yield ray
        ray.shutdown()

    def test_launched_actors_carry_their_gpus_and_cpus_and_a_full_gpu_times_out_naming_them(self, cluster):
        from detached_rl.actors.launch import launch_maker, launch_trainers
        from detached_rl.cli import jobs

        ray = cluster
        run = config("trainer_group.num_gpus_per_rank=0.5", "maker.num_gpus=0.25", "maker.num_cpus=0.5")
        [trainer] = launch_trainers(run, "rt", detached=False)
        maker = launch_maker(run, "rm", ["rt"], detached=False)
        try:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            trainer_status = ray.get(trainer.status.remote(), timeout=300)
            assert trainer_status["resources"] == {"CPU": 1.0, "GPU": 0.5}
            assert trainer_status["device"].split(":")[0] == device
            maker_status = ray.get(maker.status.remote(), timeout=300)
            assert maker_status["resources"] == {"CPU": 0.5, "GPU": 0.25}
            assert maker_status["device"].split(":")[0] == device

            # 0.75 of the GPU is taken: a maker asking for half of it could be placed, but not now.
            start = time.monotonic()
            with pytest.raises(jobs.JobError,
                               match=r"^maker 'late' \(asking for 1 CPU, 0.5 GPU\) did not start "
                                                    r"within 5 s; the cluster has .*0.25 GPU free$"):
                jobs.start_maker(config("maker.num_gpus=0.5"), "late", ["rt"], num_batches=1, timeout=5)
            assert time.monotonic() - start < 30
            deadline = time.monotonic() + 30
            while exists("late") and time.monotonic() < deadline:  # killed: it no longer waits for the GPU
                time.sleep(0.5)
            assert not exists("late")
        finally:
            for handle in (maker, trainer):
                ray.kill(handle, no_restart=True)

    def test_a_maker_without_a_gpu_asks_for_none_and_stays_on_the_cpu(self, cluster):
        from detached_rl.actors.launch import launch_maker

        ray = cluster
        maker = launch_maker(config("maker.num_cpus=0.5"), "cpu-maker", ["rt"], detached=False)
        try:
            status = ray.get(maker.status.remote(), timeout=300)
            assert status["resources"] == {"CPU": 0.5} and status["device"] == "cpu"
        finally:
            ray.kill(maker, no_restart=True)
