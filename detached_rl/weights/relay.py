"""Who relays a weight update to whom: a tree over the makers, so that a version leaves the trainer's host
about once instead of once per maker (issue 37).

A relay streams: when the trainer offers an update, its push queue asks each relay for a copy of the pieces
the relay's own parent serves (`weights.ray_wire.relay_copy`: one task per piece on the relay, which pulls
the piece across its link once and returns it, stored on its node) and sends every maker its update at
once: the trainer's to the roots, the relay's copy to its children, who pull each piece from the relay's
host as soon as it landed there and check it as they check any update (the manifest, its checksums and base
are the trainer's). Plain code: the push queue's `RelayPlanner` builds the tree with `relay_tree` at each
offer.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import Any

from detached_rl.weights.update import WeightUpdate

logger = logging.getLogger(__name__)
Copy = Callable[[str, WeightUpdate, str], WeightUpdate]  # (relay, update, its host) -> its streaming copy


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


def routes(update: WeightUpdate, tree: Mapping[str, str], copy: Copy,
           planner: RelayPlanner) -> dict[str, WeightUpdate]:
    """child -> the copy of `update` it is sent, for the children of `tree` (child -> relay): its relay's copy
    of what the relay itself is served (`copy(relay, what, host)`, asked once per relay). A relay that cannot
    copy (no such actor now) is distrusted, and its children are left out: they take `update` itself."""
    copies: dict[str, WeightUpdate | None] = {}  # relay -> its copy (None: it cannot copy)

    def served(maker: str) -> WeightUpdate | None:
        parent = tree.get(maker)
        if parent is None:
            return update
        if parent not in copies:
            source = served(parent) or update
            try:
                copies[parent] = copy(parent, source, planner.hosts.get(parent, "?"))
            except Exception as error:  # noqa: BLE001 - no such actor now: its children from the trainer
                logger.warning("maker %r cannot relay weight update v%d: %s", parent, update.manifest.version,
                               error)
                planner.distrust(parent)
                copies[parent] = None
        return copies[parent]

    return {child: copied for child in tree if (copied := served(child)) is not None}


class RelayPlanner:
    """What the push queue knows to plan relays with, and the tree at each offer (`tree`).

    A maker's host is what it answers itself (`ask`, e.g. its `transfer_progress`: {"host": ...}), asked
    without waiting, so an offer never waits for a maker: a maker relays or is relayed to once it has
    answered. Hosts are ranked by how fast their makers receive (`estimate`): `rates`, the fastest a maker
    received at lately from the trainer itself (each new figure, or the last one decayed by `RATE_DECAY`,
    whichever is higher); a maker only ever relayed to receives at its relay's pace, which says little about
    its own link: while its rate is within `CAPPED` of its relay's, it counts as untried and is tried first
    (at the root), once; a maker clearly slower than its relay is ranked by its own rate. A relay whose copy
    failed a maker relays for none for `DISTRUST_S` s.
    """

    RATE_DECAY = 0.8
    CAPPED = 0.9
    DISTRUST_S = 120.0

    def __init__(self, fanout: int, origin: str | None,
                 ask: Callable[[str], Future[Mapping[str, Any] | None]] | None, min_bytes: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 0:
            raise ValueError(f"relay fanout must be an int >= 0 (0: no relaying), got {fanout!r}")
        self.fanout, self.origin, self.ask, self.clock = fanout, origin, ask, clock
        self.min_bytes = min_bytes  # smaller updates are not relayed
        self.hosts: dict[str, str] = {}
        self.rates: dict[str, float] = {}  # maker -> bytes/s from the trainer itself (decayed max)
        self.relayed: dict[str, tuple[float, bool]] = {}  # maker -> (bytes/s from its relay, at its pace)
        self.distrusted: dict[str, float] = {}  # maker -> until when it relays for none
        self._asked: dict[str, Future] = {}
        self._lock = threading.Lock()

    def record(self, maker: str, size: int, seconds: float, via: str | None = None) -> None:
        """`maker` acknowledged `size` bytes pulled in `seconds`, from the trainer or from relay `via`."""
        if size <= 0 or seconds <= 0:
            return
        rate = size / seconds
        with self._lock:
            if via is None:
                self.rates[maker] = max(rate, self.rates.get(maker, 0.0) * self.RATE_DECAY)
            else:
                self.relayed[maker] = (rate, rate >= self.CAPPED * self._estimate(via))

    def estimate(self, maker: str) -> float:
        """How fast `maker` receives, for ranking its host (inf: untried, see the class docstring)."""
        with self._lock:
            return self._estimate(maker)

    def _estimate(self, maker: str) -> float:
        rate, capped = self.relayed.get(maker, (0.0, True))
        direct = self.rates.get(maker)
        if direct is None:
            return math.inf if capped else rate
        return max(direct, rate)

    def forget(self, maker: str) -> None:
        """`maker` failed or went: where it is is asked again (a restarted actor may be elsewhere)."""
        with self._lock:
            self.hosts.pop(maker, None)
            self._asked.pop(maker, None)

    def tell(self, maker: str, host: str) -> None:
        """`maker` said it is on `host` (when it registered)."""
        with self._lock:
            self.hosts[maker] = host

    def distrust(self, maker: str) -> None:
        """A copy `maker` relayed failed: it relays for none for a while, and its host is asked again."""
        with self._lock:
            already = self.distrusted.get(maker, -math.inf) > self.clock()
            self.distrusted[maker] = self.clock() + self.DISTRUST_S
        if not already:  # a silent maker is distrusted again at every watch pass: its host asked once
            self.forget(maker)

    def learn(self, makers: Iterable[str]) -> None:
        """Ask the makers whose hosts are not known yet where they are (without waiting)."""
        if self.fanout == 0 or self.ask is None:
            return
        with self._lock:
            for maker in makers:
                if maker not in self.hosts:
                    self._learn_host(maker)

    def tree(self, makers: list[str], size: int | None = None) -> dict[str, str]:
        """child -> relay among `makers` for the next offer (of `size` bytes: none below `min_bytes`)."""
        if self.fanout == 0 or len(makers) < 2 or size is not None and size < self.min_bytes:
            return {}
        self.learn(makers)
        with self._lock:
            now = self.clock()
            hosts = {maker: None if self.distrusted.get(maker, 0.0) > now else self.hosts.get(maker)
                     for maker in makers}
            rates = {maker: self._estimate(maker) for maker in makers}
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
