"""Makers relaying weight updates to one another (`weights.relay`, `WeightPushQueue(relay_fanout=...)`), no
Ray: who relays to whom, a relay's copy reaching its children, and the trainer's own update reaching them when
the relay fails or goes."""

from __future__ import annotations

from concurrent.futures import Future

from detached_rl.weights.push_queue import WeightPushQueue
from detached_rl.weights.relay import RelayPlanner, relay_tree
from detached_rl.weights.update import ApplyResult, WeightManifest, WeightUpdate

HOSTS = {"a": "10.0.0.2", "b": "10.0.0.3", "c": "10.0.0.4", "d": "10.0.0.5", "t": "10.0.0.1"}


def update(version: int, kind: str = "lora") -> WeightUpdate:
    return WeightUpdate(WeightManifest(version=version, kind=kind, tensors=(), num_chunks=0, total_bytes=0),
                        ["trainer's chunk"])


def test_the_fastest_host_relays_slow_ones_are_leaves_and_the_trainers_host_takes_its_own() -> None:
    rates = {"a": 1e6, "b": 5e6, "c": 2e5, "d": 3e6}
    # fanout 1: a chain, fastest first (b, d, a, c)
    assert relay_tree("abcd", HOSTS, rates, "10.0.0.1", 1) == {"d": "b", "a": "d", "c": "a"}
    # fanout 2: a heap, b at the root
    assert relay_tree("abcd", HOSTS, rates, "10.0.0.1", 2) == {"d": "b", "a": "b", "c": "d"}
    assert relay_tree("abcd", HOSTS, rates, "10.0.0.1", 0) == {}
    # on the trainer's host, or where unknown: from the trainer; a second maker on a host: from the first
    hosts = {**HOSTS, "t": "10.0.0.1", "e": "10.0.0.3", "u": None}
    assert relay_tree(["t", "b", "e", "u", "a"], hosts, rates, "10.0.0.1", 4) == {"e": "b", "a": "b"}


class Makers:
    """Records every send (maker, version, relay asked, chunk refs); each answers when the test says."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, bool, list]] = []
        self.futures: dict[str, Future] = {}

    def send(self, maker: str, weights: WeightUpdate, relay: bool = False) -> Future:
        self.sent.append((maker, weights.manifest.version, relay, list(weights.chunk_refs)))
        self.futures[maker] = Future()
        return self.futures[maker]

    def ack(self, maker: str, relayed: WeightUpdate | None = None, size: int = 0,
            seconds: float = 0.0) -> None:
        version = max(v for m, v, _, _ in self.sent if m == maker)
        self.futures.pop(maker).set_result(ApplyResult(applied=False, staged=True, version=version,
                                                       bytes=size, fetch_seconds=seconds, relayed=relayed))


def queue_of(makers: Makers, fanout: int = 4) -> WeightPushQueue:
    """A queue whose makers have answered where they are (`RelayPlanner` learns it from their answers)."""
    queue = WeightPushQueue(makers.send, timeout=60, relay_fanout=fanout, origin=HOSTS["t"])
    queue.relays.hosts.update(HOSTS)
    return queue


def test_the_relay_takes_the_trainers_update_and_its_children_take_its_copy() -> None:
    makers = Makers()
    queue = queue_of(makers)
    queue.relays.rates.update({"a": 9e6, "b": 1e6, "c": 5e5})
    queue.offer(update(1), ["a", "b", "c", "t"])
    assert makers.sent == [("a", 1, True, ["trainer's chunk"]), ("t", 1, False, ["trainer's chunk"])]
    assert queue.stats()["relaying"] == {"b": "a", "c": "a"}
    copy = WeightUpdate(update(1).manifest, ["a's copy"])
    makers.ack("a", relayed=copy, size=1000, seconds=0.5)
    queue.settle()
    assert sorted(makers.sent[2:]) == [("b", 1, False, ["a's copy"]), ("c", 1, False, ["a's copy"])]
    assert queue.relayed == 2 and queue.relays.rates["a"] == 2000.0
    assert queue.take_results()["a"].relayed is None  # the copy is not kept with the result
    for maker in ("b", "c", "t"):
        makers.ack(maker)
    assert queue.wait(1.0) and queue.acked == {"a": 1, "b": 1, "c": 1, "t": 1}


def test_children_wait_for_their_relay_and_take_the_trainers_update_when_it_fails_or_goes() -> None:
    makers = Makers()
    queue = queue_of(makers)
    queue.relays.rates.update({"a": 9e6, "b": 1e6, "c": 5e5})
    queue.offer(update(1), ["a", "b", "c"])
    assert not queue.wait(0.05, ["b"])  # a child waiting for its relay is busy: given up on after the wait
    assert queue.stats()["relaying"] == {"c": "a"} and "did not acknowledge" in queue.failures["b"]
    queue.offer(update(2), ["a", "b", "c"])  # a still has v1 in flight: v2 waits, b and c wait for its copy
    makers.futures.pop("a").set_exception(ConnectionError("a's host is gone"))
    queue.settle()
    # a's failure sends b and c the trainer's own v2 (and a its waiting v2, a relay asked again: for none)
    assert ("b", 2, False, ["trainer's chunk"]) in makers.sent and ("c", 2, False, ["trainer's chunk"]) \
        in makers.sent
    assert ("a", 2, False, ["trainer's chunk"]) in makers.sent
    makers.ack("b")
    makers.ack("c")
    queue.offer(update(3), ["a", "b", "c"])  # a busy with v2: b and c wait for a's v3 ... until a goes
    queue.forget("a")
    queue.settle()
    assert ("b", 3, False, ["trainer's chunk"]) in makers.sent and ("c", 3, False, ["trainer's chunk"]) \
        in makers.sent
    assert queue.relayed == 0


def test_deltas_and_a_queue_without_fanout_are_not_relayed() -> None:
    makers = Makers()
    queue = queue_of(makers)
    queue.offer(update(1, kind="delta"), ["a", "b"])
    assert [(m, relay) for m, _, relay, _ in makers.sent] == [("a", False), ("b", False)]
    plain = Makers()
    queue_of(plain, fanout=0).offer(update(1), ["a", "b"])
    assert [(m, relay) for m, _, relay, _ in plain.sent] == [("a", False), ("b", False)]


def test_a_makers_host_is_learned_from_its_own_answer_without_waiting_for_it() -> None:
    answers: dict[str, Future] = {}

    def ask(maker: str) -> Future:
        answers[maker] = Future()
        return answers[maker]

    planner = RelayPlanner(2, HOSTS["t"], ask)
    assert planner.tree(["a", "b"], "lora") == {} and set(answers) == {"a", "b"}  # asked, not waited for
    answers["a"].set_result({"host": HOSTS["a"], "version": None})
    answers["b"].set_exception(ConnectionError("b is restarting"))
    planner.record("a", 1000, 0.1)
    assert planner.tree(["a", "b"], "lora") == {} and planner.hosts == {"a": HOSTS["a"]}  # b asked again
    answers["b"].set_result({"host": HOSTS["b"]})
    assert planner.tree(["a", "b"], "lora") == {"b": "a"}
    planner.forget("b")
    assert "b" not in planner.hosts
