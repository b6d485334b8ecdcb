"""How a model is trained: naive (one process), DDP, and ColossalAI's DDP, ZeRO-2 and Gemini plugins.

The names a config picks are in `registry` (torch-free); every public name here is imported on first use.
"""

from detached_rl.core.lazy import lazy_exports

# Public name -> its module, imported on first use (importing the package loads no torch).
_LAZY = {
    "CPU_STRATEGIES": "detached_rl.strategies.registry",
    "DISTRIBUTED_STRATEGIES": "detached_rl.strategies.registry",
    "STRATEGIES": "detached_rl.strategies.registry",
    "check_strategy_name": "detached_rl.strategies.registry",
    "make_strategy": "detached_rl.strategies.registry",
    "Strategy": "detached_rl.strategies.base",
    "check_strategy": "detached_rl.strategies.base",
    "ColossalAIDDPStrategy": "detached_rl.strategies.colossalai",
    "ColossalAIGeminiStrategy": "detached_rl.strategies.colossalai",
    "ColossalAIZero2Strategy": "detached_rl.strategies.colossalai",
    "StrategyUnavailableError": "detached_rl.strategies.colossalai",
    "colossalai_available": "detached_rl.strategies.colossalai",
    "DDPStrategy": "detached_rl.strategies.ddp",
    "NaiveStrategy": "detached_rl.strategies.naive",
    "default_device": "detached_rl.strategies.naive",
}
__getattr__ = lazy_exports(__name__, _LAZY)

__all__ = sorted(_LAZY)
