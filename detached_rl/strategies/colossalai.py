"""ColossalAI strategies: a `Booster` with `TorchDDPPlugin` (CPU or GPU), ZeRO-2 or Gemini (CUDA only).

colossalai 0.5.0 pins torch<=2.5.1, so it is not a dependency of this package: `make colossalai`
installs it beside torch 2.13 with `pip install --no-deps` (see README). These classes import it
only when they are built, and refuse with an error that says what to do when it is missing.

The process group is formed the same way as for `DDPStrategy` (rank 0's node address and a free
port there); the plugins need it before they are constructed.

What makers receive from the sharded plugins (colossalai 0.5.0):
* ZeRO-2 (`LowLevelZeroPlugin`): the module itself is cast to the precision dtype (bf16 by default) and holds
  the working weights; `LowLevelZeroOptimizer` keeps fp32 master shards, and after each step all-gathers
  `master.to(working dtype)` back into the module. The gathered state dict is therefore bf16(master): exactly
  what the trainer's own forward computes with. A tensor whose fp32 update is smaller than half a bf16 step
  (RMSNorm weights at 1.0 after two steps at lr 1e-3 move by <= 2e-3; half a bf16 step is 2**-9 below 1.0 and
  2**-8 above) keeps its bf16 value, so some tensors look unchanged although their masters moved (the 19 of 21
  seen on an H100); precision "fp32" sends the master values themselves.
* Gemini (`GeminiPlugin`): parameters live in chunks; `state_dict_shard` gathers them (bf16 with the gradient
  accumulation enabled here, see `ColossalAIGeminiStrategy`).
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from detached_rl.strategies.ddp import DDPStrategy
from detached_rl.strategies.optim import OptimizerConfig, build_optimizer
from detached_rl.strategies.registry import CPU_STRATEGIES

INSTALL_HINT = (
    "install it beside torch with `make colossalai` "
    "(pip install --no-deps colossalai==0.5.0 einops galore-torch bitsandbytes)"
)


class StrategyUnavailableError(RuntimeError):
    """A strategy cannot run here (missing package or device); the message says which strategies can."""


def colossalai_available() -> bool:
    """True when the colossalai package can be imported."""
    return importlib.util.find_spec("colossalai") is not None


def _import_colossalai(strategy: str) -> Any:
    if not colossalai_available():
        raise StrategyUnavailableError(f"strategy {strategy!r} needs the colossalai package, which is "
                                       f"not installed; {INSTALL_HINT}. Without it, use 'naive' or 'ddp'.")
    with warnings.catch_warnings():  # optional kernels (apex, tensornvme, bitsandbytes CPU) it will not use
        warnings.simplefilter("ignore")
        import colossalai.booster
        import colossalai.booster.plugin
    return colossalai


class BackwardsPerStep:
    """Counts backward passes per optimizer since its last step, and refuses a second one where `allowed` is
    False.

    Turns what a plugin without gradient accumulation would do with a second micro-batch (Gemini: an
    AssertionError deep in its chunk bookkeeping, or gradients written over the weights) into an error
    that names the setting to change.
    """

    def __init__(self, strategy: str, allowed: bool, how_to_allow: str) -> None:
        self.strategy = strategy
        self.allowed = allowed
        self.how_to_allow = how_to_allow
        self._counts: dict[int, int] = {}

    def backward(self, optimizer: Any) -> None:
        """Record one backward pass for `optimizer`; raise ValueError if it is a second
        one and that is not allowed."""
        count = self._counts.get(id(optimizer), 0) + 1
        if count > 1 and not self.allowed:
            raise ValueError(
                f"strategy {self.strategy!r} takes one backward pass per optimizer step (no gradient "
                "accumulation), but a second micro-batch was back-propagated before the step: set "
                "the learner's micro_batch_size (PPOConfig.micro_batch_size / GRPOConfig.micro_batch_size) "
                f"to at least its mini-batch size, or {self.how_to_allow}"
            )
        self._counts[id(optimizer)] = count

    def stepped(self, optimizer: Any) -> None:
        """The optimizer stepped: its gradients start afresh."""
        self._counts.pop(id(optimizer), None)


def gemini_plugin_options(precision: str, max_grad_norm: float | None,
                          options: Mapping[str, Any]) -> dict[str, Any]:
    """`GeminiPlugin` keyword arguments: ours, with gradient accumulation on, then the user's
    `plugin_options`.

    With `enable_gradient_accumulation` GeminiDDP keeps gradients in chunks of their own and adds each
    backward pass to them until the optimizer steps; without it, it writes gradients over the bf16
    weight chunks (`reuse_fp16_chunk`), so only one backward pass per step is possible.
    """
    return {"precision": precision, "max_norm": max_grad_norm or 0.0, "enable_gradient_accumulation": True,
            **options}


class ColossalAIStrategy(DDPStrategy):
    """Data-parallel training through a ColossalAI `Booster`; subclasses choose the plugin.

    `prepare_training` boosts a model together with its optimizer and schedule, as the plugins
    require; `prepare_model` boosts a model alone (or only moves it, when it has nothing to train).
    """

    name = "colossalai"
    needs_cuda = False

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int,
                 backend: str | None = None,
                 timeout_s: float = 300.0, device: torch.device | str | None = None,
                 plugin_options: dict[str, Any] | None = None) -> None:
        if self.needs_cuda and not torch.cuda.is_available():
            raise StrategyUnavailableError(
                f"strategy {self.name!r} needs CUDA GPUs ({self._needs_cuda_because}) and this "
                f"machine has none; on CPU use one of {', '.join(CPU_STRATEGIES)}"
            )
        _import_colossalai(self.name)
        super().__init__(rank, world_size, master_addr, master_port, backend, timeout_s, device)
        self.plugin_options = dict(plugin_options or {})
        self._boosters: dict[float | None, Any] = {}

    _needs_cuda_because = ""

    def _plugin(self, max_grad_norm: float | None) -> Any:
        raise NotImplementedError

    def booster(self, max_grad_norm: float | None = None) -> Any:
        """The Booster (one per clipping norm: ZeRO and Gemini plugins clip inside their optimizer step)."""
        self.setup()
        key = max_grad_norm if self.clips_in_plugin else None
        if key not in self._boosters:
            from colossalai.booster import Booster

            self._boosters[key] = Booster(plugin=self._plugin(key))
        return self._boosters[key]

    clips_in_plugin = False

    def _optimizer(self, params: list[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
        return build_optimizer(params, config)[0]

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Move a frozen model to the device; boost a trainable one (without an optimizer)."""
        if not any(p.requires_grad for p in model.parameters()):
            return model.to(self.device)
        return self.booster().boost(model)[0]

    def prepare_training(
        self, model: nn.Module, config: OptimizerConfig | None = None
    ) -> tuple[nn.Module, Any, torch.optim.lr_scheduler.LRScheduler]:
        """Boost the model with its optimizer and schedule; returns the wrapped
        model, optimizer and schedule."""
        config = config or OptimizerConfig()
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters")
        optimizer = self._optimizer(params, config)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, config.lr_factor)
        boosted, optimizer, _, _, scheduler = self.booster(config.max_grad_norm).boost(
            model, optimizer, lr_scheduler=scheduler)
        return boosted, optimizer, scheduler

    def create_optimizer(self, model: nn.Module, config: OptimizerConfig | None = None) -> tuple[Any, Any]:
        """Refused: a Booster must see model and optimizer together; use `prepare_training`."""
        raise NotImplementedError(f"strategy {self.name!r} boosts model and optimizer together: use "
                                  "prepare_training")

    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: Any) -> None:
        """Back-propagate as `Booster.backward` does: through the plugin's
        optimizer (it may scale or shard)."""
        optimizer.backward(loss)

    def optimizer_step(self, optimizer: Any, model: nn.Module, max_grad_norm: float | None = None) -> float:
        """Clip (when asked), step, zero gradients; returns the gradient norm before clipping."""
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if max_grad_norm is not None and params:
            norm = float(optimizer.clip_grad_by_norm(max_grad_norm))
        else:
            norms = [p.grad.norm() for p in params]
            norm = float(torch.linalg.vector_norm(torch.stack(norms))) if params else 0.0
        optimizer.step()
        optimizer.zero_grad()
        return norm

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside a ColossalAI wrapper (peft models stay peft models)."""
        from colossalai.interface import ModelWrapper

        return model.unwrap(unwrap_peft=False) if isinstance(model, ModelWrapper) else model

    def destroy(self) -> None:
        """Drop the Boosters, then leave the process group."""
        self._boosters.clear()
        super().destroy()


class ColossalAIDDPStrategy(ColossalAIStrategy):
    """ColossalAI `TorchDDPPlugin`: torch DDP under a Booster; runs on CPU (gloo) and GPU (NCCL)."""

    name = "colossalai_ddp"

    def _plugin(self, max_grad_norm: float | None) -> Any:
        from colossalai.booster.plugin import TorchDDPPlugin

        return TorchDDPPlugin(**self.plugin_options)

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The plain model inside the Booster's DDP wrapper."""
        from colossalai.booster.plugin.torch_ddp_plugin import TorchDDPModel

        return model.module.module if isinstance(model, TorchDDPModel) else model


class _ShardedColossalAIStrategy(ColossalAIStrategy):
    """ZeRO-2 / Gemini: HybridAdam, clipping inside the plugin, only rank 0 pushes weights."""

    needs_cuda = True
    shards_weights = True
    clips_in_plugin = True

    def __init__(self, *args: Any, precision: str = "bf16", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.precision = precision
        self._backwards = BackwardsPerStep(self.name, self.supports_gradient_accumulation,
                                           self._how_to_accumulate)

    _how_to_accumulate = ""

    def backward(self, loss: torch.Tensor, model: nn.Module, optimizer: Any) -> None:
        """Back-propagate through the plugin's optimizer; a second pass before the step
        only where it accumulates."""
        self._backwards.backward(optimizer)
        optimizer.backward(loss)

    def _optimizer(self, params: list[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
        from colossalai.nn.optimizer import HybridAdam

        return HybridAdam(params, lr=config.lr, betas=config.betas, eps=config.eps,
                          weight_decay=config.weight_decay, adamw_mode=True)

    def optimizer_step(self, optimizer: Any, model: nn.Module, max_grad_norm: float | None = None) -> float:
        """Step (the plugin clips to the optimizer config's norm) and zero gradients;
        returns the norm if known."""
        optimizer.step()
        norm = optimizer.get_grad_norm() if hasattr(optimizer, "get_grad_norm") else None
        optimizer.zero_grad()
        self._backwards.stepped(optimizer)
        return float(norm) if norm is not None else math.nan

    def skip_step(self, optimizer: Any) -> None:
        """Drop the gradients of a step not taken; the next backward starts a fresh step."""
        optimizer.zero_grad()
        self._backwards.stepped(optimizer)


class ColossalAIZero2Strategy(_ShardedColossalAIStrategy):
    """ColossalAI `LowLevelZeroPlugin(stage=2)`: optimizer states and gradients sharded over ranks (CUDA)."""

    name = "colossalai_zero2"
    _needs_cuda_because = "LowLevelZeroPlugin shards optimizer states and gradients on GPUs"

    def _plugin(self, max_grad_norm: float | None) -> Any:
        from colossalai.booster.plugin import LowLevelZeroPlugin

        options = {"stage": 2, "precision": self.precision, "max_norm": max_grad_norm or 0.0,
                   **self.plugin_options}
        return LowLevelZeroPlugin(**options)

    def load_weights(self, model: nn.Module, state: dict[str, torch.Tensor], optimizer: Any = None) -> None:
        """Load the working weights, then copy them into the optimizer's fp32 master shards: the next step
        updates the masters and gathers them back, so masters left stale would undo the load."""
        super().load_weights(model, state, optimizer)
        if optimizer is not None:
            optimizer.update_master_params(model)

    def named_tensors(
        self, model: nn.Module, prefix: str = "", only_trainable: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The module's working weights (bf16(master) after each step), once any all-gather still in flight
        landed.

        With `plugin_options={"overlap_allgather": True}` the optimizer step only starts the all-gathers of
        the updated weights; the plugin's own checkpoint code waits for them first, and so does this.
        """
        if hasattr(model, "_force_wait_all_gather"):
            model._force_wait_all_gather()
        yield from super().named_tensors(model, prefix, only_trainable)


class ColossalAIGeminiStrategy(_ShardedColossalAIStrategy):
    """ColossalAI `GeminiPlugin`: parameters, gradients and optimizer states in chunks
    sharded over ranks (CUDA)."""

    name = "colossalai_gemini"
    _needs_cuda_because = "GeminiPlugin manages parameter chunks in GPU memory"

    _how_to_accumulate = "leave plugin_options['enable_gradient_accumulation'] on (the default)"

    @property
    def supports_gradient_accumulation(self) -> bool:
        """True unless `plugin_options` turn Gemini's gradient accumulation off."""
        return bool(gemini_plugin_options(self.precision, None,
                                          self.plugin_options)["enable_gradient_accumulation"])

    def _plugin(self, max_grad_norm: float | None) -> Any:
        from colossalai.booster.plugin import GeminiPlugin

        return GeminiPlugin(**gemini_plugin_options(self.precision, max_grad_norm, self.plugin_options))

    def named_tensors(
        self, model: nn.Module, prefix: str = "", only_trainable: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Gather the parameters chunk by chunk (`state_dict_shard`, a collective);
        tensors arrive on rank 0 only."""
        plain = self.unwrap(model)
        # a frozen model was not boosted: it is whole on every rank
        if not hasattr(model, "state_dict_shard"):
            yield from super().named_tensors(model, prefix, only_trainable)
            return
        trainable = {name for name, p in plain.named_parameters()
                     if p.requires_grad} if only_trainable else None
        for shard, _ in model.state_dict_shard(max_shard_size=64, only_rank_0=True):
            for name, tensor in shard.items():
                if name.startswith(prefix) and (trainable is None or name in trainable):
                    yield name[len(prefix):], tensor.detach()
