"""An end-to-end check of the pieces that exist: load, LoRA, generate, score, collate, GRPO step.

Runs in one process without Ray; prints what it measured and fails loudly when a
consistency check does not hold (recomputed log-probs must equal the behaviour log-probs
of an unchanged model; the update must change the policy).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from detached_rl import algorithms
from detached_rl.core.experience import Experience
from detached_rl.core.experience_batch import collate
from detached_rl.generation import HFGenerationBackend
from detached_rl.models import Actor, FunctionReward, LoraSettings, SamplingConfig, apply_lora, load_causal_lm
from detached_rl.models.lora import count_parameters
from detached_rl.rewards.functions import numeric_answer_reward
from detached_rl.rewards.tasks import addition_problems
from detached_rl.strategies import NaiveStrategy
from detached_rl.strategies.optim import OptimizerConfig


@dataclass
class CheckReport:
    """Figures measured by `run_check` and whether every consistency check held."""

    figures: dict[str, float | int | str] = field(default_factory=dict)
    samples: list[tuple[str, str, float]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when every check passed."""
        return not self.failures


def run_check(
    *,
    model: str,
    num_prompts: int,
    group_size: int,
    max_new_tokens: int,
    learning_rate: float = 1e-4,
    temperature: float = 0.7,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> CheckReport:
    """Generate a GRPO batch with a LoRA policy (`LoraSettings()`), take one training step, and report figures
    (on `device`, by default the first accelerator if present); `detached-rl check` gives the sizes."""
    report = CheckReport()
    figures = report.figures
    torch.manual_seed(seed)
    strategy = NaiveStrategy(device=device)
    start = time.perf_counter()
    policy, tokenizer = load_causal_lm(model, seed=seed)
    figures["load_s"] = time.perf_counter() - start
    policy = strategy.prepare_model(apply_lora(policy, LoraSettings()))
    trainable, total = count_parameters(policy)
    figures.update(model=model, device=str(strategy.device), parameters=total, trainable_parameters=trainable)
    actor = Actor(policy, tokenizer)

    problems = [p for p in addition_problems(num_prompts, seed=seed) for _ in range(group_size)]
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature)
    start = time.perf_counter()
    out = HFGenerationBackend.from_actor(actor).generate_text([p.prompt for p in problems], sampling)
    generate_s = time.perf_counter() - start
    new_tokens = sum(len(r) for r in out.response_ids)
    figures.update(responses=len(problems), generate_s=generate_s, generated_tokens=new_tokens,
                   generate_tokens_per_s=new_tokens / generate_s)

    experiences = [
        Experience(prompt_ids=p, response_ids=r, log_probs=lp, reward=torch.tensor(0.0),
                   group_id=str(i // group_size))
        for i, (p, r, lp) in enumerate(zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True))
    ]
    batch = collate(experiences, tokenizer.pad_token_id)
    scorer = FunctionReward(numeric_answer_reward, tokenizer)
    rewards, _ = scorer.score_detailed(batch.sequences, batch.attention_mask, batch.response_mask,
                                       [p.metadata for p in problems])
    for exp, reward in zip(experiences, rewards, strict=True):
        exp.reward = reward
        exp.validate(vocab_size=len(tokenizer))
    batch = collate(experiences, tokenizer.pad_token_id).to(strategy.device)
    figures["reward_mean"] = float(rewards.mean())
    texts = tokenizer.batch_decode([r for r in out.response_ids[:: group_size]], skip_special_tokens=True)
    report.samples = [(p.prompt, t, float(r)) for p, t, r in
                      zip(problems[::group_size], texts, rewards[::group_size], strict=True)]

    with torch.no_grad():
        recomputed = actor.log_probs(batch.sequences, batch.attention_mask, batch.response_mask, sampling)
    drift = float((recomputed - batch.log_probs).abs().max())
    figures["log_prob_recompute_max_abs_diff"] = drift
    if drift > 1e-3:
        report.failures.append(f"recomputed log-probs differ from behaviour log-probs by {drift:.2e}")

    advantages = algorithms.group_advantages(batch.scores, group_size=group_size, method="grpo")
    token_advantages = algorithms.broadcast_to_tokens(advantages, batch.response_mask)
    optimizer, _ = strategy.create_optimizer(policy, OptimizerConfig(lr=learning_rate))
    start = time.perf_counter()
    policy.train()
    log_probs = actor.log_probs(batch.sequences, batch.attention_mask, batch.response_mask, sampling)
    loss, stats = algorithms.policy_loss(log_probs, batch.log_probs, token_advantages, batch.response_mask)
    strategy.backward(loss, policy, optimizer)
    grad_norm = strategy.optimizer_step(optimizer, policy, max_grad_norm=1.0)
    figures.update(train_step_s=time.perf_counter() - start, loss=float(loss.detach()), grad_norm=grad_norm,
                   clipfrac=float(stats["clipfrac"]))
    if not torch.isfinite(loss.detach()):
        report.failures.append(f"policy loss is not finite: {float(loss.detach())}")
    with torch.no_grad():
        after = actor.log_probs(batch.sequences, batch.attention_mask, batch.response_mask, sampling)
    change = float((after - batch.log_probs).abs().max())
    figures["log_prob_change_after_step"] = change
    if float(advantages.abs().sum()) > 0 and change < 1e-6:
        report.failures.append("the training step did not change the policy")
    return report


def format_report(report: CheckReport) -> str:
    """The report as aligned text."""
    lines = []
    width = max(len(k) for k in report.figures)
    for key, value in report.figures.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"  {key:<{width}}  {shown}")
    lines.append("  samples:")
    for prompt, text, reward in report.samples:
        lines.append(f"    [{reward:.2f}] {prompt!r} -> {text.strip()[:80]!r}")
    lines.append("  result: " + ("OK" if report.ok else "FAILED: " + "; ".join(report.failures)))
    return "\n".join(lines)
