"""Placement by node labels without a cluster: the config keys, their checks (as Ray's own), matching
nodes, and what the launch code asks Ray for. On a labelled multi-node cluster: test_multihost_jobs.py."""

from __future__ import annotations

import pytest
from ray._private.label_utils import validate_label_selector

from detached_rl.actors.launch import _options, launch_selectors, maker_request
from detached_rl.config import ConfigError, load_config
from detached_rl.core.labels import check_label_selector, matches, unmatched

CONDITIONS = ["maker", "!maker", "in(a,b)", "in(a, b)", "!in(a,b,c)", "a-b.c_d", "x" * 63, "(a)",
              "", "-a", "a-", "in(a,,b)", "in()", "in(a,b", "a b", "!!a", "x" * 64, "in(a!b)", "*"]
KEYS = ["role", "ray.io/zone", "example.com/gpu-kind", "a_b", "-role", "role-", "a/b/c", "a b"]


@pytest.mark.parametrize("condition", CONDITIONS)
def test_conditions_are_taken_as_ray_takes_them(condition):
    ray_error = validate_label_selector({"role": condition})
    if ray_error is not None or condition == "":  # Ray takes an empty one; it says nothing: refused here
        with pytest.raises(ValueError, match=r"MakerConfig.label_selector.role: .* is not a label condition"):
            check_label_selector({"role": condition}, "MakerConfig.label_selector")
    else:
        check_label_selector({"role": condition}, "MakerConfig.label_selector")


@pytest.mark.parametrize("key", KEYS)
def test_keys_are_taken_as_ray_takes_them(key):
    if validate_label_selector({key: "v"}) is not None:
        with pytest.raises(ValueError, match="is not a node-label key"):
            check_label_selector({key: "v"}, "x")
    else:
        check_label_selector({key: "v"}, "x")


def test_the_config_keys_refuse_bad_selectors_naming_the_field():
    config = load_config(None, ["maker.label_selector={role: maker}",
                                'trainer_group.label_selector={zone: "in(east,west)", gpu: "!none"}'])
    assert config.maker.label_selector == {"role": "maker"}
    assert config.trainer_group.label_selector == {"zone": "in(east,west)", "gpu": "!none"}
    default = load_config(None, [])
    assert default.maker.label_selector == {} == default.trainer_group.label_selector
    for override, field in (("maker.label_selector={role: 'a b'}", "MakerConfig.label_selector.role"),
                            ("trainer_group.label_selector={zone: 3}", "trainer_group.label_selector.zone"),
                            ("maker.label_selector=[role]", "maker.label_selector"),
                            ("trainer_group.label_selector=maker", "trainer_group.label_selector")):
        with pytest.raises(ConfigError, match=f"{field}[:)]? "):
            load_config(None, [override])


def test_a_node_matches_every_condition_or_none():
    node = {"role": "maker", "zone": "east", "ray.io/node-id": "abc"}
    assert matches({"role": "maker", "zone": "east"}, node)
    assert not matches({"role": "maker", "zone": "west"}, node)
    assert matches({"zone": "in(west, east)"}, node) and not matches({"zone": "!in(west,east)"}, node)
    assert matches({"gpu": "!a100"}, node) and not matches({"gpu": "a100"}, node)  # a label the node lacks
    assert matches({}, node)


def test_a_selector_no_alive_node_matches_is_named_with_the_nodes_labels():
    nodes = [{"role": "trainer", "ray.io/node-id": "1"}, {"role": "maker", "ray.io/node-id": "2"}]
    assert unmatched({"maker m0": {"role": "maker"}, "trainer t": {}}, nodes) is None
    assert unmatched({"maker m0": {"role": "gpu"}}, nodes) == (
        "maker m0 asks for a node with labels role=gpu; no alive node carries them (the nodes' labels: "
        "role=maker, role=trainer)")
    assert "the nodes' labels: none" in unmatched({"maker m0": {"role": "gpu"}}, [{}])


def test_the_launch_asks_ray_for_the_labels_only_when_placed():
    config = load_config(None, ["maker.label_selector={role: maker}", "maker.resources={maker_host: 1}",
                                "trainer_group.label_selector={role: trainer}"])
    assert launch_selectors(config, "t", ["m0", "m1"]) == {
        "trainer t": {"role": "trainer"}, "maker m0": {"role": "maker"}, "maker m1": {"role": "maker"}}
    group = load_config(None, ["trainer_group.strategy=ddp", "trainer_group.world_size=2",
                               "trainer_group.label_selector={role: trainer}"])
    assert set(launch_selectors(group, "g")) == {"trainer rank g_0", "trainer rank g_1"}
    assert launch_selectors(load_config(None, []), "t", ["m0"]) == {}
    options = _options("m0", config, False, maker_request(config, True), config.maker.label_selector)
    assert options["label_selector"] == {"role": "maker"} and options["resources"] == {"maker_host": 1.0}
    assert "lifetime" not in options  # placed by the config, yet owned by its driver (`run --address`)
    options = _options("m0", config, False, maker_request(config, False))
    assert "label_selector" not in options and "resources" not in options
