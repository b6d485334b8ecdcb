"""A task's rewards (`task.reward` / `task.rewards`) as the scorer a maker grades with.

Each reward is called once per batch in a helper process (`RewardProcess`) with the decoded prompts and
completions and the problems' metadata, one list per column. The total is the weighted sum; each reward's
value is kept as `reward:<label>` (the metric `reward/<label>_mean`), and the numbers a reward reports
beside "reward" in a dict ("correct", "format") as themselves. A sample a reward cannot grade is refused, by
reason (`REFUSAL_REASONS`): it carries "refused" and "refused_detail" instead of a reward, and the maker
leaves it (and its group) out of the push, counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from detached_rl.core.decoding import decode_batch
from detached_rl.rewards.reward_process import RAISED, TIMEOUT, RewardProcess
from detached_rl.rewards.specs import RewardSpec

#: Why a sample's reward was refused: its reward raised (or its process died), ran past
#: `task.reward_timeout_s`, returned another number of values than completions, a NaN or inf, or something
#: that is not a number.
REFUSAL_REASONS = (RAISED, TIMEOUT, "wrong_count", "non_finite", "not_a_number")
REFUSED = "refused"


def metadata_columns(metadata: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per-sample metadata dicts as one list per key (None where a sample lacks the key)."""
    keys: dict[str, None] = {}
    for row in metadata:
        keys.update(dict.fromkeys(row))
    return {key: [row.get(key) for row in metadata] for key in keys}


def _refusal(reason: str, detail: str) -> dict[str, Any]:
    return {REFUSED: reason, "refused_detail": detail[:300]}


def combine(specs: Sequence[RewardSpec], answers: Sequence[tuple[str, Any]],
            count: int) -> list[dict[str, Any]]:
    """One dict per sample from each reward's answer (`RewardProcess.call`, in `specs` order): {"reward":
    weighted total, "reward:<label>": value, its reported parts..., "correct"} or a refusal naming the reward
    that could not grade it. "correct" is what a reward reports, else 1.0 where the first reward gives full
    marks (>= 1)."""
    rows: list[dict[str, Any]] = [{"reward": 0.0} for _ in range(count)]
    for spec, (status, answer) in zip(specs, answers, strict=True):
        who = f"reward {spec.label!r} ({spec.fn})"
        if status != "ok":
            rows = [row if REFUSED in row else _refusal(status, f"{who}: {answer}") for row in rows]
            continue
        if isinstance(answer, str) or len(answer) != count:
            got = answer if isinstance(answer, str) else f"returned {len(answer)} values"
            why = f"{who}: {got} for {count} completions"
            rows = [row if REFUSED in row else _refusal("wrong_count", why) for row in rows]
            continue
        for index, value in enumerate(answer):
            row = rows[index]
            if REFUSED in row:
                continue
            parts = {}
            if isinstance(value, dict):
                parts = {key: part for key, part in value.items() if key != "reward"}
                value = value.get("reward")
            if value is None:
                rows[index] = _refusal("not_a_number", f"{who}: a value is not a number")
            elif not all(math.isfinite(v) for v in (value, *parts.values())):
                rows[index] = _refusal("non_finite", f"{who}: returned {value}")
            else:
                row["reward"] += spec.weight * value
                row[f"reward:{spec.label}"] = value
                for key, part in parts.items():
                    row.setdefault(key, part)
    first = specs[0].label if specs else None
    for row in rows:
        if REFUSED not in row and "correct" not in row and first is not None:
            row["correct"] = float(row[f"reward:{first}"] >= 1.0)
    return rows


class TaskReward:
    """Scores a padded batch with the task's rewards (a `RewardScorer` with `score_detailed`)."""

    def __init__(self, specs: Sequence[RewardSpec], tokenizer: Any, timeout_s: float = 30.0,
                 process: RewardProcess | None = None) -> None:
        if not specs:
            raise ValueError("TaskReward: no rewards")
        if not timeout_s > 0:
            raise ValueError(f"task.reward_timeout_s must be > 0, got {timeout_s}")
        self.specs = list(specs)
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.process = process or RewardProcess()

    def grade(self, prompts: Sequence[str], completions: Sequence[str],
              metadata: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each completion's reward and parts, or its refusal (`combine`)."""
        columns = metadata_columns(metadata)
        answers = [self.process.call(spec.target, prompts, completions, columns, self.timeout_s)
                   for spec in self.specs]
        return combine(self.specs, answers, len(completions))

    def score_detailed(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
                       response_mask: torch.Tensor, metadata: list[dict[str, Any]] | None = None
                       ) -> tuple[torch.Tensor, list[dict[str, Any]]]:
        """Rewards [B] (0 where refused) and, per sample, its parts or its refusal."""
        prompts, completions = decode_batch(self.tokenizer, sequences, attention_mask, response_mask)
        rows = self.grade(prompts, completions, metadata or [{} for _ in prompts])
        rewards = [0.0 if REFUSED in row else row["reward"] for row in rows]
        components = [{key: value for key, value in row.items() if key != "reward"} for row in rows]
        return torch.tensor(rewards, dtype=torch.float32, device=sequences.device), components

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
              metadata: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """Rewards [B] (0 where refused)."""
        return self.score_detailed(sequences, attention_mask, response_mask, metadata)[0]
