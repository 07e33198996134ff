"""Arithmetic word problems: a math task with held-out problems that needs no download.

    python -m nemo_grpo.data.word_problems --out data/arith [--train 4000 --heldout 200 --seed 0]

writes `train.jsonl` and `heldout.jsonl` of `{"input", "output"}` rows (the training data keys): one- and
two-step problems over addition, subtraction, multiplication and division with one- and two-digit numbers
(a 135M model gets few right: the point is to learn), each ending in the instruction to put the final answer in
`\\boxed{}`. The splits are disjoint: no problem text of the held-out split is in the training split. The same
seed writes the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Callable

INSTRUCTION = "Put the final answer in \\boxed{}."
PEOPLE = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hiro", "Isla", "Jonas"]
THINGS = ["apples", "stickers", "marbles", "books", "pencils", "cards", "shells", "coins"]


def _buy(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{who} has {a} {what} and buys {b} more. How many {what} does {who} have now?", a + b


def _give_away(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    a = rng.randint(20, 99)
    b = rng.randint(5, a - 5)
    return f"{who} has {a} {what} and gives {b} of them away. How many {what} does {who} have left?", a - b


def _boxes(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    a, b = rng.randint(3, 15), rng.randint(2, 9)
    return f"{who} buys {b} boxes of {what} with {a} {what} in each box. How many {what} does {who} buy?", a * b


def _share(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    friends, each = rng.randint(2, 9), rng.randint(2, 15)
    return (f"{who} shares {friends * each} {what} equally among {friends} friends. How many {what} does each "
            f"friend get?"), each


def _buy_and_give(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    a, b = rng.randint(10, 60), rng.randint(10, 40)
    c = rng.randint(5, a + b - 5)
    return f"{who} has {a} {what}, buys {b} more and gives {c} away. How many {what} are left?", a + b - c


def _change(rng: random.Random, who: str, what: str) -> tuple[str, int]:
    price, count = rng.randint(2, 12), rng.randint(2, 6)
    paid = price * count + rng.randint(1, 30)
    return (f"One of the {what} costs {price} dollars. {who} buys {count} of them and pays with {paid} dollars. How "
            f"many dollars of change does {who} get?"), paid - price * count


TEMPLATES: list[Callable[[random.Random, str, str], tuple[str, int]]] = [
    _buy, _give_away, _boxes, _share, _buy_and_give, _change]


def word_problems(n: int, seed: int) -> list[dict[str, str]]:
    """n distinct problems `{"input": question + instruction, "output": answer}`, the templates in turn."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        template = TEMPLATES[len(out) % len(TEMPLATES)]
        question, answer = template(rng, rng.choice(PEOPLE), rng.choice(THINGS))
        if question in seen:
            continue
        seen.add(question)
        out.append({"input": f"{question} {INSTRUCTION}", "output": str(answer)})
    return out


def write_splits(out_dir: str, train: int, heldout: int, seed: int) -> tuple[str, str]:
    """Write `train.jsonl` and `heldout.jsonl` (disjoint) under `out_dir`; returns their paths."""
    problems = word_problems(train + heldout, seed)
    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "heldout.jsonl")
    for path, rows in zip(paths, (problems[heldout:], problems[:heldout])):
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nemo_grpo.data.word_problems", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for train.jsonl and heldout.jsonl")
    parser.add_argument("--train", type=int, default=4000, help="training problems (default 4000)")
    parser.add_argument("--heldout", type=int, default=200, help="held-out problems (default 200)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_splits(args.out, args.train, args.heldout, args.seed):
        print(path)


if __name__ == "__main__":
    main()
