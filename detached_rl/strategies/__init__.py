"""How a model is trained: naive (one process) now; DDP and ColossalAI strategies build on the same interface."""

from detached_rl.strategies.base import Strategy
from detached_rl.strategies.ddp import DDPStrategy
from detached_rl.strategies.naive import NaiveStrategy, default_device

STRATEGIES = {"naive": NaiveStrategy, "ddp": DDPStrategy}


def make_strategy(name: str, **kwargs) -> Strategy:
    """Build a strategy by name."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r} is not available; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](**kwargs)


__all__ = ["STRATEGIES", "DDPStrategy", "NaiveStrategy", "Strategy", "default_device", "make_strategy"]
