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
`--save_path` (a Hugging Face `from_pretrained` directory, or a torch state dict when the path ends
in `.pt`, as the ancestor saved) and removes every actor it started.

The ancestor's flags are accepted verbatim: `--prompt_csv_url` (a local path or `file://` URL:
nothing is downloaded), `--pretrain` (a Hub id, a local model directory or the packaged `smollm2`),
`--need_optim_ckpt` (the trainer's checkpoint and the actor optimizer's state beside the saved
policy), `--train_batch_size` (samples per optimizer step).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from detached_rl.cli.arguments import check_config_integers, non_negative_int, positive_float, positive_int

if TYPE_CHECKING:  # the CLI builds its parser from here: keep torch out of `detached-rl --help`
    from detached_rl.config import RunConfig

ARCHITECTURE_SHORTHANDS = ("gpt2", "bloom", "opt", "llama")
#: Where `--need_optim_ckpt` puts the actor optimizer's state of rank <r>, beside the saved policy (the
#: ancestor's name).
OPTIMIZER_FILE = "actor_optim_checkpoint_prompts_{rank}.pt"
#: The trainer's resumable checkpoint `--need_optim_ckpt` keeps beside the saved policy: `<save_path>` + this.
CHECKPOINT_SUFFIX = ".trainer_checkpoint"


def truth_value(text: str) -> bool:
    """An argparse type: true/false, yes/no, 1/0, on/off (the ancestor's `type=bool` took any text)."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1", "on"):
        return True
    if lowered in ("false", "no", "0", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def prompt_path(value: str) -> Path:
    """The local file a `--prompt_csv(_url)` value names: a path or a `file://` URL (nothing downloads)."""
    parsed = urlparse(value)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"--prompt_csv_url: {value!r} names a file on host {parsed.netloc!r}; "
                             "give a local path")
        return Path(unquote(parsed.path))
    if len(parsed.scheme) > 1:  # one letter is a Windows drive, not a scheme
        raise ValueError(f"--prompt_csv_url: {value!r} is a {parsed.scheme} URL and nothing is downloaded: "
                         "fetch the file first and give its local path or a file:// URL")
    return Path(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags (the ancestor's names; dashed spellings are accepted too)."""

    def flag(name: str, **kwargs: Any) -> None:
        parser.add_argument(f"--{name}", *([f"--{name.replace('_', '-')}"] if "_" in name else []), **kwargs)

    parser.add_argument("--prompt_csv", "--prompt-csv", "--prompt_csv_url", "--prompt-csv-url",
                        dest="prompt_csv", required=True,
                        help="prompt file: CSV with a 'prompt' column and an optional 'answer' "
                             "column (also .jsonl/.json with the same keys, or ColossalChat's "
                             "'messages'/'gt_answer' lines); a local path or a file:// URL "
                             "(--prompt_csv_url, the ancestor's name; nothing is downloaded)")
    flag("model", default="llama",
         help="model architecture: a Hugging Face model_type (gpt2, bloom, opt and llama "
              "are the ancestor's shorthands) for a tiny random model of that type, or "
              "'smollm2' for the packaged SmolLM2-135M-Instruct (default llama)")
    flag("pretrain", default=None,
         help="model to start from (overrides --model): a local Hugging Face model "
              "directory or the packaged 'smollm2'; hub names are not downloaded")
    flag("strategy", default="naive", choices=("naive", "ddp", "colossalai_ddp", "colossalai_zero2",
                                                "colossalai_gemini"),
         help="how the actor (trainer) group trains (default naive; ddp/colossalai_ddp for several ranks "
              "on CPU; colossalai_zero2/gemini need CUDA)")
    flag("save_path", default="ppo_on_ray_actor",
         help="where the trained policy is saved: a path ending in .pt "
              "gets a torch state dict (the ancestor's format), any other "
              "a from_pretrained directory (default ppo_on_ray_actor)")
    flag("need_optim_ckpt", type=truth_value, nargs="?", const=True, default=False,
         help="also save the actor optimizer's state beside the policy "
              "(actor_optim_checkpoint_prompts_<rank>.pt) "
              f"and the trainer's resumable checkpoint (<save_path>{CHECKPOINT_SUFFIX}); takes true/false "
              "or no value (default false)")
    flag("num_episodes", type=positive_int, default=1, help="episodes (default 1)")
    flag("max_timesteps", type=positive_int, default=4, help="experience batches per episode (default 4)")
    flag("update_timesteps", type=positive_int, default=2,
         help="experience batches per training step (default 2)")
    flag("train_epochs", type=positive_int, default=1, help="passes over each training batch (default 1)")
    flag("experience_batch_size", type=positive_int, default=4,
         help="prompts per experience batch (default 4)")
    flag("train_batch_size", type=positive_int, default=None,
         help="samples per optimizer step (ppo.mini_batch_size), at most update_timesteps x "
              "experience_batch_size (default: that whole training batch, one optimizer step per pass)")
    flag("num_makers", type=positive_int, default=1, help="experience makers that generate (default 1)")
    flag("num_actor_nodes", type=positive_int, default=1,
         help="nodes of the actor (trainer) group (default 1)")
    flag("num_critic_nodes", type=positive_int, default=1,
         help="nodes of the critic scorer group (default 1)")
    flag("num_initial_nodes", type=positive_int, default=1,
         help="nodes of the initial (reference) scorer group (default 1)")
    flag("num_reward_nodes", type=positive_int, default=1,
         help="nodes of the reward scorer group (default 1)")
    flag("num_gpus_per_node", type=non_negative_int, default=0,
         help="GPUs per node of every group: a rank or worker per GPU "
              "(a naive trainer takes one), and each maker takes one; "
              "0 runs on CPU, one worker per node (default 0)")
    flag("reward", default=None,
         help="reward: 'model' (a reward model on the policy's architecture, or on "
              "--reward_pretrain) or a reward function name (numeric_answer, answer_line, "
              "boxed, ...); default: numeric_answer when the prompt file has answers, "
              "else model")
    flag("reward_pretrain", default=None,
         help="local directory of the reward model's backbone (with --reward model)")
    flag("max_new_tokens", type=positive_int, default=16, help="response length limit (default 16)")
    flag("lr", type=positive_float, default=None,
         help="learning rate of the actor (default: ppo.actor_optimizer.lr, 1e-5)")
    flag("seed", type=non_negative_int, default=0,
         help="seed of the models and the makers' sampling (default 0)")
    flag("name", default="ppo", help="actor-name prefix (default ppo)")
    flag("timeout", type=positive_float, default=3600.0,
         help="give up after this many seconds (default 3600)")


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
        raise ValueError(f"--update_timesteps {args.update_timesteps} is more than the run's {batches} "
                         "experience batches (num_episodes x max_timesteps): no training step would happen")
    train_batch = args.update_timesteps * args.experience_batch_size
    if args.train_batch_size is not None and args.train_batch_size > train_batch:
        raise ValueError(f"--train_batch_size {args.train_batch_size} is more than the {train_batch} samples "
                         "of a training step (update_timesteps x experience_batch_size)")
    from detached_rl.config import load_config
    from detached_rl.models.specs import model_spec_problem

    for flag_name in ("pretrain", "reward_pretrain"):
        spec = getattr(args, flag_name)
        # On a joined cluster a path may exist on the actors' nodes only; a relative one never works there.
        problem = model_spec_problem(spec) if spec is not None else None
        if problem and (args.address is None or not os.path.isabs(spec)):
            raise ValueError(f"--{flag_name}: {problem}")
    prompt_file = prompt_path(args.prompt_csv)
    if not prompt_file.is_file():
        raise ValueError(f"--prompt_csv: no file {str(prompt_file)!r}")
    from detached_rl.core.prompts import load_prompt_file

    has_answers = any("answer" in item.metadata for item in load_prompt_file(prompt_file))
    reward = args.reward or ("numeric_answer" if has_answers else "model")
    policy = args.pretrain or (args.model if args.model == "smollm2" else f"tiny-{args.model}")
    gpus = args.num_gpus_per_node
    overrides = [
        # The ancestor's job where the defaults (the main job's) differ: the whole policy trained, one
        # response per prompt sampled at temperature 1 by HF generate, full weight updates, two pushes in
        # flight, no staleness bound.
        "model.lora=null", "maker.group_size=1", "sampling.temperature=1.0", "maker.backend=hf",
        "maker.max_pushes_in_flight=2", "maker.wait_for_ack=false", "trainer.weight_sync=full",
        "trainer.overlap_weight_push=false", "trainer.max_staleness=null",
        "algorithm=ppo", f"model.policy={policy}", f"model.seed={args.seed}",
        f"task.prompt_file={prompt_file.resolve()}",
        f"sampling.max_new_tokens={args.max_new_tokens}",
        f"maker.experience_batch_size={args.experience_batch_size}", f"maker.seed={args.seed}",
        f"maker.reward_scorer={args.name}-reward", f"maker.reference_scorer={args.name}-initial",
        f"maker.critic_scorer={args.name}-critic",
        f"trainer.train_batch_size={train_batch}", f"trainer.buffer_max_samples={max(1024, 4 * train_batch)}",
        f"trainer_group.strategy={args.strategy}",
        # A naive trainer is one process: one GPU (on one node); a distributed group has a rank per GPU.
        "trainer_group.world_size="
        f"{args.num_actor_nodes * (1 if args.strategy == 'naive' else max(1, gpus))}",
        f"trainer_group.num_gpus_per_rank={1 if gpus else 0}",
        f"maker.num_gpus={1 if gpus else 0}",
    ]
    if reward == "model":
        # The ancestor's reward model: a new scalar head on the pretrained model (coati's RewardModel).
        overrides += [f"model.reward_model={args.reward_pretrain or policy}", "model.reward_head=fresh"]
    else:
        overrides.append(f"task.reward={reward}")
    for role, nodes in (("critic", args.num_critic_nodes), ("reference", args.num_initial_nodes),
                        ("reward", args.num_reward_nodes)):
        overrides += [f"scorers.{role}.num_nodes={nodes}", f"scorers.{role}.num_gpus_per_node={gpus}"]
    if args.lr is not None:
        overrides.append(f"ppo.actor_optimizer.lr={args.lr}")
    if args.train_batch_size is not None:
        overrides.append(f"ppo.mini_batch_size={args.train_batch_size}")
    if args.namespace:
        overrides.append(f"namespace={args.namespace}")
    config = load_config(args.config, [*overrides, *(args.set or [])])
    check_config_integers(config)
    problem = model_spec_problem(config.model.policy) if config.model.policy.startswith("tiny") else None
    if problem:  # an unknown --model architecture
        raise ValueError(f"--model: {problem}")
    return config


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


def launch_requests_of(config: RunConfig, name: str, makers: list[str]) -> dict[str, dict[str, float]]:
    """Label -> resources of every actor the run starts (trainer ranks, scorer workers, makers)."""
    from detached_rl.actors.launch import launch_requests

    return launch_requests(config, f"{name}-trainer", makers, list(config.maker.scorers))


def train_detached(config: RunConfig, name: str, steps: int, num_makers: int, timeout: float,
                   echo: Callable[[str], None] = print, update_steps: int = 1,
                   **fit_options: Any) -> dict[str, Any]:
    """On the connected cluster: start the trainer (group) `<name>-trainer`, the scorer groups `config.maker`
    names and `num_makers` makers `<name>-maker-<i>`; wait until the trainer trained `steps` steps (pushing
    weights every `update_steps`; `fit_options` go to its `fit`); return its status, per-step metrics and
    policy files.

    A run the cluster can never place is refused before any actor starts; each start and the whole run take at
    most `timeout` s. Every actor started is removed at the end, also on errors.
    """
    import ray

    from detached_rl.cli import jobs

    start = time.monotonic()
    deadline = start + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise jobs.JobError(f"the run did not start within --timeout {timeout:g} s")
        return remaining

    makers = [f"{name}-maker-{index}" for index in range(num_makers)]
    started: list[str] = []
    try:
        jobs.check_placeable(launch_requests_of(config, name, makers))  # before any actor starts
        trainers = jobs.start_trainer(config, f"{name}-trainer", steps, update_steps, timeout=left(),
                                      **fit_options)
        started += trainers
        echo(f"actor group: {', '.join(trainers)} ({config.trainer_group.strategy}); {steps} training steps "
             f"of {config.trainer.train_batch_size} samples")
        if config.maker.scorers:
            scorers = jobs.start_scorers(config, trainers, timeout=left())
            started += scorers
            echo(f"critic, initial and reward groups: {', '.join(scorers)}")
        for index, maker in enumerate(makers):
            jobs.start_maker(config, maker, trainers, None, shard=(index, num_makers), timeout=left())
            started.append(maker)
        echo(f"makers: {', '.join(makers)}")
        status = _wait_for_trainers(trainers, config.namespace, deadline, echo)
        trainer = ray.get_actor(trainers[0], namespace=config.namespace)
        metrics = ray.get(trainer.metrics.remote(), timeout=60)
        files = ray.get(trainer.export_policy.remote(), timeout=600)
        return {"status": status, "metrics": metrics, "files": files, "actors": list(started),
                "seconds": time.monotonic() - start}
    finally:
        if started:
            jobs.stop(started, config.namespace, force=True, timeout=30)


def save_policy(files: dict[str, bytes], save_path: str | os.PathLike[str]) -> Path:
    """Write the trainer's policy files so that `save_path` itself loads; returns `save_path`."""
    from detached_rl.models.export import MERGED_DIR, write_files

    save_path = Path(save_path)
    if save_path.suffix != ".pt":
        # A directory `from_pretrained(save_path)` reads: the merged model at its top, a LoRA adapter (if the
        # policy has one) in its `adapter/`. A `.pt` path: the merged model's state dict (below).
        merged = f"{MERGED_DIR}/"
        write_files({name.removeprefix(merged): data for name, data in files.items()}, save_path)
        return save_path
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="detached_rl_policy_") as tmp:
        write_files(files, tmp)
        merged = Path(tmp) / MERGED_DIR
        model = AutoModelForCausalLM.from_pretrained(merged if merged.is_dir() else tmp)
    save_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), save_path)
    return save_path


def checkpoint_dir_of(save_path: str | os.PathLike[str]) -> Path:
    """Where `--need_optim_ckpt` keeps the trainer's checkpoint: `<save_path>` + CHECKPOINT_SUFFIX."""
    save_path = Path(save_path).resolve()
    return save_path.with_name(save_path.name + CHECKPOINT_SUFFIX)


def save_optimizer_states(checkpoint_dir: str | os.PathLike[str],
                          save_path: str | os.PathLike[str]) -> list[Path]:
    """Write each rank's actor optimizer state from the trainer checkpoint `checkpoint_dir` as a torch file
    beside `save_path` (`OPTIMIZER_FILE`); returns the files."""
    import torch

    from detached_rl.core.checkpoint import load_state

    checkpoint_dir = Path(checkpoint_dir)
    ranks = sorted(checkpoint_dir.glob("rank_*"), key=lambda path: int(path.name.partition("_")[2]))
    if not ranks:
        raise FileNotFoundError(f"--need_optim_ckpt: no trainer checkpoint under {checkpoint_dir} (on a "
                                "cluster of several machines it is on the trainer's node)")
    written = []
    for rank_dir in ranks:
        state = load_state(rank_dir)
        target = Path(save_path).parent / OPTIMIZER_FILE.format(rank=rank_dir.name.partition("_")[2])
        target.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state["learner"]["actor_optimizer"], target)
        written.append(target)
    return written


def launch(args: argparse.Namespace, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Start the groups and makers, train, save the policy, remove every actor started; returns a summary."""
    from detached_rl.cli import jobs

    start = time.monotonic()
    config = launcher_config(args)
    embedded = args.address is None
    if embedded:
        # Logical CPU slots for every group's bundles: the actors mostly wait on each other.
        jobs.init_local_ray(config.namespace, include_dashboard=False, log_to_driver=False,
                            num_cpus=max(os.cpu_count() or 1, cpu_slots(config, args.num_makers)))
    else:
        jobs.connect(args.address, config.namespace)
    import ray  # after init: on a loopback cluster Ray reads its address settings when imported

    steps = training_steps(args)
    fit_options: dict[str, Any] = {"train_epochs": args.train_epochs} if args.train_epochs != 1 else {}
    if args.need_optim_ckpt:
        fit_options.update(checkpoint_every=steps, checkpoint_dir=str(checkpoint_dir_of(args.save_path)))
    try:
        result = train_detached(config, args.name, steps, args.num_makers,
                                args.timeout - (time.monotonic() - start), echo, **fit_options)
        status = result["status"]
        saved = save_policy(result["files"], args.save_path)
        optimizer_files = (save_optimizer_states(checkpoint_dir_of(args.save_path), args.save_path)
                           if args.need_optim_ckpt else [])
        echo(f"done: {status['steps']} steps, policy v{status['policy_version']}, "
             f"{time.monotonic() - start:.1f} s; policy saved to {saved}"
             + (f"; optimizer state in {', '.join(map(str, optimizer_files))}" if optimizer_files else ""))
        return {"steps": status["steps"], "policy_version": status["policy_version"], "saved": str(saved),
                "optimizer_files": [str(path) for path in optimizer_files], "actors": result["actors"],
                "seconds": time.monotonic() - start}
    finally:
        if embedded:
            ray.shutdown()


def _wait_for_trainers(trainers: list[str], namespace: str, deadline: float, echo) -> dict[str, Any]:
    from detached_rl.cli import jobs

    last = None
    while True:
        rows = [jobs.status_of(name, namespace) for name in trainers]
        first = rows[0]
        line = (f"step {first.get('steps', 0)}  version {first.get('policy_version')}  "
                f"state {first.get('state')}")
        if line != last:
            echo(line)
            last = line
        failed = [row for row in rows if row.get("state") in ("failed", "dead", "stopped")]
        if failed:
            raise jobs.JobError(f"trainer {failed[0]['name']!r} {failed[0]['state']}: "
                                f"{failed[0].get('last_error')}")
        if all(row.get("state") == "done" for row in rows):
            return first
        if time.monotonic() > deadline:
            raise jobs.JobError(f"the run did not finish in time (trainer at step {first.get('steps')})")
        time.sleep(1.0)
