"""Coming from ColossalChat's distributed GRPO (`coati.distributed.launch.launch_distributed`): its entry
point, prompt data and metric names over this project's trainer group and experience makers.

`launch_distributed` takes ColossalChat's arguments and runs them on the real parts: producers become
experience makers (`<name>-maker-<i>`, one prompt shard each), the consumer processes a trainer
group (`<name>-trainer`, data parallel), `num_generations` the GRPO group size and `n_behind` the
staleness bound. How each argument maps is in docs/coming-from-colossalchat.md. Prompt files in
ColossalChat's JSONL format (`{"messages": ..., "gt_answer": ...}`) are read by
`detached_rl.core.prompts.load_prompt_file` itself. Each step's metrics come back (and go to
`<save_dir>/metrics.jsonl`) under ColossalChat's names as well as ours (`colossalchat_metrics`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: ColossalChat's `core_algo` -> `grpo.algorithm` ("Simple", its SFT-like consumer, has no counterpart).
#: "REINFORCE++" is the reference page's spelling of REINFORCE_PPB (ColossalChat's REINFORCE++ baseline).
ALGORITHMS = {"GRPO": "grpo", "DAPO": "dapo", "RLOO": "rloo", "REINFORCE_PPB": "reinforce_pp_baseline",
              "REINFORCE++": "reinforce_pp_baseline"}

#: ColossalChat's `grpo_config["loss_variation"]` -> `grpo.loss_agg`.
LOSS_VARIATIONS = {"sample_level": "seq-mean-token-mean", "token_level": "token-mean"}

#: `inference_backend` -> `maker.backend`.
BACKENDS = {"transformers": "hf", "vllm": "vllm"}

#: grpo_config keys read here; the others it may hold (below) have no counterpart and are ignored.
GRPO_KEYS = ("algo", "lr", "beta", "clip_eps_low", "clip_eps_high", "loss_variation", "train_microbatch_size",
             "reward_fn_type", "max_new_tokens", "dynamic_batching", "soft_over_length_punishment",
             "cache_length")
IGNORED_GRPO_KEYS = ("max_length", "response_format_tags", "filter_range", "skip_threshold",
                     "filter_truncated_response", "code_verifier_api_url", "temperature_annealing")

#: ColossalChat's metric name -> ours (`detached_rl.algorithms.metrics` and the learner's batch metrics). The
#: four computed by `colossalchat_metrics` instead are in DERIVED_METRICS.
METRIC_ALIASES: dict[str, str] = {
    "metrics/reward": "reward/raw_mean",
    "metrics/response_length": "response_length/mean",
    "train/loss": "loss/total_avg",
    "train/kl": "loss/kl_avg",
    "train/learning_rate": "lr/actor",
    "train/entropy": "policy/entropy_avg",
    "metrics/format_acc": "reward/format_mean",
    "metrics/ans_acc": "reward/correct_mean",
    "train/advantages": "advantages/mean",
    "train/overlength_samples_ratio": "response/truncated_fraction",
}
#: Older ColossalChat names of the same values.
OLD_METRIC_NAMES = {"metrics/format_reward": "metrics/format_acc", "metrics/acc_reward": "metrics/ans_acc"}
#: Names computed from a step's metrics and the run's settings.
DERIVED_METRICS = ("train/sample_utilization", "rollout/temperature")


def colossalchat_metrics(row: Mapping[str, Any], temperature: float) -> dict[str, float]:
    """A step's metrics under ColossalChat's names (those whose value the step has), for a run sampling at
    `temperature`."""
    out = {theirs: float(row[ours]) for theirs, ours in METRIC_ALIASES.items() if ours in row}
    out.update({old: out[new] for old, new in OLD_METRIC_NAMES.items() if new in out})
    # ColossalChat's share of samples trained on after its dynamic-batching filter.
    out["train/sample_utilization"] = 1.0 - float(row.get("dynamic_sampling/dropped_fraction", 0.0))
    out["rollout/temperature"] = float(temperature)
    return out


def prompt_count(path: str | os.PathLike[str]) -> int:
    """Prompts in a prompt file (ColossalChat's format or ours)."""
    from detached_rl.core.prompts import load_prompt_file

    return len(load_prompt_file(path))


def data_parallel_size(num_consumer_procs: int, plugin_config: Mapping[str, Any]) -> int:
    """Consumer ranks that hold a whole model: all of them (tensor, pipeline, expert and sequence parallelism
    are refused, naming the key)."""
    for key in ("tp_size", "pp_size", "ep_size", "sp_size"):
        if int(plugin_config.get(key, 1)) != 1:
            raise ValueError(f"plugin_config[{key!r}] = {plugin_config[key]!r}: only data parallelism is "
                             "supported (trainer_group: one model replica per rank)")
    return num_consumer_procs


def trainer_strategy(num_consumer_procs: int, plugin_config: Mapping[str, Any]) -> str:
    """`trainer_group.strategy` for ColossalChat's consumer plugin: ZeRO stage 0 -> naive (one rank) or ddp,
    1 or 2 -> colossalai_zero2, 3 -> colossalai_gemini."""
    stage = int(plugin_config.get("zero_stage", 0))
    if stage == 0:
        return "naive" if num_consumer_procs == 1 else "ddp"
    if stage in (1, 2):
        return "colossalai_zero2"
    if stage == 3:
        return "colossalai_gemini"
    raise ValueError(f"plugin_config['zero_stage'] must be 0, 1, 2 or 3, got {stage!r}")


def _model_path(inference_model_config: Mapping[str, Any], train_model_config: Mapping[str, Any],
                tokenizer_config: Mapping[str, Any] | None) -> str:
    paths = {"inference_model_config": inference_model_config.get("path"),
             "train_model_config": train_model_config.get("path")}
    if tokenizer_config and tokenizer_config.get("path") is not None:
        paths["tokenizer_config"] = tokenizer_config["path"]
    for where, path in paths.items():
        if path is None:
            raise ValueError(f"{where}['path'] is missing")
    if len(set(paths.values())) != 1:
        raise ValueError(f"the model paths differ ({paths}); producers and consumers train one model")
    for where, config in (("inference_model_config", inference_model_config), ("train_model_config",
                                                                                  train_model_config)):
        if config.get("checkpoint_path") is not None:
            raise ValueError(f"{where}['checkpoint_path']: loading a ColossalAI checkpoint is not supported; "
                             "give the model as a Hugging Face directory in 'path'")
    from detached_rl.models.specs import model_spec_problem

    problem = model_spec_problem(str(paths["train_model_config"]))
    if problem:
        raise ValueError(f"train_model_config['path']: {problem}")
    return str(paths["train_model_config"])


def _max_new_tokens(generate_config: Mapping[str, Any], grpo_config: Mapping[str, Any],
                    train_dataset_config: Mapping[str, Any]) -> int:
    for source, key in ((generate_config, "max_new_tokens"), (generate_config, "max_tokens"),
                        (grpo_config, "max_new_tokens")):
        if source.get(key) is not None:
            return int(source[key])
    if generate_config.get("max_length") is not None:  # transformers: prompt + response
        return int(generate_config["max_length"]) - int(train_dataset_config.get("max_length", 0))
    raise ValueError("generate_config needs 'max_new_tokens', 'max_tokens' or 'max_length' (or grpo_config "
                     "'max_new_tokens')")


def _prompt_file(train_dataset_config: Mapping[str, Any], save_dir: Path) -> str:
    """The prompt file the makers read: the dataset itself, or with `system_prompt` a copy of it whose prompts
    start with that system message (written under `save_dir`)."""
    from detached_rl.core.prompts import load_prompt_file

    if "path" not in train_dataset_config:
        raise ValueError("train_dataset_config['path'] is missing")
    path = Path(train_dataset_config["path"]).resolve()
    system_prompt = train_dataset_config.get("system_prompt")
    if system_prompt is None:
        return str(path)
    items = load_prompt_file(path, system_prompt=system_prompt)
    target = save_dir / f"{path.stem}.with_system_prompt.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(json.dumps({"prompt": item.prompt, **item.metadata}) + "\n" for item in items),
                      encoding="utf-8")
    return str(target)


def run_config_of(
    *,
    num_producers: int,
    num_proc_per_producer: int,
    num_consumer_procs: int,
    inference_batch_size: int,
    train_batch_size: int,
    train_minibatch_size: int,
    train_dataset_config: Mapping[str, Any],
    inference_model_config: Mapping[str, Any],
    generate_config: Mapping[str, Any],
    train_model_config: Mapping[str, Any],
    grpo_config: Mapping[str, Any],
    plugin_config: Mapping[str, Any],
    tokenizer_config: Mapping[str, Any] | None,
    inference_backend: str,
    num_generations: int,
    core_algo: str,
    n_behind: int,
    update_steps: int,
    save_dir: Path,
    namespace: str,
    name: str,
    use_gpus: bool,
    overrides: Sequence[str] = (),
) -> Any:
    """The `RunConfig` ColossalChat's launch arguments describe (then `overrides`, KEY=VALUE, on top)."""
    from detached_rl.config.loading import from_dict, merge_mappings, parse_override
    from detached_rl.config.schema import RunConfig

    if core_algo not in ALGORITHMS:
        raise ValueError(f"core_algo must be one of {sorted(ALGORITHMS)}, got {core_algo!r}")
    data_parallel_size(num_consumer_procs, plugin_config)
    if inference_backend not in BACKENDS:
        raise ValueError(f"inference_backend must be one of {sorted(BACKENDS)}, got {inference_backend!r}")
    unknown = sorted(set(grpo_config) - set(GRPO_KEYS) - set(IGNORED_GRPO_KEYS))
    if unknown:
        raise ValueError(f"grpo_config: unknown key(s) {unknown}")
    if ALGORITHMS.get(grpo_config.get("algo", core_algo)) != ALGORITHMS[core_algo]:
        raise ValueError(f"grpo_config['algo'] {grpo_config['algo']!r} differs from core_algo {core_algo!r}")
    if train_batch_size % train_minibatch_size:
        raise ValueError(f"train_batch_size {train_batch_size} must be a multiple of train_minibatch_size "
                         f"{train_minibatch_size}")
    top_k = generate_config.get("top_k")
    # Where our defaults (the main job's) differ from what their launch does: their lr, no KL term, the
    # variant's loss aggregation, no autocast; below, the whole model, full weight updates.
    grpo: dict[str, Any] = {"algorithm": ALGORITHMS[core_algo], "actor_optimizer": {"lr": 1e-6},
                            "kl_coef": 0.0, "loss_agg": None, "micro_batch_size": 8, "autocast_dtype": None,
                            "mini_batch_size": train_minibatch_size * num_generations}
    for theirs, ours in (("beta", "kl_coef"), ("clip_eps_low", "clip_low"), ("clip_eps_high", "clip_high"),
                         ("train_microbatch_size", "micro_batch_size"),
                         ("dynamic_batching", "dynamic_sampling"),
                         ("soft_over_length_punishment", "overlong_shaping"),
                         ("cache_length", "overlong_buffer")):
        if grpo_config.get(theirs) is not None:
            grpo[ours] = grpo_config[theirs]
    if "lr" in grpo_config:
        grpo["actor_optimizer"] = {"lr": grpo_config["lr"]}
    if "loss_variation" in grpo_config:
        if grpo_config["loss_variation"] not in LOSS_VARIATIONS:
            raise ValueError(f"grpo_config['loss_variation'] must be one of {sorted(LOSS_VARIATIONS)}, got "
                             f"{grpo_config['loss_variation']!r}")
        grpo["loss_agg"] = LOSS_VARIATIONS[grpo_config["loss_variation"]]
    samples_per_rank = train_batch_size * num_generations
    data: dict[str, Any] = {
        "namespace": namespace,
        "algorithm": "grpo",
        "model": {"policy": _model_path(inference_model_config, train_model_config, tokenizer_config),
                  "lora": None},
        "task": {"prompt_file": _prompt_file(train_dataset_config, save_dir),
                 "reward": grpo_config.get("reward_fn_type", "think_answer_tags")},
        "sampling": {"max_new_tokens": _max_new_tokens(generate_config, grpo_config, train_dataset_config),
                     "temperature": float(generate_config.get("temperature", 1.0)),
                     "top_p": float(generate_config.get("top_p", 1.0)),
                     "top_k": 0 if top_k is None or top_k < 0 else int(top_k)},  # their -1/None: no top-k
        "maker": {"experience_batch_size": inference_batch_size, "group_size": num_generations,
                  "max_pushes_in_flight": 2, "wait_for_ack": False,
                  "backend": BACKENDS[inference_backend],
                  "num_gpus": num_proc_per_producer if use_gpus else 0},
        # A sample made by the weights of round r may be trained n_behind rounds later, anywhere in that
        # round.
        "trainer": {"train_batch_size": samples_per_rank, "max_staleness": (n_behind + 1) * update_steps - 1,
                    "weight_sync": "full", "overlap_weight_push": False,
                    "buffer_max_samples": max(1024,
                                              2 * inference_batch_size * num_producers * num_generations)},
        "trainer_group": {"world_size": num_consumer_procs, "strategy": trainer_strategy(num_consumer_procs,
                                                                                         plugin_config),
                          "num_gpus_per_rank": 1 if use_gpus else 0},
        "grpo": grpo,
    }
    for text in overrides:
        keys, value = parse_override(text)
        update: dict[str, Any] = {keys[-1]: value}
        for key in reversed(keys[:-1]):
            update = {key: update}
        data = merge_mappings(data, update)
    return from_dict(RunConfig, data)


def launch_distributed(
    num_producers: int,
    num_proc_per_producer: int,
    num_consumer_procs: int,
    num_episodes: int,
    inference_batch_size: int,
    inference_microbatch_size: int,
    train_batch_size: int,
    train_minibatch_size: int,
    train_dataset_config: dict[str, Any],
    inference_model_config: dict[str, Any],
    generate_config: dict[str, Any],
    train_model_config: dict[str, Any],
    grpo_config: dict[str, Any],
    plugin_config: dict[str, Any],
    tokenizer_config: dict[str, Any] | None = None,
    inference_backend: str = "transformers",
    num_generations: int = 8,
    master_addr: str = "localhost",
    master_port: int = 29500,
    core_algo: str = "GRPO",
    project_name: str | None = None,
    save_interval: int = 100,
    save_dir: str = "./model",
    eval_dataset_config: dict[str, Any] | None = None,
    eval_interval: int = 100,
    eval_save_dir: str | None = None,
    eval_generation_config: dict[str, Any] | None = None,
    log_rollout_interval: int = 20,
    rollout_save_dir: str = "./rollout",
    enable_profiling: bool = False,
    n_behind: int = 0,
    *,
    name: str = "colossalchat",
    use_gpus: bool | None = None,
    overrides: Sequence[str] = (),
    timeout: float = 3600.0,
) -> dict[str, Any]:
    """Train with GRPO (or `core_algo`) as ColossalChat's `launch_distributed` would, on our actors.

    The steps follow ColossalChat: an episode is `num_samples // (inference_batch_size x num_producers)`
    rounds; each round, every producer makes `inference_batch_size` prompts x `num_generations` responses and
    the consumers train `round prompts / (train_batch_size x num_consumer_procs)` steps, then push weights. A
    trainer checkpoint (resumable) goes to `<save_dir>/checkpoint` every `save_interval` steps and at the end,
    the final policy to `<save_dir>/modeling-episode-<e>-step-<s>` (`from_pretrained` format), the metrics to
    `<save_dir>/metrics.jsonl`. Ray must be initialised (else a local cluster sized to the job is started);
    actors use its namespace. `master_addr`, `master_port`, `project_name`, the profiling and rollout-logging
    arguments have no counterpart and are ignored; evaluation is refused. Keyword-only extras: `name`
    (actor-name prefix), `use_gpus` (default: when the cluster has GPUs), `overrides` (RunConfig KEY=VALUE),
    `timeout` (s, the whole run). Returns steps, policy version, saved path and the per-step metrics under
    ColossalChat's names and ours.
    """
    import ray

    from detached_rl.cli.ppo_on_ray import save_policy, train_detached

    # No role here:
    del master_addr, master_port, project_name, log_rollout_interval, rollout_save_dir, enable_profiling
    del eval_interval, eval_save_dir, eval_generation_config  # evaluation is refused below
    if eval_dataset_config:
        raise ValueError("eval_dataset_config: evaluation during training is not supported; evaluate the "
                         "saved model")
    for label, value in (("num_producers", num_producers), ("num_proc_per_producer", num_proc_per_producer),
                         ("num_consumer_procs", num_consumer_procs), ("num_episodes", num_episodes),
                         ("inference_batch_size", inference_batch_size),
                         ("inference_microbatch_size", inference_microbatch_size),
                         ("train_batch_size", train_batch_size),
                         ("train_minibatch_size", train_minibatch_size),
                         ("num_generations", num_generations), ("save_interval", save_interval)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be an int >= 1, got {value!r}")
    if isinstance(n_behind, bool) or not isinstance(n_behind, int) or n_behind < 0:
        raise ValueError(f"n_behind must be an int >= 0, got {n_behind!r}")
    dp_size = data_parallel_size(num_consumer_procs, plugin_config)
    round_prompts = inference_batch_size * num_producers
    if round_prompts % (train_batch_size * dp_size):
        raise ValueError(f"inference_batch_size x num_producers ({round_prompts}) must be a multiple of "
                         f"train_batch_size x data-parallel size ({train_batch_size} x {dp_size})")
    if "path" not in train_dataset_config:
        raise ValueError("train_dataset_config['path'] is missing")
    rounds_per_episode = prompt_count(train_dataset_config["path"]) // round_prompts
    if rounds_per_episode < 1:
        raise ValueError(f"train_dataset_config['path'] has fewer prompts than one round needs "
                         f"(inference_batch_size x num_producers = {round_prompts})")
    update_steps = round_prompts // (train_batch_size * dp_size)
    steps = num_episodes * rounds_per_episode * update_steps

    save_root = Path(save_dir).resolve()

    def config_for(namespace: str, gpus: bool) -> Any:
        return run_config_of(
            num_producers=num_producers, num_proc_per_producer=num_proc_per_producer,
            num_consumer_procs=num_consumer_procs, inference_batch_size=inference_batch_size,
            train_batch_size=train_batch_size, train_minibatch_size=train_minibatch_size,
            train_dataset_config=train_dataset_config, inference_model_config=inference_model_config,
            generate_config=generate_config, train_model_config=train_model_config, grpo_config=grpo_config,
            plugin_config=plugin_config, tokenizer_config=tokenizer_config,
            inference_backend=inference_backend, num_generations=num_generations, core_algo=core_algo,
            n_behind=n_behind, update_steps=update_steps, save_dir=save_root, namespace=namespace, name=name,
            use_gpus=gpus, overrides=overrides)

    started_ray = not ray.is_initialized()
    if started_ray:
        from detached_rl.cli.jobs import init_local_ray
        from detached_rl.cli.ppo_on_ray import cpu_slots

        # Sized to the job, as ppo-on-ray sizes its Ray: a logical CPU slot for every actor it starts.
        slots = cpu_slots(config_for(name, bool(use_gpus)), num_producers)
        init_local_ray(name, include_dashboard=False, log_to_driver=False,
                       num_cpus=max(os.cpu_count() or 1, slots))
    try:
        if use_gpus is None:
            use_gpus = ray.cluster_resources().get("GPU", 0) > 0
        config = config_for(ray.get_runtime_context().namespace, use_gpus)
        result = train_detached(config, name, steps, num_producers, timeout, update_steps=update_steps,
                                checkpoint_every=save_interval, checkpoint_dir=str(save_root / "checkpoint"))
    finally:
        if started_ray:
            ray.shutdown()
    status = result["status"]
    saved = save_policy(result["files"],
                        save_root / f"modeling-episode-{num_episodes - 1}-step-{rounds_per_episode}")
    rows = [{**row, **colossalchat_metrics(row, config.sampling.temperature)} for row in result["metrics"]]
    with (save_root / "metrics.jsonl").open("w", encoding="utf-8") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    return {"steps": status["steps"], "policy_version": status["policy_version"], "saved": str(saved),
            "checkpoint": str(save_root / "checkpoint"), "metrics": rows, "seconds": result["seconds"]}
