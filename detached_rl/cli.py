"""The `detached-rl` console script."""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections.abc import Sequence

from detached_rl import __version__


def _check(args: argparse.Namespace) -> int:
    from detached_rl.check import format_report, run_check

    print(f"detached-rl {__version__}: end-to-end check with model {args.model!r}", flush=True)
    report = run_check(
        model=args.model, num_prompts=args.prompts, group_size=args.group_size,
        max_new_tokens=args.max_new_tokens, seed=args.seed,
    )
    print(format_report(report))
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(prog="detached-rl", description=__doc__)
    parser.add_argument("--version", action="version", version=f"detached-rl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check", help="load a model, apply LoRA, generate, score and take one GRPO step (no Ray)",
        description="End-to-end check of the toolkit's core in one process.",
    )
    check.add_argument("--model", default="smollm2", help="smollm2 | tiny[-<model_type>] | a local model directory")
    check.add_argument("--prompts", type=int, default=4, help="distinct prompts (default 4)")
    check.add_argument("--group-size", type=int, default=4, help="responses per prompt (default 4)")
    check.add_argument("--max-new-tokens", type=int, default=32, help="response length limit (default 32)")
    check.add_argument("--seed", type=int, default=0)
    check.set_defaults(handler=_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # transformers 5 deprecation noise raised from inside peft; not actionable for users.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
