"""Generation throughput of the maker backends on this machine, in one process, same run: HF `generate` vs
vLLM.

    .venv/bin/python benchmarks/bench_generation.py --repeats 3

The policy is the default job's (`detached_rl/config/run.yaml`): the packaged SmolLM2-135M-Instruct with a
peft LoRA adapter (r=16, alpha=32, every Linear layer but the output head), served as a maker serves it:

* `hf-fp32`: the HF backend in float32 with the adapter kept (the default maker before issue 19);
* `hf-bf16`: the HF backend generating in bfloat16 (`maker.backend_options.dtype: bfloat16`);
* `vllm-bf16`: vLLM's offline engine in this process, bfloat16, eager, the adapter kept as a vLLM LoRA
adapter; `vllm-fp32`: the same in float32 (what `maker.vllm.dtype: auto` picks on a CPU without native
bf16).

Workloads: `16x32`: 16 distinct plain prompts x 32 new tokens (stop tokens disabled, so every response has
32 tokens); `demo`: the default job's real batch, 2 `word_problems` chat prompts x 8 answers (the group
goes as one request, vLLM's `n`) of at most 40 new tokens at temperature 0.8, stopping at eos. Each figure is
the median [min-max] of `--repeats` timed calls after one warm-up call; tokens/s counts the response tokens
generated. Writes `benchmarks/results/generation.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from detached_rl.core.sampling import SamplingConfig
from detached_rl.generation.hf import HFGenerationBackend
from detached_rl.models import Actor, LoraSettings, apply_lora, load_causal_lm
from detached_rl.rewards.tasks import make_problems

RESULTS = Path(__file__).parent / "results"


def workloads() -> dict[str, tuple[list, SamplingConfig]]:
    """Name -> (prompts, sampling) for the two workloads."""
    plain = [f"Write a short story about the number {i}." for i in range(16)]
    problems = make_problems("word_problems", 2, seed=0)
    demo = [problem.messages for problem in problems for _ in range(8)]
    return {
        "16x32": (plain, SamplingConfig(max_new_tokens=32, stop_token_ids=(-1,))),
        "demo": (demo, SamplingConfig(max_new_tokens=40, temperature=0.8)),
    }


def build_backends(actor: Actor, names: list[str]) -> dict[str, Callable[[], object]]:
    """Backend name -> a factory (engines are built one at a time, each dropped before the next)."""
    factories: dict[str, Callable[[], object]] = {
        "hf-fp32": lambda: HFGenerationBackend.from_actor(actor),
        "hf-bf16": lambda: HFGenerationBackend.from_actor(actor, dtype="bfloat16"),
    }

    def vllm(dtype: str) -> object:
        from detached_rl.generation.vllm import VLLMBackend

        return VLLMBackend.from_actor(actor, dtype=dtype, kv_cache_gb=1, max_model_len=1024)

    factories["vllm-bf16"] = lambda: vllm("bfloat16")
    factories["vllm-fp32"] = lambda: vllm("float32")
    return {name: factories[name] for name in names}


def time_backend(backend: object, prompts: list, sampling: SamplingConfig, repeats: int) -> dict:
    """Median/min/max seconds and tokens/s of `repeats` timed calls after one warm-up."""
    backend.generate_text(prompts, sampling)
    seconds, tokens = [], []
    for repeat in range(repeats):
        torch.manual_seed(repeat)
        start = time.perf_counter()
        out = backend.generate_text(prompts, sampling)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(r.numel() for r in out.response_ids))
    rates = [t / s for t, s in zip(tokens, seconds, strict=True)]
    return {"seconds": {"median": statistics.median(seconds), "min": min(seconds), "max": max(seconds)},
            "tokens": tokens, "tokens_per_s": {"median": statistics.median(rates), "min": min(rates),
                                               "max": max(rates)}}


def main() -> None:
    """Measure every backend on every workload and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in this process")
    parser.add_argument("--backends", nargs="+", default=["hf-fp32", "hf-bf16", "vllm-bf16"])
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm("smollm2")
    actor = Actor(apply_lora(model, LoraSettings(r=16, alpha=32, target_modules=("all-linear",))), tokenizer)
    results: dict[str, dict] = {}
    for name, factory in build_backends(actor, args.backends).items():
        start = time.perf_counter()
        backend = factory()
        startup = time.perf_counter() - start
        results[name] = {"startup_s": startup}
        for workload, (prompts, sampling) in workloads().items():
            results[name][workload] = time_backend(backend, prompts, sampling, args.repeats)
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        del backend
    baseline = args.backends[0]
    print(f"{'backend':<10} {'start s':>8} " + " ".join(f"{w + ' s':>22} {w + ' tok/s':>12} {'x':>5}"
                                                         for w in workloads()))
    for name, row in results.items():
        cells = []
        for workload in workloads():
            s, rate = row[workload]["seconds"], row[workload]["tokens_per_s"]["median"]
            ratio = rate / results[baseline][workload]["tokens_per_s"]["median"]
            cells.append(f"{s['median']:>7.2f} [{s['min']:.2f}-{s['max']:.2f}] {rate:>12.0f} {ratio:>5.2f}")
        print(f"{name:<10} {row['startup_s']:>8.1f} " + " ".join(f"{c:>40}" for c in cells))
    RESULTS.mkdir(exist_ok=True)
    report = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or 'cpu'}",
              "threads": args.threads, "repeats": args.repeats, "baseline": baseline, "results": results}
    (RESULTS / "generation.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
