"""The Ray wing: transport, actor groups, and the thin actor shells over the plain classes."""

from detached_rl.actors.group import start_trainer_group, stop_trainer_group
from detached_rl.actors.maker import ExperienceMakerHolder
from detached_rl.actors.trainer import DetachedGRPOTrainer, DetachedPPOTrainer
from detached_rl.actors.transport import DEFAULT_NAMESPACE, attach, get_all

__all__ = [
    "DEFAULT_NAMESPACE", "DetachedGRPOTrainer", "DetachedPPOTrainer", "ExperienceMakerHolder", "attach",
    "get_all",
    "start_trainer_group", "stop_trainer_group",
]
