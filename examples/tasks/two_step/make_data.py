"""Write the two-step word problems of this example: train.jsonl and test.jsonl.

    python make_data.py [--out DIR] [--train N] [--test N] [--seed S] [--ops=+-,++,-+]

Each line is {"question": ..., "answer": <int>, "operations": "+-"}: a two-step problem
with a, b, c in 2..12 (every intermediate and final count at least 1): by default a + b - c
("Mia has 12 coins, finds 5 more and then gives 3 away. ..."); `--ops=+-,++,-+` mixes in
a + b + c and a - b + c (harder: SmolLM2-135M copies the worked example's "+ then -" and
barely learned the mix in the default 28 steps, README.md). `answer` is the ground truth the
reward compares with; `operations` is metadata passed on to the rewards (unused by
rewards.py, handy for slicing results).

The split is fixed: the held-out file owns 25 % of the (operations, a, b, c) combinations,
chosen by a fixed shuffle independent of --seed, so no test question shares its numbers and
operations with a training question. --seed only chooses which problems are drawn and how
they are worded. Standard library only; the same arguments always write the same files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LOW, HIGH = 2, 12
HELD_OUT_FRACTION = 0.25  # 291 of the 1166 a + b - c combinations: 256 distinct held-out problems
SPLIT_SEED = 1234  # fixed: the held-out combinations never depend on --seed

NAMES = ("Mia", "Tom", "Ana", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eva", "Ben", "Lily", "Omar")
ITEMS = ("apples", "marbles", "books", "coins", "stickers", "cards", "pencils", "shells", "stamps", "cookies")

# Each framing: an opening with {a}, phrases for a "+" step and a "-" step with {x}, and the question.
# {n} is a name, {i} the items; the two steps are joined as "<step 1> and then <step 2>".
FRAMINGS = (
    {
        "start": "{n} has {a} {i}, ",
        "+": ("finds {x} more", "buys {x} more", "gets {x} more from a friend"),
        "-": ("gives {x} away", "loses {x}", "gives {x} to a friend"),
        "join": " and then ",
        "end": ". How many {i} does {n} have now?",
    },
    {
        "start": "There are {a} {i} in a box. {n} ",
        "+": ("puts in {x} more", "adds {x} more"),
        "-": ("takes out {x}", "removes {x}"),
        "join": ", then ",
        "end": ". How many {i} are in the box now?",
    },
    {
        "start": "{n} had {a} {i}. On Monday {n} ",
        "+": ("found {x} more", "bought {x} more", "was given {x} more"),
        "-": ("gave away {x}", "lost {x}", "sold {x}"),
        "join": ", and on Tuesday {n} ",
        "end": ". How many {i} does {n} have now?",
    },
)


def value(ops: str, a: int, b: int, c: int) -> int:
    """The answer of a op1 b op2 c, left to right."""
    first = a + b if ops[0] == "+" else a - b
    return first + c if ops[1] == "+" else first - c


OPERATIONS = ("+-", "++", "-+")
DEFAULT_OPERATIONS = ("+-",)


def combinations(operations: tuple[str, ...] = DEFAULT_OPERATIONS) -> list[tuple[str, int, int, int]]:
    """Every (operations, a, b, c) with a, b, c in LOW..HIGH whose counts stay at least 1."""
    numbers = range(LOW, HIGH + 1)
    return [(ops, a, b, c) for ops in operations for a in numbers for b in numbers for c in numbers
            if (ops[0] == "+" or a > b) and value(ops, a, b, c) >= 1]


def split_pool(split: str,
               operations: tuple[str, ...] = DEFAULT_OPERATIONS) -> list[tuple[str, int, int, int]]:
    """The combinations of one split: a fixed shuffle, the first 25 % held out."""
    pool = combinations(operations)
    random.Random(SPLIT_SEED).shuffle(pool)
    held_out = int(len(pool) * HELD_OUT_FRACTION)
    return pool[:held_out] if split == "test" else pool[held_out:]


def draw(pool: list, count: int, rng: random.Random) -> list:
    """`count` distinct items of `pool` when it has enough, else a draw with replacement."""
    if count <= len(pool):
        return rng.sample(pool, count)
    return [pool[rng.randrange(len(pool))] for _ in range(count)]


def question(ops: str, a: int, b: int, c: int, rng: random.Random) -> str:
    framing = rng.choice(FRAMINGS)
    name, items = rng.choice(NAMES), rng.choice(ITEMS)
    text = (framing["start"].format(n=name, i=items, a=a)
            + rng.choice(framing[ops[0]]).format(x=b)
            + framing["join"].format(n=name)
            + rng.choice(framing[ops[1]]).format(x=c)
            + framing["end"].format(n=name, i=items))
    return text


def rows(split: str, count: int, seed: int, operations: tuple[str, ...] = DEFAULT_OPERATIONS) -> list[dict]:
    rng = random.Random(f"{split}-{seed}")
    return [{"question": question(ops, a, b, c, rng), "answer": value(ops, a, b, c), "operations": ops}
            for ops, a, b, c in draw(split_pool(split, operations), count, rng)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent,
                        help="directory to write train.jsonl and test.jsonl to (default: this folder)")
    parser.add_argument("--train", type=int, default=2048, help="training problems (default 2048)")
    parser.add_argument("--test", type=int, default=256, help="held-out problems (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="which problems are drawn (default 0)")
    parser.add_argument("--ops", default=",".join(DEFAULT_OPERATIONS),
                        help=f"comma-separated operation pairs out of {','.join(OPERATIONS)} (default "
                             f"{','.join(DEFAULT_OPERATIONS)}: a + b - c)")
    args = parser.parse_args()
    if args.train < 1 or args.test < 1:
        parser.error("--train and --test must be >= 1")
    operations = tuple(dict.fromkeys(op.strip() for op in args.ops.split(",") if op.strip()))
    if not operations or any(op not in OPERATIONS for op in operations):
        parser.error(f"--ops takes operation pairs out of {','.join(OPERATIONS)}, got {args.ops!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", args.train), ("test", args.test)):
        path = args.out / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for row in rows(split, count, args.seed, operations):
                f.write(json.dumps(row) + "\n")
        print(f"wrote {count} problems to {path}")


if __name__ == "__main__":
    main()
