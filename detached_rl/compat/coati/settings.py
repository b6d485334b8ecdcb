"""coati's arguments translated: env_info, strategies, trainer settings, generate kwargs, batches, models."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from detached_rl.algorithms.metrics import LOSS_POLICY, LOSS_VALUE
from detached_rl.algorithms.ppo import PPOConfig
from detached_rl.core.prompts import as_prompt_item
from detached_rl.core.sampling import SamplingConfig
from detached_rl.maker.experience_maker import MakerModels
from detached_rl.models.lora import lora_backend
from detached_rl.models.reward import FunctionReward
from detached_rl.strategies import STRATEGIES, NaiveStrategy, Strategy
from detached_rl.trainer.config import TrainerConfig

# Where a coati `training_step` reports its two losses in this project's metrics.
COATI_METRICS = {"actor_loss": LOSS_POLICY, "critic_loss": LOSS_VALUE}
# Hugging Face `generate` arguments coati makers passed through, and what they become in a `SamplingConfig`.
SAMPLING_KWARGS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p")
# Accepted and without effect here: the generation backend sets these itself.
IGNORED_GENERATE_KWARGS = ("use_cache", "prepare_inputs_fn", "update_model_kwargs_fn", "pad_token_id",
                           "early_stopping", "num_beams")
COATI_ENV = {"rank": "RANK", "local_rank": "LOCAL_RANK", "world_size": "WORLD_SIZE",
             "master_port": "MASTER_PORT", "master_addr": "MASTER_ADDR"}


def set_dist_env(env_info: Mapping[str, str]) -> None:
    """Export coati's `env_info` (rank, local_rank, world_size, master_port, master_addr) for torch."""
    missing = [key for key in COATI_ENV if key not in env_info]
    if missing:
        raise ValueError(f"env_info lacks field(s) {missing}")
    for key, variable in COATI_ENV.items():
        os.environ[variable] = str(env_info[key])


def get_strategy_from_args(strategy: str, **options: Any) -> Strategy:
    """coati's `get_strategy_from_args`: a strategy by name; distributed ones take rank and address from the
    environment `env_info` set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Naive and gloo ranks stay on the
    device Ray gave the actor."""
    from detached_rl.actors.placement import actor_device

    name = {"colossalai_gemini_cpu": "colossalai_gemini", "colossalai_zero2_cpu": "colossalai_zero2"}.get(
        strategy, strategy)
    if name not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    if name == "naive":
        return NaiveStrategy(device=options.pop("device", actor_device()), **options)
    try:
        place = dict(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                     master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]))
    except KeyError as missing:
        raise ValueError(f"strategy {strategy!r} needs env_info (environment variable {missing} is "
                         "unset)") from None
    if actor_device() == "cpu" and options.get("backend", "gloo") == "gloo":
        options = {"backend": "gloo", "device": "cpu", **options}
    return STRATEGIES[name](**place, **options)


def get_receivers_per_sender(sender_idx: int, num_senders: int, num_receivers: int, allow_idle_sender: bool
                             ) -> list[int]:
    """coati's pairing of senders and receivers: each receiver has one sender, or each sender one receiver."""
    if num_senders <= num_receivers or allow_idle_sender:
        return [i for i in range(num_receivers) if i % num_senders == sender_idx]
    return [sender_idx % num_receivers]


def build_strategy(strategy_fn: Callable[[], Strategy]) -> Strategy:
    """Call coati's `strategy_fn`; refuses (naming the argument) anything that does not give a `Strategy`."""
    if not callable(strategy_fn):
        raise TypeError(f"strategy_fn must be a function returning a Strategy, got "
                        f"{type(strategy_fn).__name__}")
    strategy = strategy_fn()
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy_fn must return a detached_rl.strategies.Strategy, got "
                        f"{type(strategy).__name__}")
    return strategy


def trainer_settings(train_batch_size: int = 8, buffer_limit: int = 0, eps_clip: float = 0.2,
                     value_clip: float = 0.4, update_lora_weights: bool = False,
                     algorithm: PPOConfig | None = None) -> tuple[TrainerConfig, PPOConfig]:
    """coati trainer arguments as a `TrainerConfig` and a `PPOConfig` (over `algorithm`, if given).

    `buffer_limit` counts batches, as coati's queue did (0: unlimited, here the default bound); makers stop at
    the end of `fit`, as a coati run ended.
    """
    if buffer_limit < 0:
        raise ValueError(f"buffer_limit must be >= 0 (0: unlimited), got {buffer_limit}")
    buffer = {"buffer_max_samples": buffer_limit * train_batch_size} if buffer_limit else {}
    config = TrainerConfig(train_batch_size=train_batch_size,
                           weight_sync="lora" if update_lora_weights else "full", **buffer)
    ppo = dataclasses.replace(algorithm or PPOConfig(), clip_low=eps_clip, clip_high=None,
                              value_clip=value_clip)
    return config, ppo


def sampling_from_generate_kwargs(generate_kwargs: Mapping[str, Any]) -> tuple[SamplingConfig, int | None]:
    """A maker's `**generate_kwargs` as a `SamplingConfig`, and coati's `max_length` (prompt + response).

    Unknown arguments are refused by name; `IGNORED_GENERATE_KWARGS` are accepted and have no effect.
    """
    unknown = sorted(set(generate_kwargs) - set(SAMPLING_KWARGS) - set(IGNORED_GENERATE_KWARGS)
                     - {"max_length", "eos_token_id"})
    if unknown:
        raise ValueError(f"unsupported generate argument(s) {unknown}; supported: {sorted(SAMPLING_KWARGS)}, "
                         f"max_length, eos_token_id (ignored: {sorted(IGNORED_GENERATE_KWARGS)})")
    if generate_kwargs.get("num_beams", 1) != 1:
        raise ValueError(f"num_beams must be 1 (makers sample), got {generate_kwargs['num_beams']}")
    values = {key: generate_kwargs[key] for key in SAMPLING_KWARGS if key in generate_kwargs}
    if values.get("top_k") is None:
        values.pop("top_k", None)
    eos = generate_kwargs.get("eos_token_id")
    if eos is not None:
        values["stop_token_ids"] = tuple(eos) if isinstance(eos, Sequence) else (int(eos),)
    max_length = generate_kwargs.get("max_length")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int)
                                   or max_length < 2):
        raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
    return SamplingConfig(**values), max_length


def batch_prompts(batch: Any, pad_token_id: int | None) -> tuple[list[Any], int | None]:
    """One dataloader batch as prompts (token-id lists or texts) and its padded width (None for texts).

    A batch is a dict of `input_ids` (and `attention_mask`), an id tensor [B, L] or [L] (padding is where the
    ids equal `pad_token_id`, as coati's generate took it), a str, or a sequence of strs or prompt items.
    """
    if isinstance(batch, str):
        return [batch], None
    if isinstance(batch, Mapping):
        if "input_ids" not in batch:
            raise ValueError(f"a dict batch needs 'input_ids', got keys {sorted(batch)}")
        ids, mask = torch.as_tensor(batch["input_ids"]), batch.get("attention_mask")
    elif isinstance(batch, torch.Tensor):
        ids, mask = batch, None
    elif isinstance(batch, Sequence):
        return [item if isinstance(item, str) else as_prompt_item(item).prompt for item in batch], None
    else:
        raise TypeError(f"unsupported batch type {type(batch).__name__} (a dict of input_ids, a tensor or "
                        "strs)")
    if ids.is_floating_point() or ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must be integer ids [B, L] or [L], got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.cpu().reshape(-1, ids.shape[-1])
    if mask is None:
        if pad_token_id is None:
            raise ValueError("an id tensor without attention_mask needs a pad_token_id to find its padding")
        keep = ids != pad_token_id
    else:
        keep = torch.as_tensor(mask).cpu().reshape(ids.shape) != 0
    prompts = []
    for row in range(ids.shape[0]):
        tokens = ids[row][keep[row]].tolist()
        if not tokens:
            raise ValueError(f"batch row {row} has no tokens (all padding)")
        prompts.append(tokens)
    return prompts, int(ids.shape[1])


def coati_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """This project's step metrics with coati's names added ("actor_loss", "critic_loss")."""
    return {**metrics, **{alias: metrics[name] for alias, name in COATI_METRICS.items() if name in metrics}}


def maker_models(model_fn: Callable[[], tuple], kl_coef: float, lora: bool = False) -> MakerModels:
    """coati's maker `model_fn() -> (actor, critic, reward model or reward function, initial model)` as
    `MakerModels` (no reference model when `kl_coef` is 0); with `lora` the actor must carry a LoRA
    adapter."""
    built = model_fn()
    if not isinstance(built, tuple | list) or len(built) != 4:
        raise ValueError("model_fn must return (actor, critic, reward_model, initial_model)")
    actor, critic, reward, initial = built
    if lora and lora_backend(actor.model) is None:
        raise ValueError("update_lora_weights=True: model_fn's actor must carry the trainers' LoRA adapter "
                         "(detached_rl.models.apply_lora with the same settings) to take LoRA-only updates")
    if not hasattr(reward, "score") and not hasattr(reward, "score_detailed"):
        if not callable(reward):
            raise TypeError(f"model_fn's reward_model must be a reward model or function, got "
                            f"{type(reward).__name__}")
        reward = FunctionReward(reward, actor.tokenizer)
    return MakerModels(actor=actor, critic=critic, reward=reward, reference=initial if kl_coef > 0 else None)
