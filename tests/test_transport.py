"""The Ray wing's names without a cluster: the namespace actors meet in (on Ray: tests/test_actors_ray.py)."""

from __future__ import annotations

from detached_rl.actors.transport import DEFAULT_NAMESPACE, _anonymous, resolve_namespace


def test_without_ray_or_with_an_anonymous_namespace_actors_meet_in_detached_rl(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a process that never started Ray
    assert resolve_namespace(None) == DEFAULT_NAMESPACE == "detached_rl"
    assert resolve_namespace("mine") == "mine"
    assert _anonymous("0b5328b7-3bd8-47e1-a403-cbcbf8c0f697")  # what ray.init() without a namespace gets
    assert not _anonymous("detached_rl") and not _anonymous("0B5328B7-3BD8-47E1-A403-CBCBF8C0F697")
