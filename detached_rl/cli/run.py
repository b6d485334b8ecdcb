"""`detached-rl run`: one command that trains with named detached actors and shows what was learned.

It starts (or joins) a Ray cluster, creates one named trainer (or a trainer group, `trainer_group`)
and `run.makers` named experience makers, grades the held-out split before training, trains for `run.steps`
steps while a progress bar shows step, reward, KL, samples/s and the policy version each
maker serves, grades the held-out split again with the final weights, and writes
`runs/<name>/`: config.yaml, metrics.jsonl, TensorBoard events, metrics.png, eval.json,
summary.json, the LoRA adapter (adapter/) and a merged model (merged/). Everything it
started is shut down at the end, also on failure or Ctrl-C.

Its parts: `run_setup` (the config, GPU shares, errors), `run_driver` (the actors, evaluation and
training), `run_report` (the progress line, summary.json, the before/after table); this module is the
entry point, `run_job`, and keeps their public names.

It starts from `RunConfig`'s defaults, as every command does (SmolLM2-135M-Instruct + LoRA, GRPO, word
problems: the recipe `config/run.yaml` over the schema's defaults); `--config` lays a YAML file over them and
`--set key.path=value` overrides.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from detached_rl.cli.run_driver import JobRunner, actor_death_reason, single_machine_cluster, split_evenly
from detached_rl.cli.run_setup import (
    DEFAULT_RUN_CONFIG,
    ActorDied,
    RunError,
    RunInterrupted,
    RunResult,
    check_vllm_installed,
    default_run_name,
    run_config,
    run_cpu_slots,
    run_gpus,
)
from detached_rl.config import RunConfig

__all__ = [
    "DEFAULT_RUN_CONFIG", "ActorDied", "JobRunner", "RunError", "RunInterrupted", "RunResult",
    "actor_death_reason", "check_vllm_installed", "default_run_name", "run_config", "run_cpu_slots",
    "run_gpus", "run_job", "single_machine_cluster", "split_evenly", "stop_on_signals",
]


@contextlib.contextmanager
def stop_on_signals(echo: Callable[[str], None]) -> Iterator[threading.Event]:
    """While inside: the first Ctrl-C / SIGTERM sets the yielded event (the run stops and cleans up); a second
    Ctrl-C raises KeyboardInterrupt. Outside the main thread nothing is installed."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def handle(signum: int, _frame: Any) -> None:
        if interrupted.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        echo(f"\n{signal.Signals(signum).name}: stopping the run and its actors (Ctrl-C again to abort)")
        interrupted.set()

    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield interrupted
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_job(config: RunConfig, address: str | None = None, echo: Callable[[str], None] = print) -> RunResult:
    """Run the whole job on a local embedded Ray cluster (or the cluster at `address`)."""
    import ray

    from detached_rl.cli import jobs
    from detached_rl.config.shipping import task_shipment

    if config.maker.backend == "vllm" and not address:
        check_vllm_installed()  # the makers run on this machine: say so before Ray starts
    runtime_env = task_shipment(config)[1]  # the user's reward modules and dataset, to every actor's host
    with stop_on_signals(echo) as interrupted:
        started_ray = False
        try:
            if address:
                jobs.connect(address, config.namespace, runtime_env=runtime_env)
            elif not ray.is_initialized():
                # Logical CPU slots for the trainer and every maker, also on a machine with fewer cores.
                jobs.init_local_ray(config.namespace, include_dashboard=False, log_to_driver=False,
                                    configure_logging=True, logging_level=logging.WARNING,
                                    num_cpus=max(os.cpu_count() or 1, run_cpu_slots(config)),
                                    runtime_env=runtime_env)
                started_ray = True
            if interrupted.is_set():
                raise RunInterrupted("interrupted while starting Ray")
            # On a joined cluster the config's resources and node labels place the actors.
            runner = JobRunner(config, Path(config.run.output_dir), echo, interrupted, placed=bool(address))
            return runner.run()
        finally:
            if started_ray:
                ray.shutdown()
