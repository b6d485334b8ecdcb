"""A Ray node for a multi-host cluster, started as docs/multi-host.md says: token authentication on, every
port pinned, its listening sockets checked after the start; with `--bind-to-address` every socket on those
ports bound to the node's own address (and loopback), none on all interfaces."""

from detached_rl.node.listening import listening_sockets, wildcard_listeners
from detached_rl.node.shim import ADDRESS_VARIABLE, NodeError, build_bind_shim
from detached_rl.node.start import NodePorts, NodeSpec, start_node

__all__ = ["ADDRESS_VARIABLE", "NodeError", "NodePorts", "NodeSpec", "build_bind_shim", "listening_sockets",
           "start_node", "wildcard_listeners"]
