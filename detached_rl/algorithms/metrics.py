"""The one metric vocabulary every learner's `train_step` reports (open-instruct's `<group>/<name>_avg`
style).

Values are means over the step's valid response tokens (token-weighted over micro-batches) unless
the description says otherwise. The names the learners used before live on as aliases: each step's
metrics also carry the same value under every old name in `METRIC_ALIASES`, so dashboards that read
them keep working. Readers (the progress bar, the plots) use the names here.
"""

from __future__ import annotations

from collections.abc import Mapping

#: The policy-gradient loss (the registered policy loss, aggregated in the learner's loss_agg mode).
LOSS_POLICY = "loss/policy_avg"
#: The critic's loss, 0.5 * aggregated (clipped) squared error to the returns (PPO).
LOSS_VALUE = "loss/value_avg"
#: KL(policy || reference) of the policy being trained, aggregated like the loss, before its coefficient;
#: 0 without a reference (kl_coef = 0).
LOSS_KL = "loss/kl_avg"
#: The policy's entropy aggregated like the loss: the entropy bonus before its coefficient.
LOSS_ENTROPY = "loss/entropy_avg"
#: What is differentiated: every loss term with its coefficient.
LOSS_TOTAL = "loss/total_avg"
#: Mean entropy of the policy per valid token.
POLICY_ENTROPY = "policy/entropy_avg"
#: Share of valid tokens where the clipped surrogate term was the larger (the ratio was clipped).
POLICY_CLIPFRAC = "policy/clipfrac_avg"
#: Mean of old - new log-prob per token: a cheap estimate of KL(old || new) ("old":
#: behaviour or proximal policy).
POLICY_APPROX_KL = "policy/approx_kl_avg"
#: Mean probability ratio new / old per token (1 on a fresh, single pass).
POLICY_RATIO = "val/ratio"
#: Mean truncated importance weight per token (1 when every sample is fresh).
POLICY_IMPORTANCE_WEIGHT = "policy/importance_weight_avg"
#: Share of valid response tokens left out of the loss because a log-prob there (behaviour, old, reference or
#: the current policy's) is not finite.
POLICY_NONFINITE_FRACTION = "policy/nonfinite_fraction_avg"
#: Train/inference mismatch, reported on steps that recomputed the old log-probs (`algorithms.mismatch`):
#: mean k3 estimate of KL(behaviour || recompute) per valid response token.
MISMATCH_KL = "mismatch/kl"
#: Largest |recompute - behaviour| log-prob over the batch's valid response tokens.
MISMATCH_MAX_ABS_DIFF = "mismatch/max_abs_log_prob_diff"
#: Mean |recompute - behaviour| log-prob per valid response token.
MISMATCH_MEAN_ABS_DIFF = "mismatch/mean_abs_log_prob_diff"
#: Share of valid response tokens whose importance weight recompute / behaviour
#: exceeded `tis_cap` (was capped).
MISMATCH_TIS_CLIPPED = "mismatch/tis_clipped_fraction"
#: Count of response tokens whose behaviour or recomputed log-prob is not finite (weight 0, out of the loss).
MISMATCH_MASKED_TOKENS = "mismatch/masked_tokens"
#: Share of valid tokens where the clipped value term was the larger (PPO).
VALUE_CLIPFRAC = "value/clipfrac_avg"
#: Mean squared error of the critic's values to the returns per token (PPO).
VALUE_ERROR = "value/error_avg"
#: KL(behaviour policy || reference) per valid token of the batch, as the makers sampled (needs kl_coef > 0).
OBJECTIVE_KL = "objective/kl_avg"
#: Seconds the learner's train_step took.
TIME_TRAINING = "time/training"
#: Optimizer steps of this training step skipped for a non-finite loss or gradient norm
#: (`algorithms.step_guard`).
SKIPPED_STEPS = "train/skipped_steps"
#: The policy's learning rate after the step.
LR_ACTOR = "lr/actor"
#: Model FLOPs utilisation of the learner's step against its device's dense matmul peak (a fraction).
MFU = "perf/mfu"

# Driver-level names of open-instruct's `one_training_step` (`detached_rl.compat.open_instruct` reports them).
#: Token-weighted variance over sequences of each sequence's mean probability ratio new / old.
RATIO_VAR = "val/ratio_var"
#: Tokens of the step on all ranks: prompt tokens once per prompt plus every response token.
NUM_STEP_TOKENS = "val/num_step_tokens"
#: Tokens of every step before this one (`NUM_STEP_TOKENS` summed).
NUM_TOTAL_TOKENS = "val/num_total_tokens"
#: `NUM_STEP_TOKENS` over the step's wall time (generation wait included).
TOKENS_PER_SECOND_STEP = "learner_tokens_per_second_step"
#: `NUM_TOTAL_TOKENS` over the wall time since training started.
TOKENS_PER_SECOND_OVERALL = "learner_tokens_per_second_overall"
#: Learner MFU in percent: 6 x parameters FLOPs per sequence token over the training time and
#: the ranks' summed peaks.
LEARNER_MFU = "learner_mfu"


def skipped_steps_key(reason: str) -> str:
    """The metric counting the optimizer steps skipped for `reason` (one of `step_guard.SKIP_REASONS`)."""
    return f"{SKIPPED_STEPS}/{reason}"


#: Every name above with its description (for docs and `--help`-style listings).
METRICS: dict[str, str] = {
    LOSS_POLICY: "policy-gradient loss",
    LOSS_VALUE: "critic loss",
    LOSS_KL: "KL(policy || reference) of the trained policy, before its coefficient",
    LOSS_ENTROPY: "entropy as aggregated in the loss, before its coefficient",
    LOSS_TOTAL: "the differentiated loss, all terms with their coefficients",
    POLICY_ENTROPY: "mean entropy per token",
    POLICY_CLIPFRAC: "share of tokens whose ratio was clipped",
    POLICY_APPROX_KL: "mean (old - new) log-prob per token",
    POLICY_RATIO: "mean new / old probability ratio per token",
    POLICY_IMPORTANCE_WEIGHT: "mean truncated importance weight per token",
    POLICY_NONFINITE_FRACTION: "share of tokens left out of the loss for a non-finite log-prob",
    MISMATCH_KL: "k3 KL(behaviour || trainer recompute) per token",
    MISMATCH_MAX_ABS_DIFF: "largest |recompute - behaviour| log-prob of the batch",
    MISMATCH_MEAN_ABS_DIFF: "mean |recompute - behaviour| log-prob per token",
    MISMATCH_TIS_CLIPPED: "share of tokens whose importance weight was capped at tis_cap",
    MISMATCH_MASKED_TOKENS: "tokens with a non-finite behaviour or recomputed log-prob (masked out)",
    VALUE_CLIPFRAC: "share of tokens whose value was clipped",
    VALUE_ERROR: "mean squared error of the values to the returns",
    OBJECTIVE_KL: "KL(behaviour || reference) per token of the batch",
    TIME_TRAINING: "seconds of the learner's train_step",
    SKIPPED_STEPS: "optimizer steps skipped (weights and optimizer untouched) for a non-finite loss or "
                   "gradient norm",
    LR_ACTOR: "the policy's learning rate after the step",
    MFU: "model FLOPs utilisation of the step (fraction of the device's dense matmul peak)",
    RATIO_VAR: "token-weighted variance over sequences of each sequence's mean new / old ratio",
    NUM_STEP_TOKENS: "tokens of the step on all ranks (each prompt once, every response token)",
    NUM_TOTAL_TOKENS: "tokens of all steps before this one",
    TOKENS_PER_SECOND_STEP: "step tokens over the step's wall time",
    TOKENS_PER_SECOND_OVERALL: "tokens of all earlier steps over the time since training started",
    LEARNER_MFU: "learner MFU in percent (6 x parameters FLOPs per sequence token, summed peaks "
                 "of the ranks)",
}

#: open-instruct's name -> this project's, where the two spell one metric differently (the rest, e.g.
#: "policy/entropy_avg", "val/ratio", "loss/policy_avg", are spelled alike). Used by `detached_rl.compat`.
OPEN_INSTRUCT_ALIASES: dict[str, str] = {
    "lr": LR_ACTOR,
    "optim/grad_norm": "grad_norm/actor",
}

#: Old name -> name above. A step's metrics carry the value under both.
METRIC_ALIASES: dict[str, str] = {
    "loss/policy": LOSS_POLICY,
    "loss/value": LOSS_VALUE,
    "loss/kl": LOSS_KL,
    "loss/entropy": LOSS_ENTROPY,
    "policy/entropy": POLICY_ENTROPY,
    "policy/clipfrac": POLICY_CLIPFRAC,
    "policy/approx_kl": POLICY_APPROX_KL,
    "policy/ratio_mean": POLICY_RATIO,
    "policy/importance_weight": POLICY_IMPORTANCE_WEIGHT,
    "value/clipfrac": VALUE_CLIPFRAC,
    "value/error": VALUE_ERROR,
    "kl/mean": OBJECTIVE_KL,
    "time/train_step": TIME_TRAINING,
}


def with_aliases(metrics: Mapping[str, float]) -> dict[str, float]:
    """`metrics` plus, for each name that has old aliases, the same value under every old name."""
    out = dict(metrics)
    for old, new in METRIC_ALIASES.items():
        if new in metrics:
            out[old] = metrics[new]
    return out


def metric_value(row: Mapping[str, object], name: str) -> object | None:
    """`row[name]`, else the value under one of its old aliases (rows written
    before the rename), else None."""
    if name in row:
        return row[name]
    return next((row[old] for old, new in METRIC_ALIASES.items() if new == name and old in row), None)


def reward_part_means(infos: list[Mapping]) -> dict[str, float]:
    """`reward/<part>_mean` over the samples that report it: the reward's "correct" and "format" parts and
    each of a task's rewards (`reward:<label>` in a sample's info, `rewards.task_reward`)."""
    out: dict[str, float] = {}
    keys = {key for info in infos for key in info
            if key in ("correct", "format") or key.startswith("reward:")}
    for key in sorted(keys):
        parts = [float(info[key]) for info in infos if isinstance(info.get(key), int | float)]
        if parts:
            out[f"reward/{key.removeprefix('reward:')}_mean"] = sum(parts) / len(parts)
    return out
