"""Several hosts on one Linux machine, for tests and people: network namespaces on one switch, each link
shaped with `tc`, each host with its own files and a Ray node (`Hosts`, `python -m detached_rl.hosts`)."""

from detached_rl.hosts.cluster import Hosts, HostsError
from detached_rl.hosts.network import Host, Network

__all__ = ["Host", "Hosts", "HostsError", "Network"]
