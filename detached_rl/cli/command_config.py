"""The config each CLI command builds from its arguments, and the inputs refused before anything starts.

Every command starts from the same defaults (`RunConfig`'s, the main job's) and lays `--config`,
`--set` and its own flags over them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detached_rl.cli.arguments import check_config_integers

if TYPE_CHECKING:
    from detached_rl.config import RunConfig


def run_command_config(args: argparse.Namespace) -> RunConfig:
    """The `run` command's config: the defaults (every command's), `--config`, `--set` and the flags."""
    from detached_rl.cli.run import run_config

    overrides = list(args.set or [])
    if args.namespace:
        overrides.append(f"namespace={args.namespace}")
    if args.output:
        overrides.append(f"run.output_dir={args.output}")
    if args.no_progress:
        overrides.append("run.progress=false")
    if args.gpus is not None:
        overrides.append(f"run.gpus={args.gpus}")
    if args.backend is not None:
        overrides.append(f"maker.backend={args.backend}")
    config = run_config(args.config, overrides, steps=args.steps, makers=args.makers, model=args.model,
                        task=args.task, name=args.name)
    check_config_integers(config)
    return config


def refuse_unloadable_models(config: RunConfig, local: bool = True) -> None:
    """Fail before anything starts when a model spec of the config names nothing loadable (`local`: on this
    machine; else only the specs that name no directory, `smollm2` and `tiny[-<model_type>]`, are checked)."""
    from detached_rl.models.specs import attention_problem, model_spec_problem

    if local and config.model.attn_implementation is not None:
        problem = attention_problem(config.model.attn_implementation)
        if problem:
            raise ValueError(f"model.attn_implementation: {problem}")
    for key in ("policy", "critic", "reward_model"):
        spec = getattr(config.model, key)
        if spec is None or not local and not (spec == "smollm2" or spec.startswith("tiny")):
            continue
        problem = model_spec_problem(spec, config.model.revision if spec == config.model.policy else None)
        if problem:
            raise ValueError(f"model.{key}: {problem}")


def refuse_unusable_task(config: RunConfig) -> None:
    """Fail before anything starts when the task's rewards cannot be imported here or its dataset cannot be
    used (one line naming the file and the column or split): they are shipped from this machine."""
    from detached_rl.config.shipping import task_shipment

    # As `python -m` would: a reward module in the directory the command runs in is importable (a console
    # script's path starts at its own bin directory instead).
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if config.task.dataset is not None:
        config.task_data()
    task_shipment(config)


def command_config(args: argparse.Namespace) -> RunConfig:
    """The config of `trainer`, `maker`, `scorers`: the defaults, `--config`, `--set` and the flags."""
    from detached_rl.config import load_config

    overrides = list(args.set or [])
    for flag, key in (("world_size", "trainer_group.world_size"), ("strategy", "trainer_group.strategy"),
                      ("placement", "trainer_group.placement_strategy"),
                      ("num_gpus_per_rank", "trainer_group.num_gpus_per_rank"),
                      ("num_gpus", "maker.num_gpus"),
                      ("backend", "maker.backend")):
        if getattr(args, flag, None) is not None:
            overrides.append(f"{key}={getattr(args, flag)}")
    if getattr(args, "namespace", None):
        overrides.append(f"namespace={args.namespace}")
    config = load_config(args.config, overrides)
    check_config_integers(config)
    refuse_unloadable_models(config, local=False)  # the actors may run on other nodes
    return config


def checkpoint_problem(directory: str, ranks: list[int]) -> str | None:
    """Why `directory` (on this host) is not a checkpoint of the trainer ranks `ranks`, or None when it is."""
    from detached_rl.core.checkpoint import has_checkpoint

    path = Path(directory)
    if not path.is_dir():
        return "no such directory"
    missing = [f"rank_{rank}" for rank in ranks if not has_checkpoint(path / f"rank_{rank}")]
    if missing:
        return (f"not a checkpoint of this trainer (no {', '.join(missing)} checkpoint in it; give the "
                "--checkpoint-dir of an earlier trainer)")
    return None


def refuse_checkpoint_missing_on_trainer(directory: str, handles: list[Any], timeout: float = 60.0) -> None:
    """Fail unless `directory` holds each rank's checkpoint on the host of that rank (`handles`, rank order).

    A trainer reads `--resume-from` on its own host, which need not be the host this command runs on:
    the check runs there, in a task pinned to each rank's node.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = ray.get([handle.status.remote() for handle in handles], timeout=timeout)
    check = ray.remote(checkpoint_problem)
    problems = ray.get([check.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        node["node_id"], soft=False)).remote(directory, [rank]) for rank, node in enumerate(nodes)],
        timeout=timeout)
    for rank, (node, problem) in enumerate(zip(nodes, problems, strict=True)):
        if problem:
            raise ValueError(f"--resume-from {directory!r}: {problem} on the host of trainer rank {rank} "
                             f"(node {node['node_id'][:12]}); the path is read on the trainer's host")
