"""Scorer groups on a local Ray cluster: answers, retries on a dead worker, a clear report when all are down.

On the CPU with `--device cuda` too: these workers score with a Python reward (no model), and a scorer group
takes whole GPUs per worker, not shares of one.
"""

from __future__ import annotations

import threading

import pytest
import ray
import torch

from detached_rl.actors.group import (
    ActorGroup,
    group_prefix,
    placement_group_name,
    remove_placement_groups_left_empty,
)
from detached_rl.actors.scorer import (
    RemoteScoring,
    ScorerUnavailableError,
    scorer_names,
    start_scorer_group,
    stop_scorer_group,
)
from detached_rl.scorer.config import ScorerGroupConfig
from detached_rl.scorer.requests import ScoreRequestError

from .helpers import LowTokenReward
from .test_scorers import request

pytestmark = pytest.mark.ray
NAMESPACE = "scorer_groups_test"


def test_a_group_answers_retries_past_a_dead_worker_and_reports_when_all_are_down(ray_cluster):
    group = ScorerGroupConfig(num_nodes=2, num_cpus_per_worker=0.5, max_wait_s=0.05)
    handles = start_scorer_group("rw", "reward", LowTokenReward, group, namespace=NAMESPACE)
    try:
        assert [ray.get(h.group_info.remote(), timeout=30)["size"] for h in handles] == [2, 2]
        scoring = RemoteScoring({"reward": "rw"}, NAMESPACE, attach_timeout_s=30, timeout_s=20, attempts=2)
        asked = request(seed=3)
        expected = LowTokenReward().score(asked.sequences, asked.attention_mask, asked.response_mask)
        answers: list = []
        threads = [threading.Thread(target=lambda: answers.append(scoring.submit(asked)(60)["reward"]))
                   for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert len(answers) == 4
        for answer in answers:
            torch.testing.assert_close(answer.rewards, expected)
        served = [ray.get(h.status.remote(), timeout=30) for h in handles]
        assert sum(s["requests"] for s in served) == 4 and all(s["role"] == "scorer" for s in served)

        bad = request()
        bad.response_mask = bad.response_mask * 3
        with pytest.raises(ScoreRequestError, match="response_mask"):
            scoring.submit(bad)

        ray.kill(handles[0], no_restart=True)
        for _ in range(2):  # round-robin reaches the dead worker; the retry goes to the live one
            torch.testing.assert_close(scoring.submit(asked)(60)["reward"].rewards, expected)
        assert scoring.retries >= 1

        ray.kill(handles[1], no_restart=True)
        with pytest.raises(ScorerUnavailableError,
                           match=r"reward scorer group 'rw' did not answer after 2 attempts"):
            scoring.submit(asked)(60)
    finally:
        stop_scorer_group("rw", 2, NAMESPACE)
    assert not any(n in ray.util.list_named_actors() for n in scorer_names("rw", 2))


def test_a_group_that_cannot_start_leaves_nothing_behind(ray_cluster):
    from ray.util.placement_group import get_placement_group

    with pytest.raises(Exception, match="needs the trainer names"):
        start_scorer_group("cr", "critic", LowTokenReward, ScorerGroupConfig(num_cpus_per_worker=0.5),
                           namespace=NAMESPACE)
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("cr_")]
    with pytest.raises(ValueError):
        get_placement_group("cr-placement")


def test_a_placement_group_is_removed_once_the_last_worker_of_its_group_is_gone(ray_cluster):
    from ray.util.placement_group import get_placement_group

    handles = start_scorer_group("pg", "reward", LowTokenReward,
                                 ScorerGroupConfig(num_nodes=2, num_cpus_per_worker=0.5),
                                 namespace=NAMESPACE)
    try:
        ray.kill(handles[0], no_restart=True)
        remove_placement_groups_left_empty(["pg_0"], live=["pg_1", "maker-0"])
        assert ray.util.placement_group_table(get_placement_group("pg-placement"))["state"] == "CREATED"
        ray.kill(handles[1], no_restart=True)
        remove_placement_groups_left_empty(["pg_1", "maker-0"], live=[])
        with pytest.raises(ValueError):
            get_placement_group("pg-placement")
    finally:
        stop_scorer_group("pg", 2, NAMESPACE)


def test_group_names_and_prefixes():
    assert scorer_names("rw", 2) == ["rw_0", "rw_1"] and placement_group_name("rw") == "rw-placement"
    names = ("rw_0", "my_group_12", "maker-0", "rw_x", "_3")
    assert [group_prefix(name) for name in names] == ["rw", "my_group", None, None, None]
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        ActorGroup("rw", 0)


def test_group_config_refuses_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="ScorerGroupConfig.num_nodes"):
        ScorerGroupConfig(num_nodes=0)
    with pytest.raises(ValueError, match="ScorerGroupConfig.resources"):
        ScorerGroupConfig(resources={"scorer_node": -1})
    with pytest.raises(ValueError, match="ScorerGroupConfig.placement_strategy"):
        ScorerGroupConfig(placement_strategy="RANDOM")
    assert ScorerGroupConfig(num_nodes=2, num_gpus_per_node=4).num_workers == 8
