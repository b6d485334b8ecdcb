"""The strategy interface: how a model is placed, wrapped, stepped, gathered and checkpointed."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from detached_rl.core.checkpoint import load_state, save_atomic
from detached_rl.strategies.optim import OptimizerConfig, build_optimizer


class Strategy(ABC):
    """One way to train a model (one process, DDP, ColossalAI ...). Logic that does not
    depend on it lives elsewhere."""

    name: str = "base"
    # True when ranks hold shards of the weights (ZeRO, Gemini): gathering them is a collective
    # every rank joins, and only rank 0 pushes weight updates to makers.
    shards_weights: bool = False
    # False when the strategy takes one backward per optimizer step: gradients cannot be accumulated over
    # micro-batches, so a learner must back-propagate each mini-batch at once
    # (micro_batch_size >= mini-batch).
    supports_gradient_accumulation: bool = True

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device this rank's model and batches live on."""

    @property
    def rank(self) -> int:
        """This process's rank in the training group."""
        return 0

    @property
    def world_size(self) -> int:
        """Number of training processes."""
        return 1

    @property
    def is_rank_zero(self) -> bool:
        """True on the rank that saves checkpoints and pushes weights."""
        return self.rank == 0

    @abstractmethod
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move (and wrap) a model for training; returns the model to call."""

    def create_optimizer(
        self, model: nn.Module, config: OptimizerConfig | None = None
    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """AdamW over the model's trainable parameters, and its learning-rate schedule."""
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        return build_optimizer(params, config or OptimizerConfig())

    def prepare_training(
        self, model: nn.Module, config: OptimizerConfig | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        """Prepare a trainable model with its optimizer and schedule; returns (model to call, optimizer,
        schedule).

        Strategies that must see model and optimizer together (ColossalAI's `Booster.boost`) override this.
        """
        model = self.prepare_model(model)
        optimizer, scheduler = self.create_optimizer(model, config)
        return model, optimizer, scheduler

    def gradient_share(self, local_count: float) -> float:
        """Factor for this rank's loss so that averaging gradients over ranks gives the mean over all ranks'
        data.

        A rank's loss is a mean over its `local_count` tokens (or sequences); data-parallel wrappers
        average gradients over ranks, which equals the mean over all data only when every rank holds
        as much. Scaling by world_size * local / total makes it exact. Every rank must call this.
        """
        return 1.0

    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Back-propagate a loss."""
        loss.backward()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, model: nn.Module, max_grad_norm: float | None = None
    ) -> float:
        """Clip gradients (when asked), step and zero them; returns the gradient norm before clipping."""
        params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
        if max_grad_norm is not None and params:
            norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        else:
            # Grouped per device and dtype (foreach kernels), reduced where the gradients are.
            norm = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(norm) if norm is not None else 0.0  # read back after the step is queued

    def skip_step(self, optimizer: Any) -> None:
        """Drop the gradients of an optimizer step that is not taken (non-finite loss or gradients)."""
        optimizer.zero_grad(set_to_none=True)

    def all_true(self, flag: bool) -> bool:
        """True when `flag` is true on every rank (ranks agree before a collective step)."""
        return bool(flag)

    def barrier(self) -> None:  # noqa: B027 - a single process has nobody to wait for
        """Wait for every rank."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank."""
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        return [obj]

    def reduce_metrics(self, metrics: dict[str, float], weight: float) -> dict[str, float]:
        """Weighted mean of each metric across ranks (keys ending in samples/tokens are summed)."""
        return dict(metrics)

    def setup(self) -> None:  # noqa: B027 - nothing to set up in a single process
        """Acquire what the strategy needs (process groups); idempotent."""

    def destroy(self) -> None:  # noqa: B027
        """Release what `setup` acquired (process groups)."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside any wrapper this strategy added."""
        return model

    def load_weights(self, model: nn.Module, state: dict[str, torch.Tensor], optimizer: Any = None) -> None:
        """Load a state dict (as `unwrap(model).state_dict()` gave it) into `model` (what `prepare_model`
        returned); `optimizer` is the model's, for strategies that keep their own copy of
        the weights (master weights)."""
        self.unwrap(model).load_state_dict(state)

    def named_tensors(
        self, model: nn.Module, prefix: str = "", only_trainable: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of the full state dict of the part of `model` under `prefix` (prefix removed), in
        order.

        `model` is what `prepare_model` returned. Sharded strategies gather one shard at a time
        (a collective: every rank iterates) and yield tensors on rank 0 only.
        """
        plain = self.unwrap(model)
        trainable = {name for name, p in plain.named_parameters()
                     if p.requires_grad} if only_trainable else None
        for name, tensor in plain.state_dict().items():
            if not name.startswith(prefix) or (trainable is not None and name not in trainable):
                continue
            yield name[len(prefix):], tensor.detach()

    def iter_state_dict(
        self, model: nn.Module, chunk_bytes: int = 64 * 2**20, only_trainable: bool = False
    ) -> Iterator[dict[str, torch.Tensor]]:
        """The full state dict in chunks of at most `chunk_bytes` (a tensor larger
        than that is its own chunk)."""
        chunk: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in self.named_tensors(model, only_trainable=only_trainable):
            nbytes = tensor.numel() * tensor.element_size()
            if chunk and size + nbytes > chunk_bytes:
                yield chunk
                chunk, size = {}, 0
            chunk[name] = tensor
            size += nbytes
        if chunk:
            yield chunk

    def save_checkpoint(
        self, path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Path:
        """Write model, optimizer and `extra` atomically as safetensors + JSON: a crash
        mid-save keeps the old one."""
        state = {"model": self.unwrap(model).state_dict(), "extra": extra or {},
                 "optimizer": optimizer.state_dict() if optimizer is not None else None}
        return save_atomic(state, path)

    def load_checkpoint(
        self, path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> dict[str, Any]:
        """Restore what `save_checkpoint` wrote; returns `extra`."""
        state = load_state(path)
        self.load_weights(model, state["model"], optimizer)
        if optimizer is not None:
            if state["optimizer"] is None:
                raise ValueError(f"{path}: the checkpoint holds no optimizer state")
            optimizer.load_state_dict(state["optimizer"])
        return state["extra"]


def check_strategy(value: Any, where: str = "strategy") -> Strategy:
    """`value` when it is a `Strategy` instance; else TypeError naming `where` (a
    name or a factory is refused)."""
    if not isinstance(value, Strategy):
        hint = " (call make_strategy(name) for one by name)" if isinstance(value, str) else \
            " (call the factory and pass what it returns)" if callable(value) else ""
        raise TypeError(f"{where} must be a detached_rl Strategy instance (NaiveStrategy, "
                        f"DDPStrategy, ...); got {type(value).__name__}{hint}")
    return value
