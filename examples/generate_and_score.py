"""Generate answers to held-out arithmetic problems, grade them, and show the padded batch a trainer sees.

    .venv/bin/python examples/generate_and_score.py --model tiny      # tiny random model, ~3 s
    .venv/bin/python examples/generate_and_score.py --model smollm2   # packaged SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse

import torch

from detached_rl import Experience, collate
from detached_rl.generation import HFGenerationBackend
from detached_rl.models import Actor, FunctionReward, SamplingConfig, load_causal_lm
from detached_rl.rewards.functions import numeric_answer_reward
from detached_rl.rewards.tasks import addition_problems


def main() -> None:
    """Run the example."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--problems", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args()

    torch.manual_seed(0)
    model, tokenizer = load_causal_lm(args.model)
    actor = Actor(model, tokenizer)
    problems = addition_problems(args.problems, split="test")
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=0.7)
    out = HFGenerationBackend.from_actor(actor).generate_text([p.prompt for p in problems], sampling)
    experiences = [
        Experience(prompt_ids=p, response_ids=r, log_probs=lp, reward=torch.tensor(0.0), maker="example")
        for p, r, lp in zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True)
    ]
    batch = collate(experiences, tokenizer.pad_token_id)
    rewards, parts = FunctionReward(numeric_answer_reward, tokenizer).score_detailed(
        batch.sequences, batch.attention_mask, batch.response_mask, [p.metadata for p in problems]
    )
    for problem, response, reward, part in zip(problems, out.response_ids, rewards, parts, strict=True):
        text = tokenizer.decode(response, skip_special_tokens=True).strip().replace("\n", " ")
        print(f"[{reward:.2f} correct={part['correct']:.0f}] {problem.prompt} -> {text[:70]!r}")
    print(f"batch: sequences {tuple(batch.sequences.shape)}, prompt length {batch.prompt_length}, "
          f"{batch.num_response_tokens} response tokens")


if __name__ == "__main__":
    main()
