"""Coming from ColossalChat's `coati/ray`: `DetachedPPOTrainer` and `ExperienceMakerHolder` with coati's
keyword signatures and methods, thin over this project's trainer and maker actors (docs/coming-from-coati.md).

The factories return this project's objects: `strategy_fn() -> Strategy` (`detached_rl.strategies`, or
`get_strategy_from_args(name)` here, which reads the `env_info` coati sets), the trainer's `model_fn() ->
(Actor, Critic)` and the maker's `model_fn() -> (Actor, Critic, reward model or reward function, initial
model)`. Create them the coati way: `DetachedPPOTrainer.options(name=..., num_gpus=..., max_concurrency=...)
.remote(...)`. Training, generation, pushes and weight updates are the real `TrainerCore`, `ExperienceMaker`
and `MakerLoop`; this module only translates arguments, batches and the meaning of `fit`.
"""

from __future__ import annotations

# Every name of the former single module stays importable from here; `__all__` keeps coati's own five.
from detached_rl.compat.coati.callbacks import (  # noqa: F401 - re-exported
    Callbacks,
    PerformanceEvaluator,
)
from detached_rl.compat.coati.maker import (  # noqa: F401 - re-exported
    CoatiMakerHolder,
    DataloaderPrompts,
    ExperienceMakerHolder,
    dataloader_batches,
)
from detached_rl.compat.coati.rounds import (  # noqa: F401 - re-exported
    CoatiRounds,
    CoatiTrainerCore,
)
from detached_rl.compat.coati.saving import (  # noqa: F401 - re-exported
    STATE_DICT_SUFFIXES,
    VALUE_HEAD_FILE,
    save_critic,
    save_model,
)
from detached_rl.compat.coati.settings import (  # noqa: F401 - re-exported
    COATI_ENV,
    COATI_METRICS,
    IGNORED_GENERATE_KWARGS,
    SAMPLING_KWARGS,
    batch_prompts,
    build_strategy,
    coati_metrics,
    get_receivers_per_sender,
    get_strategy_from_args,
    maker_models,
    sampling_from_generate_kwargs,
    set_dist_env,
    trainer_settings,
)
from detached_rl.compat.coati.trainer import (  # noqa: F401 - re-exported
    CoatiPPOTrainer,
    DetachedPPOTrainer,
)

__all__ = [
    "DetachedPPOTrainer", "ExperienceMakerHolder", "get_receivers_per_sender", "get_strategy_from_args",
    "set_dist_env",
]
