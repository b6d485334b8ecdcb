"""Decode speed against the memory-bandwidth bound, GRPO training throughput and weight-sync speed, on one
device.

    .venv/bin/python benchmarks/bench_gpu.py --device cuda --model smollm2 --repeats 3
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --model tiny

In one process (no Ray), with `--prompts` distinct prompts x `--group-size` responses each (GRPO groups):

* generation, each variant timed for `--new-tokens` tokens and for 1 token (stop tokens disabled, so every
  row decodes every step); decode ms/step = (t(N) - t(1)) / (N - 1), tokens/s = rows x N / t(N):
  - backend: `HFGenerationBackend` (shared-prompt prefill, behaviour log-probs step by step),
  - HF generate: plain `model.generate` (no log-probs, no prompt sharing),
  - backend static / HF static: the same with `cache_implementation="static"` (HF compiles it on CUDA;
    a warm-up call per variant and length is not timed);
* the bandwidth bound of one decode step: (weight bytes + KV-cache bytes read at the mean context) /
  memory bandwidth (the data sheet's for a known GPU, `strategies.hardware`; measured copy bandwidth
  otherwise, e.g. on the CPU), and how far each variant is from it;
* one `GRPOLearner.train_step` on a batch of those groups (fp32 weights; bf16 autocast on CUDA):
  response tokens/s, all tokens/s and `perf/mfu` (against `strategies.hardware.peak_flops`);
* a full weight update built from the trainer's state dict and applied to the generating model
  (`build_weight_update` + `WeightReceiver`, "staged", cast to the generation dtype), in process:
  the put keeps references (no object-store copy), so this is the protocol's own cost (device->host
  copy, checksums, host->device copy, cast) in GB/s of fp32 weights.

Prints a table with the machine and writes `benchmarks/results/gpu-<device>-<model>.json`.
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
from transformers import GenerationConfig

from detached_rl.algorithms.grpo import GRPOConfig, GRPOLearner
from detached_rl.core.experience import Experience
from detached_rl.core.sampling import SamplingConfig
from detached_rl.generation.base import left_pad
from detached_rl.generation.hf import STATIC_CACHE_BUCKET, HFGenerationBackend
from detached_rl.models import Actor, load_causal_lm
from detached_rl.strategies.hardware import device_name, memory_bandwidth
from detached_rl.strategies.naive import NaiveStrategy
from detached_rl.weights.receiver import WeightReceiver
from detached_rl.weights.sink import ModuleWeightSink
from detached_rl.weights.update import build_weight_update

NO_STOP = (-1,)  # a stop token id no model emits: every row decodes every step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, run: Callable[[], object]) -> float:
    """Seconds `run()` takes, the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def plain_hf_generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                      pad_token_id: int, static: bool) -> torch.Tensor:
    """`model.generate` as a user would call it: sampling at temperature 1, no scores, no prompt sharing."""
    cache = {}
    if static:
        length = input_ids.shape[1] + new_tokens
        cache = dict(cache_implementation="static",
                     max_cache_len=-(-length // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              eos_token_id=list(NO_STOP), pad_token_id=pad_token_id, **cache)
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)


def decode_bound_s(model, rows: int, context: float, bandwidth: float) -> tuple[float, int, int]:
    """(seconds, weight bytes, KV bytes) of one decode step if it only had to read
    weights and KV cache once."""
    config = model.config.get_text_config()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    element = next(model.parameters()).element_size()
    kv_bytes = int(2 * config.num_hidden_layers * kv_heads * head_dim * context * rows * element)
    return (weight_bytes + kv_bytes) / bandwidth, weight_bytes, kv_bytes


def measure_generation(args, device: torch.device, gen_dtype: torch.dtype) -> tuple[dict, list, Actor]:
    """Decode figures of every variant, the last backend output (for training), and the generating actor."""
    model, tokenizer = load_causal_lm(args.model, device=device)
    model.to(gen_dtype).eval()
    actor = Actor(model, tokenizer)
    prompts = [f"Question {i}: what is {i} + {2 * i + 3}? Answer with a number." for i in range(args.prompts)]
    prompts = [p for p in prompts for _ in range(args.group_size)]
    prompt_ids = actor.encode_prompts(prompts)
    input_ids, attention_mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    backends = {"backend": HFGenerationBackend.from_actor(actor),
                "backend static": HFGenerationBackend.from_actor(actor, cache_implementation="static")}
    last_output: list = []

    def runner(variant: str, tokens: int) -> Callable[[], object]:
        if variant.startswith("backend"):
            sampling = SamplingConfig(max_new_tokens=tokens, stop_token_ids=NO_STOP)

            def run_backend() -> None:
                last_output[:] = [backends[variant].generate(prompt_ids, sampling)]
            return run_backend
        static = variant.endswith("static")
        return lambda: plain_hf_generate(model, input_ids, attention_mask, tokens, tokenizer.pad_token_id,
                                         static)

    results = {}
    for variant in ("backend", "HF generate", "backend static", "HF static"):
        torch.manual_seed(0)
        for tokens in (1, args.new_tokens):  # warm-up (compiles the static cache's decode step on CUDA)
            runner(variant, tokens)()
        full, one = [], []
        for _ in range(args.repeats):
            one.append(timed(device, runner(variant, 1)))
            full.append(timed(device, runner(variant, args.new_tokens)))
        step_s = [(f - o) / (args.new_tokens - 1) for f, o in zip(full, one, strict=True)]
        results[variant] = {"decode_ms_per_step": summary([s * 1e3 for s in step_s]),
                            "tokens_per_s": summary([len(prompts) * args.new_tokens / f for f in full]),
                            "generate_s": summary(full), "prefill_and_first_token_s": summary(one)}
        if variant == "backend":
            output = last_output[0]
    context = input_ids.shape[1] + args.new_tokens / 2
    bandwidth = memory_bandwidth(device)
    bound, weight_bytes, kv_bytes = decode_bound_s(model, len(prompts), context, bandwidth.value)
    results["bound"] = {"decode_ms_per_step": bound * 1e3, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
                        "bandwidth_bytes_per_s": bandwidth.value, "bandwidth_source": bandwidth.source,
                        "rows": len(prompts), "prompt_tokens": input_ids.shape[1]}
    groups = [str(i // args.group_size) for i in range(len(prompts))]
    # Alternating rewards within each group: non-zero advantages, so the step does the full work.
    experiences = [Experience(p, r, lp, torch.tensor(float(i % 2)), policy_version=0, group_id=g)
                   for i, (p, r, lp, g) in enumerate(zip(prompt_ids, output.response_ids, output.log_probs,
                                                         groups,
                                                         strict=True))]
    return results, experiences, actor


def measure_training(args, device: torch.device, experiences: list[Experience]) -> tuple[dict, GRPOLearner]:
    """Median/min/max of one GRPO step: response tokens/s, all tokens/s, MFU."""
    model, tokenizer = load_causal_lm(args.model, device=device)
    autocast = "bfloat16" if device.type == "cuda" else None
    learner = GRPOLearner(Actor(model, tokenizer), NaiveStrategy(device=device),
                          GRPOConfig(autocast_dtype=autocast, kl_coef=0.0))
    all_tokens = sum(len(e.prompt_ids) + len(e.response_ids) for e in experiences)
    learner.train_step(experiences, policy_version=0)  # warm-up: optimizer state, kernels
    steps = [learner.train_step(experiences, policy_version=0) for _ in range(args.repeats)]
    return {"response_tokens_per_s": summary([m["perf/tokens_per_s"] for m in steps]),
            "all_tokens_per_s": summary([all_tokens / m["time/training"] for m in steps]),
            "mfu": summary([m["perf/mfu"] for m in steps]), "autocast": autocast}, learner


def measure_weight_sync(args, device: torch.device, learner: GRPOLearner, actor: Actor,
                        gen_dtype: torch.dtype) -> dict:
    """GB/s of fp32 weights through build (trainer side) + apply (maker side), in process."""
    state = learner.policy.model.state_dict()
    store: dict[int, dict] = {}

    def put(chunk: dict) -> int:
        store[len(store)] = chunk
        return len(store) - 1

    build_s, apply_s = [], []
    for version in range(1, args.repeats + 1):
        store.clear()
        receiver = WeightReceiver({"actor": ModuleWeightSink(actor.model)}, cast_dtype=gen_dtype, version=0)
        synchronize(device)
        start = time.perf_counter()
        update, sent = build_weight_update({"actor": state}, version, put)
        weight_bytes = sent.bytes  # tied weights (an lm_head aliasing the embedding) travel once
        built = time.perf_counter()
        receiver.receive(update, store.__getitem__, timeout=600)
        synchronize(device)
        build_s.append(built - start)
        apply_s.append(time.perf_counter() - built)
    return {"weight_bytes": weight_bytes, "build_s": summary(build_s), "apply_s": summary(apply_s),
            "gb_per_s": summary([weight_bytes / (b + a) / 1e9
                                 for b, a in zip(build_s, apply_s, strict=True)])}


def main() -> None:
    """Run and print the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="tiny", help="tiny | smollm2 | a model directory")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=None,
                        help="distinct prompts (default 8 on cuda, 4 on cpu)")
    parser.add_argument("--group-size", type=int, default=None, help="responses per prompt (default 8 / 4)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per response (default 128 / 32)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--dtype", default=None,
                        help="generation dtype (default bfloat16 on cuda, float32 on cpu)")
    args = parser.parse_args()
    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch.cuda.is_available() is false (torch {torch.__version__})")
    args.prompts = args.prompts or (8 if on_cuda else 4)
    args.group_size = args.group_size or (8 if on_cuda else 4)
    args.new_tokens = args.new_tokens or (128 if on_cuda else 32)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode time is t(N) - t(1))")
    gen_dtype = getattr(torch, args.dtype or ("bfloat16" if on_cuda else "float32"))
    transformers.logging.set_verbosity_error()  # it warns about the disabled stop token
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")

    generation, experiences, actor = measure_generation(args, device, gen_dtype)
    training, learner = measure_training(args, device, experiences)
    sync = measure_weight_sync(args, device, learner, actor, gen_dtype)
    machine = (f"{device_name(device)}; host {platform.machine()}, {os.cpu_count()} cores "
               f"({torch.get_num_threads()} torch threads), torch {torch.__version__}, "
               f"transformers {transformers.__version__}")
    bound = generation["bound"]
    print(f"machine: {machine}")
    print(f"model {args.model}: {bound['rows']} rows ({args.prompts} prompts x {args.group_size}), "
          f"{bound['prompt_tokens']} prompt tokens (padded), {args.new_tokens} new tokens, generation "
          f"{str(gen_dtype).removeprefix('torch.')}, median (min-max) of {args.repeats}")
    print(f"{'generation':<16} {'decode ms/step':>24} {'x bound':>8} {'tokens/s':>22}")
    for variant in ("backend", "HF generate", "backend static", "HF static"):
        d, t = generation[variant]["decode_ms_per_step"], generation[variant]["tokens_per_s"]
        print(f"{variant:<16} {d['median']:>9.2f} ({d['min']:.2f}-{d['max']:.2f}) "
              f"{d['median'] / bound['decode_ms_per_step']:>8.1f} "
              f"{t['median']:>9.0f} ({t['min']:.0f}-{t['max']:.0f})")
    print(f"{'bandwidth bound':<16} {bound['decode_ms_per_step']:>9.3f}  "
          f"({bound['weight_bytes'] / 1e6:.1f} MB weights + {bound['kv_bytes'] / 1e6:.1f} MB KV at "
          f"{bound['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s, {bound['bandwidth_source']})")
    r, a, m = training["response_tokens_per_s"], training["all_tokens_per_s"], training["mfu"]
    print(f"GRPO step: {r['median']:.0f} ({r['min']:.0f}-{r['max']:.0f}) response tokens/s, "
          f"{a['median']:.0f} ({a['min']:.0f}-{a['max']:.0f}) tokens/s, "
          f"MFU {m['median']:.4f} ({m['min']:.4f}-{m['max']:.4f}), autocast {training['autocast']}")
    g = sync["gb_per_s"]
    print(f"weight sync (in process, {sync['weight_bytes'] / 1e6:.1f} MB fp32): {g['median']:.2f} "
          f"({g['min']:.2f}-{g['max']:.2f}) GB/s; build {sync['build_s']['median']:.3f} s, "
          f"apply {sync['apply_s']['median']:.3f} s")
    out = Path(__file__).parent / "results" / f"gpu-{args.device}-{Path(args.model).name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "args": vars(args), "generation": generation,
                               "training": training, "weight_sync": sync}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
