"""What each actor asks Ray for, how `run` shares GPUs, which device an actor uses, and refusing what cannot
be placed: the pure parts, without a Ray cluster."""

from __future__ import annotations

import re

import pytest

from detached_rl.actors.launch import _options, launch_requests, maker_request, trainer_request
from detached_rl.cli.main import _config, build_parser
from detached_rl.cli.run import DEFAULT_RUN_CONFIG, run_cpu_slots, run_gpus
from detached_rl.config import ConfigError, load_config
from detached_rl.core.resources import (
    check_amount,
    describe,
    device_for,
    gpu_shares,
    resource_request,
    unplaceable,
)
from detached_rl.maker.experience_maker import MakerConfig

# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(("override", "message"), [
    ("maker.num_gpus=-1", "maker.num_gpus: must be a number >= 0, got -1"),
    ("maker.num_gpus=1.5", "maker.num_gpus: must be a fraction up to 1 or a whole number of GPUs, got 1.5"),
    ("maker.num_gpus=0.00001", "maker.num_gpus: must be 0 or at least 0.0001"),
    ("maker.num_gpus=many", "maker.num_gpus: expected a number, got 'many'"),
    ("maker.num_gpus=.nan", "maker.num_gpus: expected a finite number, got nan"),
    ("maker.num_cpus=-0.5", "maker.num_cpus: must be a number >= 0"),
    ("trainer_group.num_gpus_per_rank=2.5",
     "trainer_group.num_gpus_per_rank: must be a fraction up to 1 or a whole"),
    ("trainer_group.num_cpus_per_rank=-1", "trainer_group.num_cpus_per_rank: must be a number >= 0"),
    ("run.gpus=sometimes", "run.gpus: must be one of ('auto', 'manual'), got 'sometimes'"),
])
def test_bad_gpu_and_cpu_counts_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def test_fractions_and_whole_gpus_are_accepted():
    config = load_config(None,
                         ["maker.num_gpus=0.25", "maker.num_cpus=0.5", "trainer_group.num_gpus_per_rank=2",
                                "run.gpus=manual"])
    assert (config.maker.num_gpus, config.maker.num_cpus) == (0.25, 0.5)
    assert config.trainer_group.num_gpus_per_rank == 2 and config.run.gpus == "manual"
    # CPU behaviour unchanged by default
    assert MakerConfig().num_gpus == 0.0 and MakerConfig().num_cpus == 1.0
    with pytest.raises(ValueError, match=r"MakerConfig\.num_gpus must be a number >= 0, got True"):
        MakerConfig(num_gpus=True)


def test_check_amount_takes_whole_gpus_above_one_and_any_cpu_count():
    check_amount(3, "x", gpu=True)
    check_amount(2.5, "x")  # CPUs may be any amount
    with pytest.raises(ValueError, match="x must be a fraction"):
        check_amount(1.01, "x", gpu=True)


# ------------------------------------------------------------------ run's GPU shares


def _first_fit(trainer: float, per_maker: float, makers: int, gpus: int) -> bool:
    """Whether the shares fit on `gpus` GPUs the way Ray places them: a fraction on one GPU, a whole count on
    that many free GPUs."""
    free = [1.0] * gpus
    for share in [trainer] + [per_maker] * makers:
        if share >= 1:
            whole = [i for i, f in enumerate(free) if f >= 1 - 1e-9][: int(share)]
            if len(whole) < share:
                return False
            for i in whole:
                free[i] = 0.0
            continue
        slot = next((i for i, f in enumerate(free) if f + 1e-9 >= share), None)
        if slot is None:
            return False
        free[slot] -= share
    return True


@pytest.mark.parametrize(("gpus", "makers", "expected"), [
    (0, 2, (0.0, 0.0)), (0.5, 2, (0.0, 0.0)),
    (1, 1, (0.5, 0.5)), (1, 2, (0.5, 0.25)), (1, 3, (0.5, 0.1666)),
    (2, 2, (1.0, 0.5)), (2, 3, (1.0, 0.3333)), (3, 2, (1.0, 1.0)), (4, 5, (1.0, 0.5)), (8, 4, (1.0, 1.0)),
])
def test_gpu_shares(gpus, makers, expected):
    assert gpu_shares(gpus, makers) == expected


@pytest.mark.parametrize("gpus", range(1, 7))
@pytest.mark.parametrize("makers", range(1, 10))
def test_gpu_shares_are_the_largest_that_fit_on_the_gpus(gpus, makers):
    trainer, per_maker = gpu_shares(gpus, makers)
    assert 0 < trainer <= 1 and 0 < per_maker <= 1
    assert _first_fit(trainer, per_maker, makers, gpus)
    if per_maker < 1:  # the largest share that fits: a little more does not
        assert not _first_fit(trainer, per_maker * 1.01 + 1e-4, makers, gpus)


def test_gpu_shares_refuses_bad_arguments():
    with pytest.raises(ValueError, match="makers must be an int >= 1"):
        gpu_shares(1, 0)
    with pytest.raises(ValueError, match="trainer_share must be in"):
        gpu_shares(1, 2, trainer_share=1.0)


def test_run_gpus_auto_shares_explicit_values_win_and_manual_keeps_the_config():
    config = load_config(None, ["run.makers=2"], base=DEFAULT_RUN_CONFIG)
    assert config.run.gpus == "auto"
    assert run_gpus(config, 0) is config  # a CPU-only cluster: unchanged
    shared = run_gpus(config, 1)
    assert (shared.trainer_group.num_gpus_per_rank, shared.maker.num_gpus) == (0.5, 0.25)
    assert (config.trainer_group.num_gpus_per_rank, config.maker.num_gpus) == (0, 0)  # a copy
    explicit = load_config(None, ["maker.num_gpus=1"], base=DEFAULT_RUN_CONFIG)
    assert run_gpus(explicit, 4) is explicit
    explicit = load_config(None, ["trainer_group.num_gpus_per_rank=0.75"], base=DEFAULT_RUN_CONFIG)
    assert run_gpus(explicit, 4) is explicit
    manual = load_config(None, ["run.gpus=manual"], base=DEFAULT_RUN_CONFIG)
    assert run_gpus(manual, 2) is manual


def test_run_cpu_slots_count_the_trainer_and_every_maker():
    assert run_cpu_slots(load_config(None, ["run.makers=2"])) == 3
    assert run_cpu_slots(load_config(None, ["run.makers=3", "maker.num_cpus=0.5"])) == 3  # ceil(1 + 1.5)


# ------------------------------------------------------------------ unplaceable


def test_a_gpu_on_a_cpu_only_cluster_is_named():
    requests = {"trainer run-trainer": {"CPU": 1.0}, "maker run-maker-0": {"CPU": 1.0, "GPU": 1.0}}
    assert (unplaceable(requests, {"CPU": 8.0, "memory": 1e9})
            == "maker run-maker-0 asks for 1 GPU; the cluster has 0")


def test_requests_that_fit_only_one_by_one_are_named_together():
    requests = {"trainer t": {"CPU": 1.0, "GPU": 0.5}, "maker m0": {"CPU": 1.0, "GPU": 0.5},
                "maker m1": {"CPU": 1.0, "GPU": 0.5}}
    assert unplaceable(requests, {"CPU": 4.0, "GPU": 1.0}) == (
        "trainer t, maker m0, maker m1 ask for 1.5 GPU together; the cluster has 1")
    assert unplaceable(requests, {"CPU": 4.0, "GPU": 2.0}) is None
    assert unplaceable(requests, {"CPU": 2.0, "GPU": 2.0}) == (
        "trainer t, maker m0, maker m1 ask for 3 CPU together; the cluster has 2")


def test_custom_resources_and_rounding():
    assert unplaceable({"maker m": {"CPU": 1.0, "maker_node": 1.0}}, {"CPU": 2.0}) == (
        "maker m asks for 1 maker_node; the cluster has 0")
    thirds = {f"maker m{i}": {"GPU": 0.3333} for i in range(3)}
    assert unplaceable(thirds, {"GPU": 1.0}) is None
    assert unplaceable({}, {}) is None


def test_resource_request_and_describe():
    assert resource_request(1, 0.5, {"maker_node": 1}) == {"CPU": 1.0, "GPU": 0.5, "maker_node": 1.0}
    assert resource_request(0, 0) == {}
    assert describe({"GPU": 0.25, "CPU": 1.0}) == "0.25 GPU, 1 CPU" and describe({}) == "no resources"


def test_an_actor_given_no_gpu_stays_on_the_cpu():
    assert device_for(0.5, cuda_available=True) == "cuda"
    assert device_for(0.0, cuda_available=True) == "cpu"  # Ray 2.60 does not hide the node's GPUs from it
    assert device_for(1.0, cuda_available=False) == "cpu"  # logical GPUs a CPU build of torch cannot use


# ------------------------------------------------------------------ what launch asks for


def test_launch_asks_for_every_roles_cpus_and_gpus():
    config = load_config(None,
                         ["maker.num_gpus=0.25", "maker.num_cpus=0.5", "maker.resources={maker_node: 1}",
                                "trainer_group.num_gpus_per_rank=0.5",
                                "trainer_group.resources={trainer_node: 1}",
                                "maker.reward_scorer=rw", "scorers.reward.num_nodes=2"])
    assert trainer_request(config) == {"CPU": 1.0, "GPU": 0.5, "trainer_node": 1.0}
    # custom resources: detached only
    assert maker_request(config, detached=False) == {"CPU": 0.5, "GPU": 0.25}
    requests = launch_requests(config, "t", ["m0", "m1"], ["reward"])
    assert requests == {"trainer t": trainer_request(config), "maker m0": maker_request(config),
                        "maker m1": maker_request(config), "reward scorer rw_0": {"CPU": 1.0},
                        "reward scorer rw_1": {"CPU": 1.0}}
    options = _options("m0", config, True, maker_request(config))
    assert (options["num_cpus"], options["num_gpus"],
            options["resources"]) == (0.5, 0.25, {"maker_node": 1.0})
    options = _options("t", config, False, trainer_request(config, detached=False))
    assert (options["num_cpus"], options["num_gpus"], "resources" in options) == (1.0, 0.5, False)
    group = load_config(None, ["trainer_group.strategy=ddp", "trainer_group.world_size=2",
                               "trainer_group.num_gpus_per_rank=1"])
    assert launch_requests(group, "g") == {"trainer rank g_0": {"CPU": 1.0, "GPU": 1.0},
                                           "trainer rank g_1": {"CPU": 1.0, "GPU": 1.0}}


def test_cli_flags_set_the_gpus():
    parser = build_parser()
    maker = _config(parser.parse_args(["maker", "--name", "m", "--trainers", "t", "--num-gpus", "0.5"]))
    assert maker.maker.num_gpus == 0.5
    trainer = _config(parser.parse_args(["trainer", "--name", "t", "--num-gpus-per-rank", "1"]))
    assert trainer.trainer_group.num_gpus_per_rank == 1
    assert parser.parse_args(["run", "--gpus", "manual"]).gpus == "manual"
    with pytest.raises(ConfigError, match="maker.num_gpus: must be a fraction"):
        _config(parser.parse_args(["maker", "--name", "m", "--trainers", "t", "--num-gpus", "1.5"]))
