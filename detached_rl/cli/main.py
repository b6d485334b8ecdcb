"""The `detached-rl` console script: run, ppo-on-ray, check, trainer, maker, scorers, status, inspect, export,
stop.

Every command has `--help`. Failures (bad config, unknown actor name, unreachable cluster)
print one line on stderr and exit with status 2, never a traceback (set DETACHED_RL_DEBUG=1
to see one).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from detached_rl import __version__
from detached_rl.cli.arguments import (
    OneLineParser,
    config_file,
    finite_float,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from detached_rl.cli.command_config import (
    command_config,
    refuse_checkpoint_missing_on_trainer,
    refuse_unloadable_models,
    refuse_unusable_task,
    run_command_config,
)
from detached_rl.config.schema import RUN_GPUS, TASKS, RunConfig
from detached_rl.config.shipping import task_shipment
from detached_rl.core.namespace import DEFAULT_NAMESPACE
from detached_rl.core.resources import PLACEMENT_STRATEGIES
from detached_rl.maker.config import ATTACH_TIMEOUT_S
from detached_rl.strategies.registry import STRATEGIES

_config, _run_config = command_config, run_command_config  # the names callers and tests import from here

EXIT_ERROR = 2


def _check(args: argparse.Namespace) -> int:
    from detached_rl.cli.check import format_report, run_check
    from detached_rl.models.specs import model_spec_problem

    problem = model_spec_problem(args.model)
    if problem:
        raise ValueError(f"--model: {problem}")
    print(f"detached-rl {__version__}: end-to-end check with model {args.model!r}", flush=True)
    report = run_check(
        model=args.model, num_prompts=args.prompts, group_size=args.group_size,
        max_new_tokens=args.max_new_tokens, seed=args.seed,
    )
    print(format_report(report))
    return 0 if report.ok else 1


def _run(args: argparse.Namespace) -> int:
    from detached_rl.cli.run import RunInterrupted, run_job

    config = run_command_config(args)
    # A joined cluster's nodes may hold model directories this machine does not.
    refuse_unloadable_models(config, local=not args.address)
    refuse_unusable_task(config)
    try:
        run_job(config, address=args.address)
    except RunInterrupted as error:
        print(f"detached-rl: {error}; the run's actors were shut down", file=sys.stderr)
        return 130
    return 0


def _ppo_on_ray(args: argparse.Namespace) -> int:
    from detached_rl.cli.ppo_on_ray import launch

    launch(args, echo=lambda line: print(line, flush=True))
    return 0


def _namespace(args: argparse.Namespace) -> str:
    return args.namespace or DEFAULT_NAMESPACE


def _trainer(args: argparse.Namespace) -> int:
    from detached_rl.cli import jobs

    config = command_config(args)
    # Paths on the trainer's host (which may be another than this one's); a relative one is taken from the
    # directory this command runs in.
    checkpointing = {"checkpoint_every": args.checkpoint_every,
                     "checkpoint_dir": str(Path(args.checkpoint_dir).resolve()) if args.checkpoint_dir
                     else None,
                     "resume_from": str(Path(args.resume_from).resolve()) if args.resume_from else None}
    jobs.connect(args.address, config.namespace)
    names = jobs.start_trainer(config, args.name, args.steps, args.update_steps, **checkpointing)
    if checkpointing["resume_from"]:
        try:  # read where the trainer runs, so checked there once it is placed
            refuse_checkpoint_missing_on_trainer(checkpointing["resume_from"],
                                                 [jobs.handle_of(name, config.namespace) for name in names])
        except Exception:
            jobs.stop(names, config.namespace, force=True, timeout=10)
            raise
    group = config.trainer_group
    if len(names) > 1 or group.strategy != "naive":
        print(f"trainer group {args.name!r} started in namespace {config.namespace!r}: ranks "
              f"{', '.join(names)} ({group.strategy}, {group.placement_strategy}; {args.steps} steps); "
              "makers push to any of them")
    else:
        print(f"trainer {args.name!r} started in namespace {config.namespace!r} ({args.steps} steps)")
    return _follow(names[0], config.namespace) if args.wait else 0


def _maker(args: argparse.Namespace) -> int:
    from detached_rl.cli import jobs

    config = command_config(args)
    refuse_unusable_task(config)
    trainers = [t.strip() for t in (args.trainers or "").split(",") if t.strip()]
    if not trainers:
        raise ValueError(f"--trainers {args.trainers!r}: no trainer names (comma-separated, e.g. "
                         "trainer_0,trainer_1)")
    jobs.connect(args.address, config.namespace, runtime_env=task_shipment(config)[1])
    missing = _missing_trainers(trainers, config.namespace)
    jobs.start_maker(config, args.name, trainers, args.batches, args.state_dir)
    print(f"maker {args.name!r} started in namespace {config.namespace!r}, feeding {', '.join(trainers)}")
    if missing:  # jobs may start in any order, so not an error; a typo shows here at once
        print(f"detached-rl: warning: no trainer named {', '.join(map(repr, missing))} is running "
              f"in namespace {config.namespace!r} yet; the maker waits for it up to "
              f"{ATTACH_TIMEOUT_S:g} s, then "
              "stops with an error (see `detached-rl status`)",
              file=sys.stderr)
    return _follow(args.name, config.namespace) if args.wait else 0


def _missing_trainers(trainers: Sequence[str], namespace: str) -> list[str]:
    """The names among `trainers` with no running actor in `namespace`."""
    import ray

    missing = []
    for trainer in trainers:
        try:
            ray.get_actor(trainer, namespace=namespace)
        except ValueError:
            missing.append(trainer)
    return missing


def _scorers(args: argparse.Namespace) -> int:
    from detached_rl.cli import jobs

    config = command_config(args)
    refuse_unusable_task(config)
    if not config.maker.scorers:
        raise ValueError("no scorer groups configured: set maker.reward_scorer, maker.reference_scorer or "
                         "maker.critic_scorer (the group names makers will use)")
    trainers = [t for t in (args.trainers or "").split(",") if t]
    jobs.connect(args.address, config.namespace, runtime_env=task_shipment(config)[1])
    started = jobs.start_scorers(config, trainers)
    groups = ", ".join(f"{role}: {name}" for role, name in config.maker.scorers.items())
    print(f"scorer groups ({groups}) in namespace {config.namespace!r}: "
          + (f"started {', '.join(started)}" if started else "already running"))
    return 0


def _follow(name: str, namespace: str) -> int:
    import time

    from detached_rl.cli import jobs

    last = None
    while True:
        row = jobs.status_of(name, namespace)
        line = jobs.format_status([row]).splitlines()[-1]
        if line != last:
            print(line, flush=True)
            last = line
        if row.get("state") in ("done", "failed", "stopped", "dead", "idle"):
            return 0 if row.get("state") in ("done", "stopped", "idle") and not row.get("last_error") else 1
        time.sleep(2.0)


def _status(args: argparse.Namespace) -> int:
    from detached_rl.cli import jobs

    namespace = _namespace(args)
    jobs.connect(args.address, namespace)
    rows = jobs.all_status(namespace)
    print(json.dumps(rows, indent=2, default=str) if args.json else jobs.format_status(rows))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from detached_rl.cli import jobs

    namespace = _namespace(args)
    jobs.connect(args.address, namespace)
    report = jobs.inspect(args.name, namespace, args.last, args.maker, args.min_reward)
    print(json.dumps(report, indent=2, default=str) if args.json else jobs.format_inspection(report))
    return 0


def _export(args: argparse.Namespace) -> int:
    from detached_rl.cli import jobs

    namespace = _namespace(args)
    jobs.connect(args.address, namespace)
    count = jobs.export(args.name, namespace, Path(args.output))
    print(f"wrote {count} samples of {args.name!r} to {args.output}")
    return 0


def _stop(args: argparse.Namespace) -> int:
    from detached_rl.cli import jobs

    namespace = _namespace(args)
    jobs.connect(args.address, namespace)
    stopped = jobs.stop(list(args.names), namespace, args.force, args.timeout)
    print("stopped " + (", ".join(stopped) if stopped else "nothing (no actors in the namespace)"))
    return 0


def _cluster_options(
    parser: argparse.ArgumentParser,
    address_help: str = "Ray cluster: host:port, ray://host:port (Ray client) or auto (default: "
                        "$RAY_ADDRESS or auto)",
) -> None:
    parser.add_argument("--address", default=None, help=address_help)
    parser.add_argument("--namespace", default=None,
                        help=f"Ray namespace of the actors (default: {DEFAULT_NAMESPACE})")


def _config_options(parser: argparse.ArgumentParser,
                    config_help: str = "YAML laid over the defaults, the main job's (its recipe: "
                                       "detached_rl/config/run.yaml)") -> None:
    parser.add_argument("--config", type=config_file, default=None, help=config_help)
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config value, e.g. --set trainer.train_batch_size=16 (repeatable)")


def _backend_option(parser: argparse.ArgumentParser, defaults: RunConfig) -> None:
    parser.add_argument("--backend", default=None,
                        help=f"the makers' generation backend (default {defaults.maker.backend}): auto (vllm "
                             "where it serves the policy, else hf) | hf | vllm (needs the vllm extra; engine "
                             "settings under maker.vllm, e.g. --set maker.vllm.kv_cache_gb=2)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command; the defaults it names are `RunConfig()`'s."""
    defaults = RunConfig()
    parser = OneLineParser(prog="detached-rl", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"detached-rl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run", help="the main job: 1 trainer + N makers train a model, then held-out accuracy before/after",
        description="Start (or join) a Ray cluster, train with one named trainer and N named "
                    "makers, grade the held-out split before and after, and write runs/<name>/ (metrics, "
                    "TensorBoard, plot, adapter, merged model). Defaults: SmolLM2-135M-Instruct + LoRA, "
                    "GRPO, arithmetic word problems.")
    run.add_argument("--steps", type=positive_int, default=None,
                     help=f"training steps (default {defaults.run.steps})")
    run.add_argument("--makers", type=positive_int, default=None,
                     help=f"experience makers (default {defaults.run.makers})")
    run.add_argument("--model", default=None,
                     help=f"smollm2 | tiny[-<model_type>] | a local model directory | a Hugging Face Hub id "
                          f"such as Qwen/Qwen2.5-0.5B-Instruct (model.revision pins its revision; default "
                          f"{defaults.model.policy})")
    run.add_argument("--task", default=None, choices=TASKS, help=f"default {defaults.task.name}")
    run.add_argument("--name", default=None,
                     help="run name: actor-name prefix and runs/<name> (default: dated)")
    run.add_argument("--output", default=None,
                     help=f"parent directory of the run directory (default {defaults.run.output_dir})")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--gpus", default=None, choices=RUN_GPUS,
                     help=f"default {defaults.run.gpus}; auto: trainer and makers share the cluster's GPUs "
                          "unless the config sets trainer_group.num_gpus_per_rank or maker.num_gpus; manual: "
                          "only what those say")
    _backend_option(run, defaults)
    _config_options(run)
    _cluster_options(run, "join this Ray cluster (host:port, ray://host:port or auto) instead of starting an "
                          "embedded one on 127.0.0.1")
    run.set_defaults(handler=_run)

    ppo_on_ray = commands.add_parser(
        "ppo-on-ray", help="PPO with actor, critic, initial and reward models in separate Ray groups (the "
                           "ancestor's train_prompts_on_ray shape)",
        description="Start the actor (trainer) group, the critic, initial (reference) and reward "
                    "scorer groups and the makers as named actors, each group in its own placement "
                    "group; train num_episodes x max_timesteps / update_timesteps PPO steps; save "
                    "the policy; remove them all. Without --address it starts an embedded Ray on "
                    "127.0.0.1. Place groups on nodes with custom resources, e.g. --set "
                    "scorers.reward.resources={reward_node: 1}.")
    from detached_rl.cli.ppo_on_ray import add_arguments

    add_arguments(ppo_on_ray)
    _config_options(ppo_on_ray, "YAML laid over what the flags set (any RunConfig key)")
    _cluster_options(ppo_on_ray,
                     "join this Ray cluster (host:port, ray://host:port or auto) instead of starting an "
                                 "embedded one on 127.0.0.1")
    ppo_on_ray.set_defaults(handler=_ppo_on_ray)

    check = commands.add_parser("check",
                                help="load a model, apply LoRA, generate, score and take one GRPO "
                                     "step (no Ray)",
                                description="End-to-end check of the toolkit's core in one process.")
    check.add_argument("--model", default=defaults.model.policy,
                       help="smollm2 | tiny[-<model_type>] | a local model directory (default %(default)s)")
    check.add_argument("--prompts", type=positive_int, default=4, help="distinct prompts (default 4)")
    check.add_argument("--group-size", type=positive_int, default=4, help="responses per prompt (default 4)")
    check.add_argument("--max-new-tokens", type=positive_int, default=32,
                       help="response length limit (default 32)")
    check.add_argument("--seed", type=non_negative_int, default=0)
    check.set_defaults(handler=_check)

    trainer = commands.add_parser(
        "trainer", help="start a named detached trainer (PPO or GRPO; one rank or a data-parallel group)",
        description="Start a named, detached trainer; it outlives this command. With --world-size N > "
                    "1 it starts ranks <name>_0 ... <name>_{N-1} in one placement group, forming one "
                    "process group.")
    trainer.add_argument("--name", required=True, help="actor name (a group's ranks are <name>_<rank>)")
    group = defaults.trainer_group
    trainer.add_argument("--world-size", type=positive_int, default=None,
                         help=f"data-parallel ranks (default {group.world_size})")
    trainer.add_argument("--strategy", default=None, choices=tuple(STRATEGIES),
                         help=f"how ranks train (default {group.strategy}; ddp or colossalai_ddp on CPU; "
                              "zero2/gemini need CUDA)")
    trainer.add_argument("--placement", default=None, choices=PLACEMENT_STRATEGIES,
                         help=f"placement-group strategy for the ranks (default {group.placement_strategy})")
    trainer.add_argument("--num-gpus-per-rank", type=non_negative_float, default=None,
                         help="GPUs each rank (a naive trainer: the trainer) asks Ray for; fractions of one "
                              "GPU allowed (default trainer_group.num_gpus_per_rank, "
                              f"{group.num_gpus_per_rank:g})")
    trainer.add_argument("--steps", type=positive_int, default=100, help="training steps (default 100)")
    trainer.add_argument("--update-steps", type=positive_int, default=1,
                         help="push weights every N steps (default 1)")
    trainer.add_argument("--checkpoint-every", type=non_negative_int, default=0,
                         help="save a checkpoint every N steps")
    trainer.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (one folder per rank)")
    trainer.add_argument("--resume-from", default=None, help="continue from a checkpoint directory")
    trainer.add_argument("--wait", action="store_true", help="follow the trainer until it finishes")
    _config_options(trainer)
    _cluster_options(trainer)
    trainer.set_defaults(handler=_trainer)

    maker = commands.add_parser("maker", help="start a named detached experience maker on a running cluster",
                                description="Start a named, detached maker; it waits for its "
                                            "trainers by name.")
    maker.add_argument("--name", required=True, help="actor name, e.g. maker_0")
    maker.add_argument("--trainers", required=True,
                       help="comma-separated trainer names, e.g. trainer_0,trainer_1")
    maker.add_argument("--batches", type=positive_int, default=None,
                       help="stop after N batches (default: until stopped)")
    maker.add_argument("--num-gpus", type=non_negative_float, default=None,
                       help="GPUs the maker asks Ray for; fractions of one GPU allowed (default "
                            f"maker.num_gpus, {defaults.maker.num_gpus:g})")
    maker.add_argument("--state-dir", default=None,
                       help="save the prompt cursor to <dir>/<name> after every batch; resume from it "
                            "on (re)start")
    _backend_option(maker, defaults)
    maker.add_argument("--wait", action="store_true", help="follow the maker until it stops")
    _config_options(maker)
    _cluster_options(maker)
    maker.set_defaults(handler=_maker)

    scorers = commands.add_parser(
        "scorers", help="start the scorer groups (reward, reference, critic) the config's makers name",
        description="Start named scorer groups that serve a role to many makers: "
                    "maker.<role>_scorer names each group, scorers.<role> shapes and places it (num_nodes, "
                    "num_gpus_per_node, resources). A critic group takes its weights from --trainers. Groups "
                    "already running are left as they are.")
    scorers.add_argument("--trainers", default="",
                         help="comma-separated trainer names (needed by a critic group)")
    _config_options(scorers)
    _cluster_options(scorers)
    scorers.set_defaults(handler=_scorers)

    status = commands.add_parser("status",
                                 help="every actor of the namespace: role, state, version, buffer, rate",
                                 description="One row per named actor of the namespace.")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _cluster_options(status)
    status.set_defaults(handler=_status)

    inspect = commands.add_parser("inspect",
                                  help="a trainer's replay buffer: sizes, staleness, makers, "
                                       "rewards, samples",
                                  description="Look into a trainer's replay buffer without "
                                              "stopping training.")
    inspect.add_argument("name", help="trainer name")
    inspect.add_argument("--last", type=non_negative_int, default=5,
                         help="newest samples to show (default 5)")
    inspect.add_argument("--maker", default=None, help="only samples from this maker")
    inspect.add_argument("--min-reward", type=finite_float, default=None,
                         help="only samples with at least this reward")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    _cluster_options(inspect)
    inspect.set_defaults(handler=_inspect)

    export = commands.add_parser("export",
                                 help="write a trainer's buffer to JSONL (or .parquet with pyarrow)",
                                 description="Export the buffer's samples while training continues.")
    export.add_argument("name", help="trainer name")
    export.add_argument("output", help="output path (.jsonl, or .parquet when pyarrow is installed)")
    _cluster_options(export)
    export.set_defaults(handler=_export)

    stop = commands.add_parser("stop", help="drain and stop named actors (all of the namespace by default)",
                               description="Stop makers, then trainers: finish the current batch or "
                                           "step, then kill.")
    stop.add_argument("names", nargs="*", help="actor names (default: every actor of the namespace)")
    stop.add_argument("--force", action="store_true", help="kill at once, without draining")
    stop.add_argument("--timeout", type=positive_float, default=60.0,
                      help="seconds to wait for each actor to drain")
    _cluster_options(stop)
    stop.set_defaults(handler=_stop)
    from detached_rl.cli.node import add_node_command

    add_node_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # transformers 5 deprecation noise raised from inside peft; not actionable for users.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("detached-rl: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # noqa: BLE001 - one line for the user; the message names what failed
        if os.environ.get("DETACHED_RL_DEBUG"):  # the full traceback, for bug reports
            raise
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"detached-rl: error: {text}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
