"""How a model is trained: naive (one process), DDP, and ColossalAI's DDP, ZeRO-2 and Gemini plugins."""

from typing import Any

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


def check_strategy_name(value: Any, where: str = "strategy") -> str:
    """`value` when it names a strategy; else TypeError (not a str) or ValueError
    (unknown), naming `where`."""
    if not isinstance(value, str):
        hint = (" (a callable that builds a strategy, such as coati's strategy_fn, is not taken "
                "here: pass the strategy's name; the trainer builds it in its "
                "own process)") if callable(value) else ""
        shown = repr(value)[:120]
        raise TypeError(f"{where} must be a strategy name, one of {sorted(STRATEGIES)}; got a "
                        f"{type(value).__name__}, {shown}{hint}")
    if value not in STRATEGIES:
        raise ValueError(f"{where} {value!r} is not available; choose one of {sorted(STRATEGIES)}")
    return value


def check_strategy(value: Any, where: str = "strategy") -> Strategy:
    """`value` when it is a `Strategy` instance; else TypeError naming `where` (a
    name or a factory is refused)."""
    if not isinstance(value, Strategy):
        hint = " (call make_strategy(name) for one by name)" if isinstance(value, str) else \
            " (call the factory and pass what it returns)" if callable(value) else ""
        raise TypeError(f"{where} must be a detached_rl Strategy instance (NaiveStrategy, "
                        f"DDPStrategy, ...); got {type(value).__name__}{hint}")
    return value


def make_strategy(name: str, **kwargs) -> Strategy:
    """Build a strategy by name."""
    return STRATEGIES[check_strategy_name(name)](**kwargs)


__all__ = [
    "CPU_STRATEGIES", "DISTRIBUTED_STRATEGIES", "STRATEGIES", "ColossalAIDDPStrategy",
    "ColossalAIGeminiStrategy",
    "ColossalAIZero2Strategy", "DDPStrategy", "NaiveStrategy", "Strategy", "StrategyUnavailableError",
    "check_strategy", "check_strategy_name", "colossalai_available", "default_device", "make_strategy",
]
