"""Scorer batching: one reference scorer serving several makers, merged forward passes vs one per request.

    .venv/bin/python benchmarks/bench_scorer_batching.py --model smollm2 --makers 4 --repeats 3

No Ray: the plain `Scorer` + `RequestBatcher` a scorer worker runs, fed from `--makers`
threads that each send `--requests` requests of `--rows` sequences (prompt 40 tokens +
response `--response-tokens` tokens, random ids) as fast as answers come back, the way makers
wait for their scores. "unbatched" answers each request alone (max_wait_s=0, max_batch_rows=1
request); "batched" merges what arrives within `--max-wait` seconds. Reported: rows/s, forward
passes, requests per pass; median [min-max] over repeats. JSON goes to
`benchmarks/results/scorer_batching-<model>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
import warnings
from pathlib import Path

import torch

from detached_rl.models import Actor, SamplingConfig, load_causal_lm
from detached_rl.scorer.batching import RequestBatcher
from detached_rl.scorer.core import Scorer
from detached_rl.scorer.requests import ScoreRequest

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
PROMPT_TOKENS = 40


def make_request(rows: int, response_tokens: int, vocab: int, seed: int) -> ScoreRequest:
    """A padded request of random token ids (full-length prompts and responses)."""
    generator = torch.Generator().manual_seed(seed)
    width = PROMPT_TOKENS + response_tokens
    sequences = torch.randint(10, vocab - 1, (rows, width), generator=generator)
    return ScoreRequest(sequences, torch.ones(rows, width, dtype=torch.long),
                        torch.ones(rows, response_tokens, dtype=torch.long), [{} for _ in range(rows)])


def serve(scorer: Scorer, makers: int, requests: int, rows: int, response_tokens: int, vocab: int,
          max_wait: float, batch_rows: int) -> dict[str, float]:
    """Run `makers` client threads against one batcher; rows/s and passes."""
    batcher = RequestBatcher(scorer.answer, max_batch_rows=batch_rows, max_wait_s=max_wait)
    before = scorer.batches

    def client(index: int) -> None:
        for n in range(requests):
            batcher.submit(make_request(rows, response_tokens, vocab, seed=index * 1000 + n)).result(600)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(makers)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    batcher.close()
    passes = scorer.batches - before
    return {"seconds": seconds, "rows_per_s": makers * requests * rows / seconds, "passes": passes,
            "requests_per_pass": makers * requests / passes}


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 | tiny[-<model_type>] | a model directory")
    parser.add_argument("--makers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=4, help="requests per maker")
    parser.add_argument("--rows", type=int, default=4, help="sequences per request")
    parser.add_argument("--response-tokens", type=int, default=32)
    parser.add_argument("--max-wait", type=float, default=0.05)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm(args.model)
    scorer = Scorer("reference", Actor(model, tokenizer), SamplingConfig())
    vocab = model.config.vocab_size
    shape = (args.makers, args.requests, args.rows, args.response_tokens, vocab)
    serve(scorer, 1, 1, *shape[2:], 0.0, 1)  # warm-up
    results: dict[str, list[dict[str, float]]] = {"unbatched": [], "batched": []}
    for _ in range(args.repeats):
        results["unbatched"].append(serve(scorer, *shape, 0.0, 1))
        results["batched"].append(serve(scorer, *shape, args.max_wait, args.makers * args.rows))
    table = {mode: {key: summary([run[key] for run in runs]) for key in runs[0]}
             for mode, runs in results.items()}
    print(f"reference scorer, {args.model}, {args.makers} makers x {args.requests} requests x "
          f"{args.rows} rows, {PROMPT_TOKENS}+{args.response_tokens} tokens, {args.threads} threads, "
          f"{os.cpu_count()} cores")
    print(f"{'mode':<10} {'rows/s':>24} {'forward passes':>16} {'requests/pass':>14}")
    for mode, figures in table.items():
        rate = figures["rows_per_s"]
        print(f"{mode:<10} {rate['median']:8.1f} [{rate['min']:.1f}-{rate['max']:.1f}]"
              f" {figures['passes']['median']:>16.0f} {figures['requests_per_pass']['median']:>14.2f}")
    ratio = table["batched"]["rows_per_s"]["median"] / table["unbatched"]["rows_per_s"]["median"]
    print(f"batched / unbatched rows/s: {ratio:.2f}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"scorer_batching-{Path(args.model).name}.json").write_text(json.dumps(
        {"args": vars(args), "machine": platform.machine(), "cores": os.cpu_count(), "table": table,
         "ratio": ratio, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
