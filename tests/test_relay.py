"""Makers relaying weight updates to one another (`weights.relay`, `WeightPushQueue(relay_fanout=...)`), no
Ray: who relays to whom, every maker sent its update at once (a relay's children its streaming copy), and the
trainer's own update reaching a maker whose relay's copy failed."""

from __future__ import annotations

from concurrent.futures import Future

from detached_rl.weights.push_queue import WeightPushQueue
from detached_rl.weights.relay import RelayPlanner, relay_tree
from detached_rl.weights.update import ApplyResult, WeightManifest, WeightUpdate

HOSTS = {"a": "10.0.0.2", "b": "10.0.0.3", "c": "10.0.0.4", "d": "10.0.0.5", "t": "10.0.0.1"}


def update(version: int, kind: str = "lora") -> WeightUpdate:
    return WeightUpdate(WeightManifest(version=version, kind=kind, tensors=(), num_chunks=0, total_bytes=0),
                        ["trainer"])


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
    """Records every send (maker, version, chunk refs) and every relay copy asked; each maker answers when the
    test says; a relay's copy is `<relay>(<what it copies>)`."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, list]] = []
        self.futures: dict[str, Future] = {}
        self.copies: list[tuple[str, int, str]] = []
        self.gone: set[str] = set()

    def send(self, maker: str, weights: WeightUpdate) -> Future:
        self.sent.append((maker, weights.manifest.version, list(weights.chunk_refs)))
        self.futures[maker] = Future()
        return self.futures[maker]

    def relay(self, relay: str, weights: WeightUpdate, host: str) -> WeightUpdate:
        if relay in self.gone:
            raise LookupError(f"no maker named {relay!r}")
        self.copies.append((relay, weights.manifest.version, host))
        return WeightUpdate(weights.manifest, [f"{relay}({ref})" for ref in weights.chunk_refs])

    def ack(self, maker: str, size: int = 0, seconds: float = 0.0) -> None:
        version = max(v for m, v, _ in self.sent if m == maker)
        self.futures.pop(maker).set_result(ApplyResult(applied=False, staged=True, version=version,
                                                       bytes=size, fetch_seconds=seconds))

    def fail(self, maker: str, error: BaseException) -> None:
        self.futures.pop(maker).set_exception(error)


def queue_of(makers: Makers, fanout: int = 2) -> WeightPushQueue:
    """A queue whose makers have answered where they are (`RelayPlanner` learns it from their answers)."""
    queue = WeightPushQueue(makers.send, timeout=60, relay_fanout=fanout, origin=HOSTS["t"],
                            relay=makers.relay)
    queue.relays.hosts.update(HOSTS)
    return queue


def test_every_maker_is_sent_at_once_the_root_the_trainers_update_the_others_their_relays_streaming_copy(
) -> None:
    makers = Makers()
    queue = queue_of(makers, fanout=1)
    queue.relays.rates.update({"a": 9e6, "b": 1e6, "c": 5e5})
    queue.offer(update(1), ["a", "b", "c", "t"])  # a chain: a -> b -> c; t shares the trainer's host
    assert sorted(makers.sent) == [("a", 1, ["trainer"]), ("b", 1, ["a(trainer)"]),
                                   ("c", 1, ["b(a(trainer))"]), ("t", 1, ["trainer"])]
    assert makers.copies == [("a", 1, HOSTS["a"]), ("b", 1, HOSTS["b"])]  # each relay's copy asked once
    assert queue.stats()["relay_tree"] == {"b": "a", "c": "b"} and queue.relayed == 2
    makers.ack("a", size=1000, seconds=0.5)
    for maker in ("b", "c", "t"):
        makers.ack(maker)
    assert queue.wait(1.0) and queue.acked == {"a": 1, "b": 1, "c": 1, "t": 1}
    assert queue.relays.rates["a"] == 9e6 * RelayPlanner.RATE_DECAY  # the fastest lately, decayed


def test_a_failed_copy_sends_the_trainers_own_update_and_its_relay_relays_for_none_for_a_while() -> None:
    makers = Makers()
    now = [0.0]
    queue = queue_of(makers)
    queue.relays.clock = lambda: now[0]
    queue.relays.rates.update({"a": 9e6, "b": 1e6, "c": 5e5})
    queue.offer(update(1), ["a", "b", "c"])
    assert queue.stats()["relay_tree"] == {"b": "a", "c": "a"}
    makers.fail("a", ConnectionError("a's host is gone"))
    makers.fail("b", RuntimeError("relayed piece lost"))  # the copy failed: not b's failure
    queue.settle()
    assert makers.sent[-1] == ("b", 1, ["trainer"]) and "b" not in queue.failures and "a" in queue.failures
    assert queue.relay_fallbacks == 1 and queue.stats()["in_flight"] == {"b": 1, "c": 1}
    makers.ack("b")
    makers.fail("c", RuntimeError("relayed piece lost"))
    queue.settle()
    makers.fail("c", ConnectionError("c is gone too"))  # the trainer's own failed as well: c's failure
    assert queue.relay_fallbacks == 2 and "c is gone too" in queue.failures["c"]
    queue.relays.hosts.update(HOSTS)  # a answered again where it is, but relays for none yet
    queue.offer(update(2), ["a", "b", "c"])
    assert queue.stats()["relay_tree"] == {"c": "b"}
    now[0] += RelayPlanner.DISTRUST_S + 1
    for maker in ("a", "b", "c"):
        makers.ack(maker)
    queue.offer(update(3), ["a", "b", "c"])
    assert queue.stats()["relay_tree"] == {"b": "a", "c": "a"}


def test_a_relay_that_cannot_copy_and_a_waiting_copy_superseded_by_the_trainers_update() -> None:
    makers = Makers()
    queue = queue_of(makers)
    queue.relays.rates.update({"a": 9e6, "b": 1e6})
    makers.gone.add("a")
    queue.offer(update(1), ["a", "b"])  # no relay "a" now: b is sent the trainer's own
    assert sorted(makers.sent) == [("a", 1, ["trainer"]), ("b", 1, ["trainer"])] and queue.tree == {}
    makers.gone.clear()
    queue.relays.distrusted.clear()
    queue.relays.hosts.update(HOSTS)
    queue.offer(update(2), ["a", "b"])  # both busy: v2 waits, b's as a's copy
    assert queue.stats()["waiting"] == {"a": 2, "b": 2}
    makers.ack("b")
    queue.settle()
    assert makers.sent[-1] == ("b", 2, ["a(trainer)"])
    queue.offer(update(3), ["a", "b"])  # b busy with a's copy of v2: a's copy of v3 waits
    makers.fail("b", RuntimeError("relayed piece lost"))  # the newer one waiting is sent, not v2 again ...
    queue.settle()
    assert [(v, refs) for m, v, refs in makers.sent if m == "b"] == [
        (1, ["trainer"]), (2, ["a(trainer)"]), (3, ["trainer"])]  # ... and not through a (its copy failed)
    assert queue.relay_fallbacks == 1 and "b" not in queue.failures


def test_a_silent_relay_relays_for_none_and_what_waits_for_its_copy_takes_the_trainers() -> None:
    makers = Makers()
    now = [0.0]
    silent: dict[str, str] = {}

    class Liveness:
        def check(self, known: list[str]) -> None:
            pass

        def silent(self) -> dict[str, str]:
            return silent

    queue = WeightPushQueue(makers.send, timeout=60, relay_fanout=2, origin=HOSTS["t"], relay=makers.relay,
                            progress=lambda maker: Future(), watch=False, liveness=Liveness())  # type: ignore
    queue.relays.clock = lambda: now[0]
    queue.relays.hosts.update(HOSTS)
    queue.relays.rates.update({"a": 9e6, "b": 1e6})
    queue.offer(update(1), ["a", "b"])
    queue.offer(update(2), ["a", "b"])  # both busy: b's v2 waits as a's copy
    silent["a"] = "no answer for 16 s"  # a's host vanished
    queue.check()
    assert queue.stats()["waiting"] == {"a": 2, "b": 2} and queue._waiting["b"].via is None
    makers.ack("b")
    queue.settle()
    assert makers.sent[-1] == ("b", 2, ["trainer"])
    queue.relays.hosts.update(HOSTS)
    assert queue.relays.tree(["a", "b"]) == {}  # a relays for none


def test_a_maker_relayed_to_at_its_relays_pace_is_tried_at_the_root_and_a_slower_one_stays_a_leaf() -> None:
    planner = RelayPlanner(1, HOSTS["t"], None)
    planner.hosts.update(HOSTS)
    planner.record("a", 2_000_000, 1.0)  # a took versions from the trainer at 2 MB/s
    planner.record("b", 1_900_000, 1.0, via="a")  # b kept up with a: its own link may be faster
    planner.record("c", 600_000, 1.0, via="a")  # c did not: its own link is the slower
    assert [planner.estimate(m) for m in "abc"] == [2e6, float("inf"), 6e5]
    assert planner.tree(["a", "b", "c"]) == {"a": "b", "c": "a"}  # a chain (fanout 1): b, a, c
    planner.record("b", 8_000_000, 1.0)  # b from the trainer itself: 8 MB/s, the root from now on
    planner.record("a", 1_950_000, 1.0, via="b")
    assert planner.tree(["a", "b", "c"]) == {"a": "b", "c": "a"} and planner.estimate("a") == 2e6


def test_no_relaying_without_fanout_without_a_relay_function_or_for_small_updates() -> None:
    small = Makers()
    queue = WeightPushQueue(small.send, timeout=60, relay_fanout=2, relay_min_bytes=1000, origin=HOSTS["t"],
                            relay=small.relay)
    queue.relays.hosts.update(HOSTS)
    queue.offer(update(1), ["a", "b"])  # 0 bytes < 1000
    assert sorted(small.sent) == [("a", 1, ["trainer"]), ("b", 1, ["trainer"])] and not small.copies
    plain = Makers()
    queue_of(plain, fanout=0).offer(update(1), ["a", "b"])
    assert sorted(plain.sent) == [("a", 1, ["trainer"]), ("b", 1, ["trainer"])] and not plain.copies
    alone = Makers()
    queue = WeightPushQueue(alone.send, timeout=60, relay_fanout=2, origin=HOSTS["t"])
    queue.relays.hosts.update(HOSTS)
    queue.offer(update(1), ["a", "b"])
    assert not alone.copies and queue.relays.fanout == 0


def test_a_makers_host_is_learned_from_its_own_answer_without_waiting_for_it() -> None:
    answers: dict[str, Future] = {}

    def ask(maker: str) -> Future:
        answers[maker] = Future()
        return answers[maker]

    planner = RelayPlanner(2, HOSTS["t"], ask)
    planner.learn(["a", "b"])
    assert planner.tree(["a", "b"]) == {} and set(answers) == {"a", "b"}  # asked, not waited for
    answers["a"].set_result({"host": HOSTS["a"], "version": None})
    answers["b"].set_exception(ConnectionError("b is restarting"))
    planner.record("a", 1000, 0.1)
    assert planner.tree(["a", "b"]) == {} and planner.hosts == {"a": HOSTS["a"]}  # b asked again
    answers["b"].set_result({"host": HOSTS["b"]})
    assert planner.tree(["a", "b"]) == {"a": "b"}  # b, untried, is tried at the root
    planner.record("b", 1000, 0.2)
    assert planner.tree(["a", "b"]) == {"b": "a"}  # a is the faster from the trainer itself
    planner.record("a", 1000, 1.0)  # slower now: the fastest lately, decayed, until it is slower still
    assert planner.rates["a"] == 10_000 * RelayPlanner.RATE_DECAY
    planner.forget("b")
    assert "b" not in planner.hosts
