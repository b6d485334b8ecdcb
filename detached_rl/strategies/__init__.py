"""How a model is trained: naive (one process), DDP, and ColossalAI's DDP, ZeRO-2 and Gemini plugins."""

from detached_rl.strategies.base import Strategy
from detached_rl.strategies.colossalai import (
    CPU_STRATEGIES,
    ColossalAIDDPStrategy,
    ColossalAIGeminiStrategy,
    ColossalAIZero2Strategy,
    StrategyUnavailableError,
    colossalai_available,
)
from detached_rl.strategies.ddp import DDPStrategy
from detached_rl.strategies.naive import NaiveStrategy, default_device

STRATEGIES = {
    "naive": NaiveStrategy,
    "ddp": DDPStrategy,
    "colossalai_ddp": ColossalAIDDPStrategy,
    "colossalai_zero2": ColossalAIZero2Strategy,
    "colossalai_gemini": ColossalAIGeminiStrategy,
}
# Strategies whose ranks form a process group (every one but naive).
DISTRIBUTED_STRATEGIES = tuple(name for name in STRATEGIES if name != "naive")


def make_strategy(name: str, **kwargs) -> Strategy:
    """Build a strategy by name."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r} is not available; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[name](**kwargs)


__all__ = [
    "CPU_STRATEGIES", "DISTRIBUTED_STRATEGIES", "STRATEGIES", "ColossalAIDDPStrategy", "ColossalAIGeminiStrategy",
    "ColossalAIZero2Strategy", "DDPStrategy", "NaiveStrategy", "Strategy", "StrategyUnavailableError",
    "colossalai_available", "default_device", "make_strategy",
]
