"""Where an actor's models run: on the GPU Ray gave the actor, else on the CPU."""

from __future__ import annotations

import logging

import ray

from detached_rl.core.resources import device_for

logger = logging.getLogger(__name__)


def actor_device() -> str | None:
    """The device for the models of the calling actor: "cuda" when Ray gave it a GPU, "cpu" when it gave none
    (Ray 2.60 hides no GPU from such an actor, so it must not pick one by itself); None outside an actor."""
    if not ray.is_initialized():
        return None
    context = ray.get_runtime_context()
    if context.worker.mode != ray.WORKER_MODE:
        return None
    import torch

    gpus = float(context.get_assigned_resources().get("GPU", 0.0))
    device = device_for(gpus, torch.cuda.is_available())
    if gpus > 0 and device == "cpu":
        # A cluster that declares GPUs this torch cannot use (a CPU build, or logical GPUs of a test cluster).
        logger.warning("Ray gave this actor %g GPU but torch sees no CUDA device: its models stay on the CPU",
                       gpus)
    return device
