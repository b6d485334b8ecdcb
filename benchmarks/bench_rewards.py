"""What grading in a helper process costs: a reward called in the maker's process against the same reward
called through `RewardProcess` (one pickle each way per batch, and a child that can be killed).

Per call, on the default job's batch (16 completions of ~40 tokens, the built-in `answer_line` reward), and
the helper's start (its first call: a Python that imports the reward). Prints the figures and writes
benchmarks/results/rewards.json.

    .venv/bin/python benchmarks/bench_rewards.py [--calls 200] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from detached_rl.rewards.builtin import answer_line
from detached_rl.rewards.reward_process import RewardProcess

RESULTS = Path(__file__).resolve().parent / "results"
COMPLETION = "Mia has 12 coins and finds 5 more.\n12 + 5 = 17\nAnswer: 17"


def main() -> None:
    """Time both ways of calling the reward and print them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    prompts, completions = ["question"] * args.batch, [COMPLETION] * args.batch
    columns = {"answer": [17] * args.batch}
    direct = []
    for _ in range(args.calls):
        start = time.perf_counter()
        answer_line(prompts, completions, **columns)
        direct.append(time.perf_counter() - start)
    process = RewardProcess()
    start = time.perf_counter()
    status, _ = process.call("detached_rl.rewards.builtin:answer_line", prompts, completions, columns, 30.0)
    first = time.perf_counter() - start
    assert status == "ok", status
    helper = []
    for _ in range(args.calls):
        start = time.perf_counter()
        process.call("detached_rl.rewards.builtin:answer_line", prompts, completions, columns, 30.0)
        helper.append(time.perf_counter() - start)
    process.close()
    result = {"machine": f"{platform.machine()} cores={os.cpu_count()}",
              "batch": args.batch, "calls": args.calls,
              "direct_ms_median": 1e3 * statistics.median(direct),
              "helper_ms_median": 1e3 * statistics.median(helper),
              "helper_ms_p99": 1e3 * sorted(helper)[int(0.99 * (len(helper) - 1))],
              "helper_start_ms": 1e3 * first}
    result["added_ms_per_batch"] = result["helper_ms_median"] - result["direct_ms_median"]
    for key, value in result.items():
        print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rewards.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
