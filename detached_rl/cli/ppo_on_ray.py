"""`detached-rl ppo-on-ray`: PPO with the four models in separate Ray groups, in the ancestor's shape.

ColossalChat's `train_prompts_on_ray.py` put the actor, critic, initial (reference) and reward
models into separate Ray actor groups. Here that maps onto named actors:

* actor   -> the trainer group `<name>-trainer` (`num_actor_nodes x max(1, num_gpus_per_node)` ranks;
             it trains the policy and the critic and pushes weights),
* critic  -> scorer group `<name>-critic` (values for the makers, weights from the trainer),
* initial -> scorer group `<name>-initial` (reference log-probs),
* reward  -> scorer group `<name>-reward` (a reward model, or a reward function of the prompt file's answers),
* plus `--num_makers` experience makers `<name>-maker-<i>` that generate and compose experience.

Timesteps follow the ancestor: an episode is `max_timesteps` experience batches of
`experience_batch_size` prompts; every `update_timesteps` batches make one training step
(`train_batch_size = update_timesteps x experience_batch_size`, `train_epochs` passes), and
the trainer pushes its weights after every step. The run trains
`num_episodes x max_timesteps / update_timesteps` steps, then saves the policy under
`--save_path` (Hugging Face `from_pretrained` format) and removes every actor it started.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from detached_rl.cli.arguments import non_negative_int, positive_float, positive_int

if TYPE_CHECKING:  # the CLI builds its parser from here: keep torch out of `detached-rl --help`
    from detached_rl.config import RunConfig

ARCHITECTURE_SHORTHANDS = ("gpt2", "bloom", "opt", "llama")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags (the ancestor's names; dashed spellings are accepted too)."""

    def flag(name: str, **kwargs: Any) -> None:
        parser.add_argument(f"--{name}", *([f"--{name.replace('_', '-')}"] if "_" in name else []), **kwargs)

    flag("prompt_csv", required=True, help="prompt file: CSV with a 'prompt' column and an optional 'answer' column "
                                           "(also .jsonl/.json with the same keys)")
    flag("model", default="llama", help="model architecture: a Hugging Face model_type (gpt2, bloom, opt and llama "
                                        "are the ancestor's shorthands) for a tiny random model of that type, or "
                                        "'smollm2' for the packaged SmolLM2-135M-Instruct (default llama)")
    flag("pretrain", default=None, help="local model directory to start from (overrides --model)")
    flag("strategy", default="naive", choices=("naive", "ddp", "colossalai_ddp", "colossalai_zero2",
                                                "colossalai_gemini"),
         help="how the actor (trainer) group trains (default naive; ddp/colossalai_ddp for several ranks on CPU; "
              "colossalai_zero2/gemini need CUDA)")
    flag("save_path", default="ppo_on_ray_actor", help="directory the trained policy is saved to (default "
                                                       "ppo_on_ray_actor)")
    flag("num_episodes", type=positive_int, default=1, help="episodes (default 1)")
    flag("max_timesteps", type=positive_int, default=4, help="experience batches per episode (default 4)")
    flag("update_timesteps", type=positive_int, default=2, help="experience batches per training step (default 2)")
    flag("train_epochs", type=positive_int, default=1, help="passes over each training batch (default 1)")
    flag("experience_batch_size", type=positive_int, default=4, help="prompts per experience batch (default 4)")
    flag("num_makers", type=positive_int, default=1, help="experience makers that generate (default 1)")
    flag("num_actor_nodes", type=positive_int, default=1, help="nodes of the actor (trainer) group (default 1)")
    flag("num_critic_nodes", type=positive_int, default=1, help="nodes of the critic scorer group (default 1)")
    flag("num_initial_nodes", type=positive_int, default=1, help="nodes of the initial (reference) scorer group (default 1)")
    flag("num_reward_nodes", type=positive_int, default=1, help="nodes of the reward scorer group (default 1)")
    flag("num_gpus_per_node", type=non_negative_int, default=0, help="GPUs per node of every group: a rank or worker per GPU "
                                                        "(a naive trainer takes one), and each maker takes one; "
                                                        "0 runs on CPU, one worker per node (default 0)")
    flag("reward", default=None, help="reward: 'model' (a reward model on the policy's architecture, or on "
                                      "--reward_pretrain) or a reward function name (numeric_answer, answer_line, "
                                      "boxed, ...); default: numeric_answer when the prompt file has answers, "
                                      "else model")
    flag("reward_pretrain", default=None, help="local directory of the reward model's backbone (with --reward model)")
    flag("max_new_tokens", type=positive_int, default=16, help="response length limit (default 16)")
    flag("lr", type=positive_float, default=None, help="learning rate of the actor (default: ppo.actor_optimizer.lr, 1e-5)")
    flag("seed", type=non_negative_int, default=0, help="seed of the models and the makers' sampling (default 0)")
    flag("name", default="ppo", help="actor-name prefix (default ppo)")
    flag("timeout", type=positive_float, default=3600.0, help="give up after this many seconds (default 3600)")


def launcher_config(args: argparse.Namespace) -> RunConfig:
    """The `RunConfig` the flags describe (then `--config` and `--set` on top); errors name the flag."""
    for name in ("num_episodes", "max_timesteps", "update_timesteps", "train_epochs", "experience_batch_size",
                 "num_makers", "num_actor_nodes", "num_critic_nodes", "num_initial_nodes", "num_reward_nodes",
                 "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.num_gpus_per_node < 0:
        raise ValueError(f"--num_gpus_per_node must be >= 0, got {args.num_gpus_per_node}")
    batches = args.num_episodes * args.max_timesteps
    if batches < args.update_timesteps:
        raise ValueError(f"--update_timesteps {args.update_timesteps} is more than the run's {batches} experience "
                         "batches (num_episodes x max_timesteps): no training step would happen")
    from detached_rl.config import load_config

    prompt_file = Path(args.prompt_csv)
    if not prompt_file.is_file():
        raise ValueError(f"--prompt_csv: no file {str(prompt_file)!r}")
    from detached_rl.core.prompts import load_prompt_file

    has_answers = any("answer" in item.metadata for item in load_prompt_file(prompt_file))
    reward = args.reward or ("numeric_answer" if has_answers else "model")
    policy = args.pretrain or (args.model if args.model == "smollm2" else f"tiny-{args.model}")
    gpus = args.num_gpus_per_node
    train_batch = args.update_timesteps * args.experience_batch_size
    overrides = [
        "algorithm=ppo", f"model.policy={policy}", f"model.seed={args.seed}",
        f"task.prompt_file={prompt_file.resolve()}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"maker.experience_batch_size={args.experience_batch_size}", f"maker.seed={args.seed}",
        f"maker.reward_scorer={args.name}-reward", f"maker.reference_scorer={args.name}-initial",
        f"maker.critic_scorer={args.name}-critic",
        f"trainer.train_batch_size={train_batch}", f"trainer.buffer_max_samples={max(1024, 4 * train_batch)}",
        f"trainer_group.strategy={args.strategy}",
        # A naive trainer is one process: one GPU (on one node); a distributed group has a rank per GPU.
        f"trainer_group.world_size={args.num_actor_nodes * (1 if args.strategy == 'naive' else max(1, gpus))}",
        f"trainer_group.num_gpus_per_rank={1 if gpus else 0}",
        f"maker.num_gpus={1 if gpus else 0}",
    ]
    if reward == "model":
        overrides.append(f"model.reward_model={args.reward_pretrain or policy}")
    else:
        overrides.append(f"task.reward={reward}")
    for role, nodes in (("critic", args.num_critic_nodes), ("reference", args.num_initial_nodes),
                        ("reward", args.num_reward_nodes)):
        overrides += [f"scorers.{role}.num_nodes={nodes}", f"scorers.{role}.num_gpus_per_node={gpus}"]
    if args.lr is not None:
        overrides.append(f"ppo.actor_optimizer.lr={args.lr}")
    if args.namespace:
        overrides.append(f"namespace={args.namespace}")
    return load_config(args.config, [*overrides, *(args.set or [])])


def cpu_slots(config: RunConfig, makers: int) -> int:
    """Logical CPUs the run's actors ask for: trainer ranks, scorer workers and `makers` makers."""
    import math

    group = config.trainer_group
    slots = group.world_size * group.num_cpus_per_rank + makers * config.maker.num_cpus
    for role, name in config.maker.scorers.items():
        scorer = getattr(config.scorers, role)
        slots += scorer.num_workers * scorer.num_cpus_per_worker if name else 0
    return math.ceil(slots)


def training_steps(args: argparse.Namespace) -> int:
    """Training steps of the run: num_episodes x max_timesteps / update_timesteps (rounded down)."""
    return args.num_episodes * args.max_timesteps // args.update_timesteps


def launch(args: argparse.Namespace, echo=print) -> dict[str, Any]:
    """Start the groups and makers, train, save the policy, remove every actor started; returns a summary."""
    from detached_rl.cli import jobs

    config = launcher_config(args)
    embedded = args.address is None
    if embedded:
        # Logical CPU slots for every group's bundles: the actors mostly wait on each other.
        jobs.init_local_ray(config.namespace, include_dashboard=False, log_to_driver=False,
                            num_cpus=max(os.cpu_count() or 1, cpu_slots(config, args.num_makers)))
    else:
        jobs.connect(args.address, config.namespace)
    import ray  # after init: on a loopback cluster Ray reads its address settings when imported

    from detached_rl.actors.launch import launch_requests
    from detached_rl.models.export import MERGED_DIR, write_files

    steps = training_steps(args)
    started: list[str] = []
    start = time.monotonic()
    deadline = start + args.timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise jobs.JobError(f"the run did not start within --timeout {args.timeout:g} s")
        return remaining

    makers = [f"{args.name}-maker-{index}" for index in range(args.num_makers)]
    try:
        # Everything at once: a run the cluster can never hold is refused before any actor starts.
        jobs.check_placeable(launch_requests(config, f"{args.name}-trainer", makers, list(config.maker.scorers)))
        trainers = jobs.start_trainer(config, f"{args.name}-trainer", steps, 1, timeout=left(),
                                      **({"train_epochs": args.train_epochs} if args.train_epochs != 1 else {}))
        started += trainers
        echo(f"actor group: {', '.join(trainers)} ({config.trainer_group.strategy}); {steps} training steps of "
             f"{config.trainer.train_batch_size} samples")
        scorers = jobs.start_scorers(config, trainers, timeout=left())
        started += scorers
        echo(f"critic, initial and reward groups: {', '.join(scorers)}")
        for index, name in enumerate(makers):
            jobs.start_maker(config, name, trainers, None, shard=(index, args.num_makers), timeout=left())
            started.append(name)
        echo(f"makers: {', '.join(n for n in started if '-maker-' in n)}")
        status = _wait_for_trainers(trainers, config.namespace, start + args.timeout, echo)
        trainer = ray.get_actor(trainers[0], namespace=config.namespace)
        save_path = Path(args.save_path)
        write_files(ray.get(trainer.export_policy.remote(), timeout=600), save_path)
        saved = save_path / MERGED_DIR if (save_path / MERGED_DIR).is_dir() else save_path
        echo(f"done: {status['steps']} steps, policy v{status['policy_version']}, {time.monotonic() - start:.1f} s; "
             f"policy saved to {saved}")
        return {"steps": status["steps"], "policy_version": status["policy_version"], "saved": str(saved),
                "actors": started, "seconds": time.monotonic() - start}
    finally:
        if started:
            jobs.stop(started, config.namespace, force=True, timeout=30)
        if embedded:
            ray.shutdown()


def _wait_for_trainers(trainers: list[str], namespace: str, deadline: float, echo) -> dict[str, Any]:
    from detached_rl.cli import jobs

    last = None
    while True:
        rows = [jobs.status_of(name, namespace) for name in trainers]
        first = rows[0]
        line = f"step {first.get('steps', 0)}  version {first.get('policy_version')}  state {first.get('state')}"
        if line != last:
            echo(line)
            last = line
        failed = [row for row in rows if row.get("state") in ("failed", "dead", "stopped")]
        if failed:
            raise jobs.JobError(f"trainer {failed[0]['name']!r} {failed[0]['state']}: {failed[0].get('last_error')}")
        if all(row.get("state") == "done" for row in rows):
            return first
        if time.monotonic() > deadline:
            raise jobs.JobError(f"the run did not finish in time (trainer at step {first.get('steps')})")
        time.sleep(1.0)
