"""Role-separated pipeline on a 3-node Ray cluster simulated on this machine (`ray.cluster_utils.Cluster`).

Trainer, makers and scorers go to the nodes that offer their custom resource; they attach by name
across nodes; the experience of a maker served by scorer groups equals what a maker with local
models makes from the same seed; a short PPO run completes and the critic scorers follow the
trainer's versions.

On the CPU with `--device cuda` too: the simulated nodes share one machine and ask for no GPU, and the
sampled tokens are compared with a local maker's, which must run where the remote one does.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from detached_rl.config import RunConfig, load_config, maker_factory, trainer_factory
from detached_rl.maker.experience_maker import ExperienceMaker
from detached_rl.strategies import NaiveStrategy
from detached_rl.weights.update import build_weight_update

from .conftest import ROOT
from .helpers import ObjectStore, wait_for

pytestmark = pytest.mark.ray
NAMESPACE = "multinode_test"
NODES = {"trainer_node": 2, "maker_node": 2, "scorer_node": 4}


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    simulated = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "node_ip_address": "127.0.0.1"})
    node_ids = {}
    for resource, cpus in NODES.items():
        node = simulated.add_node(num_cpus=cpus, resources={resource: 100}, node_ip_address="127.0.0.1")
        node_ids[resource] = node.node_id
    simulated.wait_for_nodes()
    ray.init(address=simulated.address, namespace=NAMESPACE, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    yield node_ids
    ray.shutdown()
    simulated.shutdown()


def run_config() -> RunConfig:
    """Tiny PPO: one naive trainer, makers whose reward, reference and critic come from scorer groups."""
    return load_config(None, [
        f"namespace={NAMESPACE}", "algorithm=ppo", "model.policy=tiny", "sampling.max_new_tokens=6",
        # Where the defaults (the main job's) differ: the whole policy, one answer per prompt, full updates.
        "model.lora=null", "maker.group_size=1", "sampling.temperature=1.0", "maker.backend=hf",
        "maker.max_pushes_in_flight=2", "maker.wait_for_ack=false", "trainer.weight_sync=full",
        "trainer.overlap_weight_push=false", "trainer.max_staleness=null",
        "maker.experience_batch_size=4", "maker.seed=1234", "maker.resources={maker_node: 1}",
        "maker.reward_scorer=reward", "maker.reference_scorer=initial", "maker.critic_scorer=critic",
        "trainer.train_batch_size=8", "trainer.buffer_max_samples=64",
        "trainer_group.resources={trainer_node: 1}",
        "scorers.reward.resources={scorer_node: 1}", "scorers.reference.resources={scorer_node: 1}",
        "scorers.critic.resources={scorer_node: 1}", "scorers.critic.num_nodes=2",
        "scorers.reward.max_wait_s=0.05",
    ])


def local_experience(config: RunConfig) -> list:
    """The first batch a maker with local models makes from the trainer's initial
    weights and the same seed."""
    local = dataclasses.replace(config.maker_config, reward_scorer=None, reference_scorer=None,
                                critic_scorer=None,
                                resources={})
    config = dataclasses.replace(config, maker=local)
    maker = ExperienceMaker("maker_0", maker_factory(config)(), config.prompts(), local,
                            NaiveStrategy(device="cpu"))  # where the maker actor, given no GPU, runs
    actor, critic = trainer_factory(config)()
    store = ObjectStore()
    update, _ = build_weight_update({"actor": actor.model.state_dict(), "critic": critic.state_dict()}, 0,
                                    store.put)
    maker.apply_weight_update(update, store.fetch)
    return maker.make_experience()


def test_roles_on_their_nodes_equal_experience_and_a_short_ppo_run(cluster):
    import ray

    from detached_rl.cli import jobs

    config = run_config()
    jobs.start_trainer(config, "trainer", total_steps=2, update_steps=1)
    scorers = jobs.start_scorers(config, ["trainer"])
    assert sorted(scorers) == ["critic_0", "critic_1", "initial_0", "reward_0"]
    maker = jobs.start_maker(config, "maker_0", ["trainer"], num_batches=1)
    trainer = ray.get_actor("trainer", namespace=NAMESPACE)
    try:
        # Placement: every role on the node that offers its resource.
        wanted = {"trainer": "trainer_node", "maker_0": "maker_node", **dict.fromkeys(scorers, "scorer_node")}
        for name, resource in wanted.items():
            status = ray.get(ray.get_actor(name, namespace=NAMESPACE).status.remote(), timeout=60)
            assert status["node_id"] == cluster[resource], f"{name} is not on the {resource}"

        # The first batch (policy v0, critic v0) equals a local-model maker's, from the same seed.
        wait_for(lambda: ray.get(trainer.buffer_length.remote(), timeout=30) >= 4, "the first batch",
                 timeout=180,
                 interval=0.5)
        rows = ray.get(trainer.buffer_export.remote(0, 4), timeout=60)
        expected = local_experience(config)
        assert len(rows) == len(expected) == 4
        for row, local in zip(rows, expected, strict=True):
            assert row["policy_version"] == 0 and row["info"]["critic_version"] == 0
            assert row["prompt_ids"] == local.prompt_ids.tolist()
            assert row["response_ids"] == local.response_ids.tolist()
            for name in ("log_probs", "values", "ref_log_probs", "reward"):
                torch.testing.assert_close(torch.tensor(row[name]), getattr(local, name).float(), atol=1e-5,
                                           rtol=0,
                                           msg=lambda text, name=name: f"{name}: {text}")
            assert row["info"]["kl"] == pytest.approx(local.info["kl"], abs=1e-5)

        # A short PPO run completes; the critic scorers follow the trainer's versions.
        assert ray.get(maker.start.remote(None), timeout=60)
        wait_for(lambda: ray.get(trainer.status.remote(), timeout=30)["state"] in ("done", "failed"),
                 "the run to finish",
                 timeout=300, interval=0.5)
        status = ray.get(trainer.status.remote(), timeout=30)
        assert status["state"] == "done" and status["steps"] == 2, status
        for name in ("critic_0", "critic_1"):
            scorer = ray.get(ray.get_actor(name, namespace=NAMESPACE).status.remote(), timeout=30)
            assert scorer["version"] == status["policy_version"] and scorer["last_error"] is None
        served = [ray.get(ray.get_actor(n, namespace=NAMESPACE).status.remote(), timeout=30) for n in scorers]
        assert all(s["requests"] >= 1 for s in served if s["scorer_role"] != "critic")
        # round-robin over both
        assert sum(s["requests"] for s in served if s["scorer_role"] == "critic") >= 3
    finally:
        stopped = jobs.stop([], NAMESPACE, force=True, timeout=30)
        assert set(stopped) >= {"trainer", "maker_0", *scorers}
    assert not jobs.actor_names(NAMESPACE)
