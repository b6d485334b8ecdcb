"""The Ray wing: transport, actor groups, and the thin actor shells over the plain classes.

Each public name is imported on first use, so a process that needs one shell (a scorer worker, a maker)
loads that shell's dependencies only: a scorer with a Python reward never imports the trainer, peft or
loralib.
"""

from detached_rl.core.lazy import lazy_exports

_EXPORTS = {
    "DEFAULT_NAMESPACE": "detached_rl.actors.transport",
    "DetachedGRPOTrainer": "detached_rl.actors.trainer",
    "DetachedPPOTrainer": "detached_rl.actors.trainer",
    "ExperienceMakerHolder": "detached_rl.actors.maker",
    "attach": "detached_rl.actors.transport",
    "get_all": "detached_rl.actors.transport",
    "start_trainer_group": "detached_rl.actors.trainer_group",
    "stop_trainer_group": "detached_rl.actors.trainer_group",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "DEFAULT_NAMESPACE", "DetachedGRPOTrainer", "DetachedPPOTrainer", "ExperienceMakerHolder", "attach",
    "get_all",
    "start_trainer_group", "stop_trainer_group",
]
