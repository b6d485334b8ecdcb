"""A host's link with delay, jitter and loss, where the kernel has no netem: a user-space wire between two TAP
devices (the host's `eth0` and its port on the bridge) that holds each frame for the link's delay (plus
jitter, in order) and drops a fraction of them. The link's rate stays `tbf` on both devices, as on a veth.

Run by `Network` inside the switch's namespace (`python wire.py PORT HOSTSIDE CHARACTER_FILE`): it opens both
TAPs, prints `ready`, forwards until SIGTERM (the TAPs vanish with it) and re-reads the character file on
SIGHUP. Only the standard library: it runs by path, outside the package.
"""

from __future__ import annotations

import collections
import fcntl
import json
import os
import random
import select
import signal
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
MAX_FRAME = 65536


@dataclass(frozen=True)
class LinkCharacter:
    """What a host's link does to each frame, each way: `delay_ms` one-way latency, `jitter_ms` spread of it
    (uniform within +-jitter, frames kept in order), `loss` the fraction of frames dropped (0..1)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError(f"link: delay_ms={self.delay_ms}, jitter_ms={self.jitter_ms}: must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"link: loss={self.loss}: a fraction in [0, 1)")

    @property
    def plain(self) -> bool:
        """True when the link neither delays nor drops (a veth does that)."""
        return self.delay_ms == 0 and self.jitter_ms == 0 and self.loss == 0

    def to_json(self) -> str:
        """The character file's text."""
        return json.dumps(asdict(self))


def release_time(now: float, character: LinkCharacter, previous: float, rng: random.Random) -> float | None:
    """When a frame that arrived at `now` leaves the wire (seconds, monotonic), or None when the link loses
    it; never before `previous`, the release of the frame ahead of it (a link does not reorder)."""
    if character.loss and rng.random() < character.loss:
        return None
    delay = character.delay_ms
    if character.jitter_ms:
        delay += rng.uniform(-character.jitter_ms, character.jitter_ms)
    return max(now + max(delay, 0.0) / 1000.0, previous)


def netem_args(character: LinkCharacter, rate_mbit: float | None) -> list[str]:
    """`tc` arguments of the same link as a netem qdisc (kernels that have it)."""
    args = ["netem", "delay", f"{character.delay_ms}ms"]
    if character.jitter_ms:
        args.append(f"{character.jitter_ms}ms")
    if character.loss:
        args += ["loss", f"{character.loss * 100:.4f}%"]
    if rate_mbit is not None:
        args += ["rate", f"{int(rate_mbit * 1e6)}bit"]
    return args


def open_tap(name: str) -> int:
    """A non-blocking fd on a new TAP device `name` (no packet-info header); the device lives while it is
    open."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Wire:
    """Forwards frames both ways between two fds, each way through `release_time`."""

    def __init__(self, a: int, b: int, character: LinkCharacter, seed: int = 0) -> None:
        self.fds = (a, b)
        self.character = character
        self.rng = random.Random(seed)
        # per direction (0: a to b, 1: b to a): frames waiting for their release, in release order
        self.pending: tuple[collections.deque, collections.deque] = (collections.deque(), collections.deque())
        self.last_release = [0.0, 0.0]
        self.counts = {"forwarded": 0, "lost": 0, "failed": 0}
        self.running = True

    def _read(self, direction: int) -> None:
        source = self.fds[direction]
        for _ in range(256):  # a burst at a time, then the other direction gets its turn
            try:
                frame = os.read(source, MAX_FRAME)
            except BlockingIOError:
                return
            except OSError:
                return  # the device went down (its cable out): nothing to read
            release = release_time(time.monotonic(), self.character, self.last_release[direction], self.rng)
            if release is None:
                self.counts["lost"] += 1
                continue
            self.last_release[direction] = release
            self.pending[direction].append((release, frame))

    def _release(self, now: float) -> None:
        for direction, queue in enumerate(self.pending):
            target = self.fds[1 - direction]
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                try:
                    os.write(target, frame)
                    self.counts["forwarded"] += 1
                except OSError:  # the device is down or its queue is full: the frame is lost
                    self.counts["failed"] += 1

    def run(self) -> None:
        """Forward until `running` is cleared (SIGTERM)."""
        poller = select.poll()
        for fd in self.fds:
            poller.register(fd, select.POLLIN)
        while self.running:
            now = time.monotonic()
            self._release(now)
            due = [queue[0][0] for queue in self.pending if queue]
            timeout_ms = max(0.0, (min(due) - time.monotonic()) * 1000.0) if due else 200.0
            try:
                events = poller.poll(timeout_ms)
            except InterruptedError:
                continue
            for fd, _ in events:
                self._read(self.fds.index(fd))


def main(argv: list[str]) -> int:
    """`wire.py PORT HOSTSIDE CHARACTER_FILE [SEED]`: TAP `PORT` (the bridge's side) and TAP `HOSTSIDE` (moved
    into the host as its eth0 by the caller), joined through the character in CHARACTER_FILE."""
    port, host_side, path = argv[0], argv[1], Path(argv[2])
    seed = int(argv[3]) if len(argv) > 3 else 0
    wire = Wire(open_tap(host_side), open_tap(port), LinkCharacter(**json.loads(path.read_text())), seed)

    def reload(*_: object) -> None:
        wire.character = LinkCharacter(**json.loads(path.read_text()))

    def stop(*_: object) -> None:
        wire.running = False

    signal.signal(signal.SIGHUP, reload)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    wire.run()
    print(json.dumps(wire.counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
