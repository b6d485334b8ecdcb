"""Several hosts on one Linux machine, for tests, benchmarks and people: network namespaces on one switch,
each link shaped with `tc` (its rate) and netem or a user-space wire (its delay, jitter and loss), each
host with its own files and a Ray node (`Hosts`, `python -m tests.hosts`). Test support, not part of the
installed package: nothing in `detached_rl` imports it."""

from .cluster import NODE_STARTERS, Hosts, HostsError
from .network import Host, Network
from .wire import LinkCharacter

__all__ = ["NODE_STARTERS", "Host", "Hosts", "HostsError", "LinkCharacter", "Network"]
