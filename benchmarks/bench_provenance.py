"""What honest looks like: the per-sample log-prob gap between each engine and the trainer's recompute.

The provenance check (`detached_rl.algorithms.provenance`) takes an on-version sample out of training when
its mean per-token |behaviour - recompute| is beyond its engine's bound (`trainer.provenance.bounds`). This
measures that gap on the default job's model, prompts and sampling (SmolLM2-135M-Instruct, the default task,
temperature 0.8) for the engines a maker can serve with: HF float32, vLLM float32 and vLLM bfloat16, each
recomputed as the trainer does (HF float32, `process_logits`). It prints the distribution (per sample and
per token) and writes it to benchmarks/results/provenance.json.

    .venv/bin/python benchmarks/bench_provenance.py [--prompts 4] [--group 8] [--engines hf:float32,...]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from detached_rl.algorithms.provenance import sample_gaps
from detached_rl.config.schema import RunConfig
from detached_rl.core.sampling import SamplingConfig
from detached_rl.generation.hf import HFGenerationBackend
from detached_rl.models import Actor, load_smollm2
from detached_rl.rewards.tasks import make_problems

RESULTS = Path(__file__).resolve().parent / "results"


def quantiles(values: torch.Tensor) -> dict[str, float]:
    """p50, p90, p99 and max of a 1-d tensor."""
    values = values.float()
    levels = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
    points = {name: float(torch.quantile(values, q)) for name, q in levels}
    return {**points, "max": float(values.max())}


def backend_for(engine: str, actor: Actor):
    """A generation backend serving `actor` as `engine` ("hf:float32", "vllm:float32", "vllm:bfloat16")."""
    kind, dtype = engine.split(":")
    if kind == "hf":
        return HFGenerationBackend.from_actor(actor)
    from detached_rl.generation.vllm import VLLMBackend

    return VLLMBackend.from_actor(actor, dtype=dtype, max_model_len=1024)


def measure(engine: str, actor: Actor, prompts: list, sampling: SamplingConfig) -> dict:
    """Generate the prompts with `engine`, recompute with the trainer's float32 forward, and summarise."""
    backend = backend_for(engine, actor)
    try:
        torch.manual_seed(0)
        start = time.perf_counter()
        out = backend.generate_text(prompts, sampling)
        seconds = time.perf_counter() - start
    finally:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    gaps, tokens = [], []
    with torch.no_grad():
        for prompt, response, behaviour in zip(out.prompt_ids, out.response_ids, out.log_probs, strict=True):
            sequence = torch.cat([prompt, response])[None]
            mask = torch.ones_like(sequence)
            response_mask = torch.ones(1, response.numel(), dtype=torch.long)
            recomputed = actor.log_probs(sequence, mask, response_mask, sampling)[0]
            gaps.append(float(sample_gaps(behaviour[None].float(), recomputed[None], response_mask)[0]))
            finite = torch.isfinite(behaviour) & torch.isfinite(recomputed)
            tokens.append((recomputed - behaviour.float())[finite].abs())
    token_gaps = torch.cat(tokens)
    return {"engine": engine, "samples": len(gaps), "tokens": int(token_gaps.numel()),
            "generate_s": round(seconds, 1), "sample_gap": quantiles(torch.tensor(gaps)),
            "token_gap": quantiles(token_gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8, help="answers per prompt (the default job's group)")
    parser.add_argument("--engines", default="hf:float32,vllm:float32,vllm:bfloat16")
    args = parser.parse_args()
    config = RunConfig()
    sampling = config.sampling
    problems = make_problems(config.task.name, args.prompts, seed=0, split="train")
    prompts = [problem.messages for problem in problems for _ in range(args.group)]
    model, tokenizer = load_smollm2()
    actor = Actor(model.float(), tokenizer).eval()
    rows = []
    for engine in args.engines.split(","):
        row = measure(engine, actor, prompts, sampling)
        rows.append(row)
        s, t = row["sample_gap"], row["token_gap"]
        print(f"{engine:>14}: {row['samples']} samples, {row['tokens']} tokens ({row['generate_s']} s); "
              f"per-sample gap p50 {s['p50']:.2e} p90 {s['p90']:.2e} p99 {s['p99']:.2e} max {s['max']:.2e}; "
              f"per-token |gap| p50 {t['p50']:.2e} p99 {t['p99']:.2e} max {t['max']:.2e}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    report = {"machine": f"{platform.machine()} {platform.processor()} {torch.get_num_threads()} threads",
              "sampling": vars(sampling) if hasattr(sampling, "__dict__") else str(sampling), "rows": rows}
    (RESULTS / "provenance.json").write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
