"""Trainer groups on a real local Ray cluster: data-parallel ranks in a placement group train to the same
weights as one naive trainer fed the same experience, wait for each other, and refuse what cannot run here."""

from __future__ import annotations

import time

import pytest
import torch

from detached_rl.actors.group import placement_group_name
from detached_rl.actors.trainer import DetachedGRPOTrainer
from detached_rl.actors.trainer_group import start_trainer_group, stop_trainer_group
from detached_rl.algorithms.grpo import GRPOConfig
from detached_rl.models import SamplingConfig
from detached_rl.strategies import colossalai_available
from detached_rl.strategies.optim import OptimizerConfig
from detached_rl.trainer.config import TrainerConfig, TrainerGroupConfig
from detached_rl.weights.ray_wire import fetch_chunk

from .helpers import UNCHECKED, gpu_options, group_gpus_per_rank, make_experience, tiny_policy

pytestmark = pytest.mark.ray

NAMESPACE = "detached_rl_tests"
TIMEOUT = 180
GROUP_SIZE, GROUPS_PER_RANK, STEPS, WORLD_SIZE = 4, 2, 2, 2
PER_RANK = GROUP_SIZE * GROUPS_PER_RANK
# Hand-made samples (their log-probs are not the policy's): unchecked.
GROUP_CONFIG = TrainerConfig(train_batch_size=PER_RANK, provenance=UNCHECKED)
GROUP_CONFIG_ALL = TrainerConfig(train_batch_size=PER_RANK * WORLD_SIZE, provenance=UNCHECKED)
# A large learning rate, so that a wrong gradient shows above the tolerance; a large Adam eps, because Adam
# scales a gradient near 0 (rounding noise, ~1e-9) up to a step of ~lr, which no summation order survives.
ALGORITHM = GRPOConfig(sampling=SamplingConfig(max_new_tokens=8), kl_coef=0.05, loss_agg="token-mean",
                       micro_batch_size=3,
                       actor_optimizer=OptimizerConfig(lr=1e-2, eps=1e-4, max_grad_norm=1.0))
NO_COLOSSALAI = "colossalai is not installed (`make colossalai` installs it beside torch)"


def experiences_for(step: int, rank: int) -> list:
    """Whole GRPO groups for one rank and step; rank 0's responses are longer (the
    ranks hold unequal tokens)."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    out = []
    for group in range(GROUPS_PER_RANK):
        group_id = f"s{step}-r{rank}-g{group}"
        for member in range(GROUP_SIZE):
            length = int(torch.randint(4, 9, (), generator=generator)) if rank == 0 else 1 + member % 2
            response = torch.randint(3, 60, (length,), generator=generator).tolist()
            prompt = torch.randint(3, 60, (3,), generator=generator).tolist()
            out.append(make_experience(
                prompt=prompt, response=response, reward=float(torch.rand((), generator=generator)),
                log_probs=-torch.rand(length, generator=generator) - 0.5, group_id=group_id, maker="m",
            ))
    return out


def gone(ray, name: str, timeout: float = 30.0) -> bool:
    """True once no live actor is named `name` (a killed actor's name is released asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


def weights_of(ray, trainer) -> dict[str, torch.Tensor]:
    """The full weights a maker would receive from `trainer` now."""
    update = ray.get(trainer.register_maker.remote("probe"), timeout=TIMEOUT)
    weights = {}
    for ref in update.chunk_refs:
        weights.update({name: t.clone() for name, t in fetch_chunk(ref, TIMEOUT).items()})
    return weights


@pytest.fixture(scope="module")
def naive_weights(ray_cluster):
    """A single naive trainer trained on every rank's experience, each step's batch being the ranks' union."""
    ray = ray_cluster
    # On a GPU only when the groups below get GPUs too: the weights are compared within atol 1e-5.
    options = gpu_options("trainer") if group_gpus_per_rank(WORLD_SIZE) else {}
    trainer = DetachedGRPOTrainer.options(name="naive_trainer", namespace=NAMESPACE, **options).remote(
        "naive_trainer", tiny_policy, GROUP_CONFIG_ALL, ALGORITHM,
        NAMESPACE)
    try:
        for step in range(STEPS):
            batch = [e for rank in range(WORLD_SIZE) for e in experiences_for(step, rank)]
            ray.get(trainer.push_experience.remote(batch), timeout=TIMEOUT)
        initial = weights_of(ray, trainer)
        summary = ray.get(trainer.fit.remote(STEPS), timeout=TIMEOUT)
        assert summary["policy_version"] == STEPS
        return initial, weights_of(ray, trainer)
    finally:
        ray.kill(trainer)


@pytest.mark.parametrize(("strategy", "placement"), [
    ("ddp", "PACK"),
    pytest.param("colossalai_ddp", "SPREAD",
                 marks=pytest.mark.skipif(not colossalai_available(), reason=NO_COLOSSALAI)),
])
def test_a_two_rank_group_ends_with_the_weights_of_one_naive_trainer(ray_cluster, naive_weights, strategy,
                                                                     placement):
    ray = ray_cluster
    prefix = f"group_{strategy}"
    group = TrainerGroupConfig(strategy=strategy, world_size=WORLD_SIZE, placement_strategy=placement,
                               timeout_s=120, num_gpus_per_rank=group_gpus_per_rank(WORLD_SIZE))
    ranks = start_trainer_group(prefix, WORLD_SIZE, tiny_policy, GROUP_CONFIG,
                                ALGORITHM, NAMESPACE, strategy=strategy, group=group, timeout=TIMEOUT)
    try:
        # Placed in the group's own placement group, one bundle per rank, with the strategy asked for.
        table = ray.util.placement_group_table(ray.util.get_placement_group(placement_group_name(prefix)))
        assert table["strategy"] == placement and len(table["bundles"]) == WORLD_SIZE
        assert table["state"] == "CREATED"
        statuses = ray.get([r.status.remote() for r in ranks], timeout=TIMEOUT)
        assert [(s["rank"], s["world_size"]) for s in statuses] == [(0, 2), (1, 2)]

        # Rank 1 has nothing yet: both ranks wait at the collective instead of rank 0 training alone.
        ray.get(ranks[0].push_experience.remote(experiences_for(0, 0)), timeout=TIMEOUT)
        fits = [r.fit.remote(STEPS) for r in ranks]
        time.sleep(3.0)
        assert ray.get([r.policy_version.remote() for r in ranks], timeout=TIMEOUT) == [0, 0]
        assert ray.get([r.status.remote() for r in ranks], timeout=TIMEOUT)[0]["state"] == "training"
        ray.get(ranks[1].push_experience.remote(experiences_for(0, 1)), timeout=TIMEOUT)
        for rank, trainer in enumerate(ranks):
            ray.get(trainer.push_experience.remote(experiences_for(1, rank)), timeout=TIMEOUT)
        summaries = ray.get(fits, timeout=TIMEOUT)
        assert [s["policy_version"] for s in summaries] == [STEPS, STEPS]

        initial, expected = naive_weights
        first, second = (weights_of(ray, r) for r in ranks)
        assert first.keys() == second.keys() == expected.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)  # replicas agree exactly
        for name, tensor in expected.items():
            torch.testing.assert_close(first[name], tensor, rtol=0, atol=1e-5, msg=name)
        assert any(not torch.equal(initial[k], first[k]) for k in first)  # and training moved them
    finally:
        stop_trainer_group(prefix, WORLD_SIZE, NAMESPACE)
    with pytest.raises(ValueError):
        ray.util.get_placement_group(placement_group_name(prefix))


@pytest.mark.parametrize("strategy", ["colossalai_zero2", "colossalai_gemini"])
def test_sharded_colossalai_strategies_refuse_cpu_and_leave_nothing_behind(ray_cluster, strategy):
    ray = ray_cluster
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the strategies would run")
    prefix = f"group_{strategy}"
    with pytest.raises(Exception, match=f"strategy '{strategy}' needs CUDA GPUs.*naive, ddp, colossalai_ddp"):
        start_trainer_group(prefix, WORLD_SIZE, tiny_policy, GROUP_CONFIG,
                            ALGORITHM,
                            NAMESPACE, strategy=strategy, timeout=TIMEOUT)
    for rank in range(WORLD_SIZE):
        assert gone(ray, f"{prefix}_{rank}")
    with pytest.raises(ValueError):
        ray.util.get_placement_group(placement_group_name(prefix))


def test_a_group_that_cannot_be_placed_times_out_with_the_resources_named(ray_cluster):
    group = TrainerGroupConfig(strategy="ddp", world_size=2, num_cpus_per_rank=64)
    with pytest.raises(TimeoutError, match="could not be placed"):
        start_trainer_group("too_big", 2, tiny_policy, TrainerConfig(), ALGORITHM, NAMESPACE, strategy="ddp",
                            group=group, timeout=2)
