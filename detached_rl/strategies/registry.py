"""Strategies by name, torch-free: the names a config may pick and the class each one builds (imported on
first use)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from detached_rl.core.lazy import LazyRegistry

if TYPE_CHECKING:
    from detached_rl.strategies.base import Strategy

#: Name -> strategy class ("module:Class" until first looked up).
STRATEGIES = LazyRegistry({
    "naive": "detached_rl.strategies.naive:NaiveStrategy",
    "ddp": "detached_rl.strategies.ddp:DDPStrategy",
    "colossalai_ddp": "detached_rl.strategies.colossalai:ColossalAIDDPStrategy",
    "colossalai_zero2": "detached_rl.strategies.colossalai:ColossalAIZero2Strategy",
    "colossalai_gemini": "detached_rl.strategies.colossalai:ColossalAIGeminiStrategy",
})
# Strategies whose ranks form a process group (every one but naive).
DISTRIBUTED_STRATEGIES = tuple(name for name in STRATEGIES if name != "naive")
# The strategies that train on a CPU (the ColossalAI ZeRO-2 and Gemini plugins need CUDA).
CPU_STRATEGIES = ("naive", "ddp", "colossalai_ddp")


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


def make_strategy(name: str, **kwargs: Any) -> Strategy:
    """Build a strategy by name."""
    return STRATEGIES[check_strategy_name(name)](**kwargs)
