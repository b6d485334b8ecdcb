"""Verifiable rewards: reward functions (registered by name), the tasks that produce graded
prompts, the code sandbox."""

from detached_rl.rewards.functions import (
    REWARD_FUNCTIONS,
    answer_line_format,
    answer_line_reward,
    answers_match,
    as_number,
    boxed_reward,
    code_reward,
    extract_answer_line,
    extract_tagged_answer,
    get_reward_function,
    has_think_answer_format,
    last_boxed,
    last_number,
    last_python_block,
    math_equal,
    normalise_answer,
    numeric_answer_reward,
    think_answer_tags_reward,
)
from detached_rl.rewards.math_verify import MathVerifyUnavailable
from detached_rl.rewards.sandbox import SandboxUnavailable

__all__ = [
    "MathVerifyUnavailable", "SandboxUnavailable",
    "REWARD_FUNCTIONS", "answer_line_format", "answer_line_reward", "answers_match", "as_number",
    "boxed_reward",
    "code_reward", "extract_answer_line", "extract_tagged_answer", "get_reward_function",
    "has_think_answer_format",
    "last_boxed", "last_number", "last_python_block", "math_equal", "normalise_answer",
    "numeric_answer_reward",
    "think_answer_tags_reward",
]
