"""The math-verify worker behind the boxed reward: loud when it cannot run, retried after a failed start."""

from __future__ import annotations

import logging

import pytest

from detached_rl.rewards import functions
from detached_rl.rewards.math_verify import WORKER_CODE, MathVerifyUnavailable, MathVerifyWorker


def test_not_installed_raises_naming_the_package():
    worker = MathVerifyWorker(installed=False)
    with pytest.raises(MathVerifyUnavailable, match="math-verify"):
        worker.equal("1/2", "0.5", timeout_s=1)


def test_a_failed_start_is_logged_answers_none_and_is_retried(caplog, tmp_path):
    marker = tmp_path / "failed-once"
    # Fails its first start (printing why on stderr), comes up on the next.
    code = (f"import os, sys\nif not os.path.exists({str(marker)!r}):\n    open({str(marker)!r}, "
            "'w').close()\n    sys.exit('no sympy today')\n" + WORKER_CODE)
    worker = MathVerifyWorker(code)
    worker.retry_after_s = 3600.0
    with caplog.at_level(logging.WARNING, logger="detached_rl.rewards.math_verify"):
        assert worker.equal("1/2", "0.5", timeout_s=5) is None
    assert worker.failed_starts == 1 and "no sympy today" in caplog.text
    assert worker.equal("1/2", "0.5", timeout_s=5) is None  # inside the retry window: no new start
    assert worker.failed_starts == 1
    worker.retry_after_s = 0.0
    worker._down_until = 0.0
    try:
        assert worker.equal("1/2", "0.5", timeout_s=5) is True
        assert worker.equal("1/3", "0.5", timeout_s=5) is False
    finally:
        worker.close()


def test_boxed_reward_reports_a_down_verifier_in_its_components(monkeypatch):
    down = MathVerifyWorker("raise SystemExit(1)")
    monkeypatch.setattr(functions, "_MATH_VERIFY", down)
    result = functions.boxed_reward("", r"so \boxed{1/2}", answer="0.5")
    assert result["verifier_unavailable"] == 1.0 and result["correct"] == 0.0
    same = functions.boxed_reward("", r"so \boxed{ 0.5 }", answer="0.5")  # string-equal: no verifier needed
    assert same["correct"] == 1.0 and same["verifier_unavailable"] == 0.0


def test_boxed_reward_is_loud_without_math_verify(monkeypatch):
    monkeypatch.setattr(functions, "_MATH_VERIFY", MathVerifyWorker(installed=False))
    with pytest.raises(MathVerifyUnavailable):
        functions.boxed_reward("", r"\boxed{1/2}", answer="0.5")
