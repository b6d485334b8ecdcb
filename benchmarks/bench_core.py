"""Generation and training-step time of the policy on this machine, in one process (no Ray).

    .venv/bin/python benchmarks/bench_core.py --model smollm2 --repeats 3

Prints a table (median, min, max over repeats) and writes JSON next to it
(`benchmarks/results/core-<model>.json`). The workload matches the original design's §5 (docs/performance.md):
16 responses x 32 new tokens, LoRA r=8 on q_proj/v_proj, one GRPO policy-loss step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from detached_rl import Experience, algorithms, collate
from detached_rl.generation import HFGenerationBackend
from detached_rl.models import Actor, LoraSettings, SamplingConfig, apply_lora, load_causal_lm


def measure(model_name: str, responses: int, new_tokens: int, repeats: int, threads: int) -> dict:
    """Median/min/max seconds of generation and of one training step."""
    transformers.logging.set_verbosity_error()  # it warns about the disabled stop token below
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, tokenizer = load_causal_lm(model_name)
    model = apply_lora(model, LoraSettings(r=8, alpha=16))
    actor = Actor(model, tokenizer)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    # min_new_tokens is not exposed: stop tokens are disabled instead so every response has new_tokens tokens.
    sampling = SamplingConfig(max_new_tokens=new_tokens, stop_token_ids=(-1,))
    prompts = [f"What is {i} + {i + 3}?" for i in range(responses)]
    generate_s, train_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = HFGenerationBackend.from_actor(actor).generate_text(prompts, sampling)
        generate_s.append(time.perf_counter() - start)
        batch = collate([Experience(p, r, lp, torch.tensor(float(i % 2))) for i, (p, r, lp) in
                         enumerate(zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True))],
                        tokenizer.pad_token_id)
        advantages = algorithms.broadcast_to_tokens(
            algorithms.group_advantages(batch.scores, group_size=4), batch.response_mask)
        start = time.perf_counter()
        log_probs = actor.log_probs(batch.sequences, batch.attention_mask, batch.response_mask, sampling)
        loss, _ = algorithms.policy_loss(log_probs, batch.log_probs, advantages, batch.response_mask)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        train_s.append(time.perf_counter() - start)
    summary = {name: {"median": statistics.median(v), "min": min(v), "max": max(v)}
               for name, v in (("generate_s", generate_s), ("train_step_s", train_s))}
    return {"model": model_name, "responses": responses, "new_tokens": new_tokens, "threads": threads,
            "repeats": repeats, "machine": f"{platform.machine()}, {os.cpu_count()} cores", **summary}


def main() -> None:
    """Run and print the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--responses", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    args = parser.parse_args()
    rows = [measure(args.model, args.responses, args.new_tokens, args.repeats, t) for t in args.threads]
    print(f"{'threads':>7} {'generate s (med/min/max)':>28} {'train step s (med/min/max)':>30}")
    for row in rows:
        g, t = row["generate_s"], row["train_step_s"]
        print(f"{row['threads']:>7} {g['median']:>10.2f} {g['min']:>8.2f} {g['max']:>8.2f} "
              f"{t['median']:>12.2f} {t['min']:>8.2f} {t['max']:>8.2f}")
    out = Path(__file__).parent / "results" / f"core-{args.model}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
