"""Verifiable rewards and the deterministic arithmetic task."""

import pytest

from detached_rl.rewards.functions import last_number, numeric_answer_reward
from detached_rl.rewards.tasks import addition_problems


@pytest.mark.parametrize(
    ("text", "expected"),
    [("3 + 4 = 7", 7.0), ("The answer is -12.", -12.0), ("1,234 apples", 1234.0), ("2.5 then 3.25", 3.25),
     ("no digits", None), ("", None)],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_numeric_answer_reward_components():
    assert numeric_answer_reward("q", "3 + 4 = 7", answer=7) == {"reward": 1.1, "correct": 1.0, "format": 1.0}
    assert numeric_answer_reward("q", "7 is not 8", answer=7) == {"reward": 0.1, "correct": 0.0,
                                                                  "format": 1.0}
    assert numeric_answer_reward("q", "seven", answer=7) == {"reward": 0.0, "correct": 0.0, "format": 0.0}
    with pytest.raises(ValueError, match="answer"):
        numeric_answer_reward("q", "1", answer=float("nan"))


def test_addition_problems_are_deterministic_and_splits_are_disjoint():
    train = addition_problems(200, seed=3)
    assert train == addition_problems(200, seed=3) and train != addition_problems(200, seed=4)
    test = addition_problems(200, seed=3, split="test")
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in test})
    for problem in train[:20]:
        a, b = (int(x) for x in problem.prompt.removeprefix("What is ").split("?")[0].split(" + "))
        assert problem.answer == a + b and problem.metadata == {"answer": a + b}
    with pytest.raises(ValueError, match="split"):
        addition_problems(1, split="dev")
