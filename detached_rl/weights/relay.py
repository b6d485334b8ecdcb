"""Who relays a weight update to whom: a tree over the makers, so that a version leaves the trainer's host
about once instead of once per maker (issue 37).

The trainer sends an update to the tree's roots; a maker with children keeps its own copy of what it pulled
(`weights.ray_wire.relay_update`) and the trainer's push queue hands that copy to its children, who pull it
from the relay's host and check it as they check any update (the manifest, its checksums and base are the
trainer's). Plain code: the push queue's `RelayPlanner` builds the tree with `relay_tree` at each offer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any


def relay_tree(makers: Iterable[str], hosts: Mapping[str, str | None], rates: Mapping[str, float],
               origin: str | None, fanout: int) -> dict[str, str]:
    """child -> parent for the makers that take an update from another maker; the rest take it from the
    trainer.

    `hosts`: each maker's node address (None: unknown); `origin`: the trainer's; `rates`: bytes/s each maker
    received its last update at (a measure of its link); `fanout`: children per relay (0: no relaying).
    Makers on the trainer's host or on an unknown one take it from the trainer (nothing to save, or nothing
    known). On every other host one maker takes it for the host, the others from that one (a copy on the same
    node crosses no link). Across hosts, the hosts' makers are ordered fastest first and laid out as a heap:
    the fastest takes it from the trainer, and host i's from host (i - 1) // fanout's, so slow links are
    leaves and never delay a fast one.
    """
    if fanout <= 0:
        return {}
    first_on: dict[str, str] = {}
    tree: dict[str, str] = {}
    ordered = sorted(makers, key=lambda maker: (-rates.get(maker, 0.0), maker))
    for maker in ordered:
        host = hosts.get(maker)
        if host is None or host == origin:
            continue
        if host in first_on:
            tree[maker] = first_on[host]
        else:
            first_on[host] = maker
    relays = list(first_on.values())  # one per host, fastest first
    for index in range(1, len(relays)):
        tree[relays[index]] = relays[(index - 1) // fanout]
    return tree


class RelayPlanner:
    """What the push queue knows to plan relays with, and the tree at each offer (`tree`).

    A maker's host is what it answers itself (`ask`, e.g. its `transfer_progress`: {"host": ...}), asked
    without waiting, so an offer never waits for a maker: a maker relays or is relayed to once it has
    answered. Its rate is the bytes/s of its last acknowledged transfer (`record`).
    """

    def __init__(self, fanout: int, origin: str | None,
                 ask: Callable[[str], Future[Mapping[str, Any] | None]] | None) -> None:
        if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 0:
            raise ValueError(f"relay fanout must be an int >= 0 (0: no relaying), got {fanout!r}")
        self.fanout, self.origin, self.ask = fanout, origin, ask
        self.hosts: dict[str, str] = {}
        self.rates: dict[str, float] = {}
        self._asked: dict[str, Future] = {}
        self._lock = threading.Lock()

    def record(self, maker: str, size: int, seconds: float) -> None:
        """`maker` acknowledged `size` bytes pulled in `seconds`."""
        if size > 0 and seconds > 0:
            with self._lock:
                self.rates[maker] = size / seconds

    def forget(self, maker: str) -> None:
        """`maker` failed or went: where it is is asked again (a restarted actor may be elsewhere)."""
        with self._lock:
            self.hosts.pop(maker, None)
            self._asked.pop(maker, None)

    def tree(self, makers: list[str], kind: str) -> dict[str, str]:
        """child -> relay among `makers` for an update of `kind` (none for a delta: its base is per maker)."""
        if self.fanout == 0 or kind == "delta" or len(makers) < 2:
            return {}
        with self._lock:
            for maker in makers:
                if maker not in self.hosts and self.ask is not None:
                    self._learn_host(maker)
            hosts, rates = {maker: self.hosts.get(maker) for maker in makers}, dict(self.rates)
        return relay_tree(makers, hosts, rates, self.origin, self.fanout)

    def _learn_host(self, maker: str) -> None:
        """Take `maker`'s answer if it came, else ask (again); hold `_lock`."""
        asked = self._asked.get(maker)
        if asked is not None and not asked.done():
            return
        answer = asked.result() if asked is not None and asked.exception() is None else None
        if isinstance(answer, Mapping) and answer.get("host"):
            self.hosts[maker] = str(answer["host"])
            return
        try:
            self._asked[maker] = self.ask(maker)  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - no such actor now: asked again at the next offer
            self._asked.pop(maker, None)
