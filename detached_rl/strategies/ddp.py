"""The DDP strategy: `DistributedDataParallel` over gloo (CPU) or NCCL (GPU), one process per rank."""

from __future__ import annotations

import gc
import math
import os
import socket
import warnings
import weakref
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from detached_rl.strategies.base import Strategy

BACKENDS = ("gloo", "nccl")
# reduce_metrics adds keys ending in one of these instead of averaging them.
SUM_SUFFIXES = ("samples", "tokens")


def find_free_port() -> int:
    """A TCP port that is free on this machine right now (another process may still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def node_address() -> str:
    """This machine's address as peers see it; 127.0.0.1 when the host name does not resolve.

    The host name may resolve to a loopback or private-only address on some machines; inside a
    Ray actor use `ray.util.get_node_ip_address()` instead, which is the address Ray itself uses.
    """
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def listen_on(address: str, port: int) -> socket.socket:
    """A TCP socket listening on `address`:`port` only (not on every interface)."""
    try:
        family, kind, protocol, _, socket_address = socket.getaddrinfo(address, port,
                                                                       type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind, protocol)
    except OSError as error:
        raise RuntimeError(f"DDPStrategy.master_addr {address!r} does not resolve: {error}") from error
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(socket_address)
        listener.listen()
    except OSError as error:
        listener.close()
        raise RuntimeError(
            f"rank 0 cannot listen on DDPStrategy.master_addr {address!r}, master_port {port} ({error}): "
            "master_addr must be an address of rank 0's own machine and the port free there"
        ) from error
    return listener


class DDPStrategy(Strategy):
    """Data-parallel training: each rank holds a replica and DDP averages gradients during backward.

    Every rank builds the strategy with the same `world_size`, `master_addr` and `master_port`
    (rank 0's node address and a port free there) and its own `rank`. Models are wrapped by
    `prepare_model`, which joins the process group on first use.
    """

    name = "ddp"

    def __init__(
        self,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        backend: str | None = None,
        timeout_s: float = 300.0,
        device: torch.device | str | None = None,
        find_unused_parameters: bool = False,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"DDPStrategy.world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"DDPStrategy.rank must be an int in [0, {world_size}), got {rank!r}")
        if not isinstance(master_addr, str) or not master_addr.strip():
            raise ValueError("DDPStrategy.master_addr must be a non-empty host name or address, got "
                             f"{master_addr!r}")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or not 0 < master_port < 65536:
            raise ValueError(f"DDPStrategy.master_port must be an int in [1, 65535], got {master_port!r}")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend not in BACKENDS:
            raise ValueError(f"DDPStrategy.backend must be one of {BACKENDS} or None, got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("DDPStrategy.backend 'nccl' needs CUDA, which is not available; use 'gloo'")
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"DDPStrategy.timeout_s must be a finite number > 0, got {timeout_s!r}")
        resolved = torch.device(device) if device is not None else _default_device(backend)
        if backend == "nccl" and resolved.type != "cuda":
            raise ValueError(f"DDPStrategy.device must be a CUDA device with backend 'nccl', got {resolved}")
        if resolved.type == "cuda" and resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
        self._rank = rank
        self._world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.find_unused_parameters = find_unused_parameters
        self._device = resolved
        self._initialised = False
        self._wrapped: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()

    @property
    def device(self) -> torch.device:
        """Device of this rank's model and batches."""
        return self._device

    @property
    def collective_device(self) -> torch.device:
        """Where tensors for this process group's collectives live: the rank's GPU for NCCL, the CPU for gloo
        (gloo reduces host memory; a CUDA model under gloo would pay a device round trip per collective)."""
        return self._device if self.backend == "nccl" else torch.device("cpu")

    @property
    def rank(self) -> int:
        """This process's rank in the training group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of training processes."""
        return self._world_size

    def setup(self) -> None:
        """Join the process group (blocks until all ranks have joined); does nothing the second time."""
        if self._initialised:
            return
        if dist.is_initialized():
            # Someone else (e.g. torchrun code) already formed the default group: use it if it matches.
            if (dist.get_rank(), dist.get_world_size()) != (self._rank, self._world_size):
                raise RuntimeError(
                    f"a process group with rank {dist.get_rank()} of {dist.get_world_size()} already exists; "
                    f"this strategy is rank {self._rank} of {self._world_size}"
                )
        else:
            if self._device.type == "cuda":
                torch.cuda.set_device(self._device)  # NCCL and object collectives use the current device
            dist.init_process_group(
                self.backend,
                store=self._rendezvous_store(),
                rank=self._rank,
                world_size=self._world_size,
                timeout=timedelta(seconds=self.timeout_s),
            )
        self._initialised = True

    def _rendezvous_store(self) -> dist.TCPStore:
        """The group's key-value store; rank 0 serves it on `master_addr` only.

        torch's own `tcp://` rendezvous listens on every interface of rank 0's machine, so anyone who
        can reach the machine could talk to the store; a socket bound here is handed to it instead.
        """
        timeout = timedelta(seconds=self.timeout_s)
        if self._rank != 0:
            return dist.TCPStore(self.master_addr, self.master_port, self._world_size, False, timeout)
        listener = listen_on(self.master_addr, self.master_port)
        # The store's server owns the socket from here on (and closes it with the store).
        return dist.TCPStore(self.master_addr, self.master_port, self._world_size, True, timeout,
                             master_listen_fd=listener.detach())

    def destroy(self) -> None:
        """Leave and destroy the process group, if there is one; drop the prepared models first.

        A DDP model freed after its process group is gone can deadlock in torch (gloo's worker threads
        wait for the GIL while the freeing thread holds it and joins them), so this warns about those.
        """
        gc.collect()  # free unreachable wrappers while the group still exists
        if self._wrapped:
            warnings.warn(
                f"destroying the process group while {len(self._wrapped)} DDP-wrapped model(s) are still "
                "referenced; freeing them afterwards may hang",
                RuntimeWarning,
                stacklevel=2,
            )
        if dist.is_initialized():
            dist.destroy_process_group()
        self._initialised = False

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move the model to this rank's device and wrap it in DDP when it has trainable parameters."""
        self.setup()
        model = model.to(self._device)
        if not any(p.requires_grad for p in model.parameters()):
            return model  # frozen (reference / reward) models need no gradient synchronisation
        # DDP broadcasts rank 0's parameters and buffers here, so all replicas start identical.
        wrapped = DistributedDataParallel(
            model,
            device_ids=[self._device.index] if self._device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters,
        )
        self._wrapped.add(wrapped)
        return wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside a DDP wrapper."""
        return model.module if isinstance(model, DistributedDataParallel) else model

    def all_true(self, flag: bool) -> bool:
        """True only if `flag` is true on every rank (every rank must call this)."""
        if self._world_size == 1:
            return bool(flag)
        self.setup()
        value = torch.tensor([int(bool(flag))], dtype=torch.int32, device=self.collective_device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def gradient_share(self, local_count: float) -> float:
        """world_size * local / sum of every rank's local count (1.0 when every rank holds as much data)."""
        local_count = float(local_count)
        if not (math.isfinite(local_count) and local_count >= 0):
            raise ValueError(f"gradient_share: local_count must be a finite number >= 0, got {local_count!r}")
        if self._world_size == 1:
            return 1.0
        self.setup()
        total = torch.tensor([local_count], dtype=torch.float64, device=self.collective_device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        total_count = float(total)
        return self._world_size * local_count / total_count if total_count > 0 else 0.0

    def barrier(self) -> None:
        """Wait until every rank has reached this point."""
        if self._world_size == 1:
            return
        self.setup()
        if self.backend == "nccl":
            dist.barrier(device_ids=[self._device.index])
        else:
            dist.barrier()

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s `obj` (picklable), on every rank; other ranks' `obj` is ignored."""
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self._world_size:
            raise ValueError(f"broadcast_object: src must be a rank in [0, {self._world_size}), got {src!r}")
        if self._world_size == 1:
            return obj
        self.setup()
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=self.collective_device)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order."""
        if self._world_size == 1:
            return [obj]
        self.setup()
        gathered: list[Any] = [None] * self._world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def reduce_metrics(self, metrics: dict[str, float], weight: float) -> dict[str, float]:
        """Weighted mean of each metric over ranks (keys ending in "samples"/"tokens" are summed).

        Every rank must pass the same keys (in any order) and its weight, e.g. its token count;
        a mean is NaN when the weights sum to 0.
        """
        weight = float(weight)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"reduce_metrics: weight must be a finite number >= 0, got {weight!r}")
        keys = sorted(metrics)
        if self._world_size == 1:
            return {k: float(metrics[k]) if _is_sum(k) or weight > 0 else math.nan for k in keys}
        self.setup()
        # The same key set gives the same checksum everywhere; max(c) == -max(-c) iff all ranks agree.
        # Checking first means mismatched ranks all raise instead of summing unrelated values.
        checksum = zlib.crc32("\0".join(keys).encode())
        check = torch.tensor([checksum, -checksum], dtype=torch.int64, device=self.collective_device)
        dist.all_reduce(check, op=dist.ReduceOp.MAX)
        highest, minus_lowest = check.tolist()
        if highest != -minus_lowest:
            raise ValueError("reduce_metrics: ranks passed different metric keys (rank "
                             f"{self._rank} has {keys})")
        values = [float(metrics[k]) if _is_sum(k) else float(metrics[k]) * weight for k in keys]
        totals = torch.tensor([*values, weight], dtype=torch.float64, device=self.collective_device)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        *summed, total_weight = totals.tolist()
        reduced = {}
        for key, total in zip(keys, summed, strict=True):
            if _is_sum(key):
                reduced[key] = total
            else:
                reduced[key] = total / total_weight if total_weight > 0 else math.nan
        return reduced


def _is_sum(key: str) -> bool:
    return key.endswith(SUM_SUFFIXES)


def _default_device(backend: str) -> torch.device:
    """cuda:<LOCAL_RANK or current device> for NCCL (a Ray GPU actor sees only its own GPU), else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    # A LOCAL_RANK beyond the visible GPUs comes from a launcher that numbers all GPUs of the node while
    # CUDA_VISIBLE_DEVICES (Ray) shows this process only its own: that one is the current device.
    if local_rank is not None and int(local_rank) < torch.cuda.device_count():
        return torch.device("cuda", int(local_rank))
    return torch.device("cuda", torch.cuda.current_device())
