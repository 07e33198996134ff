"""Arithmetic word problems: a math task with held-out problems that needs no download.

    python -m nemo_grpo.data.word_problems --out data/arith [--train 4000 --heldout 200 --seed 0]

writes `train.jsonl` and `heldout.jsonl` of `{"input", "output"}` rows (the training data keys): one- and
two-step problems over addition, subtraction, multiplication and division with one- and two-digit numbers
(a 135M model gets few right: the point is to learn), each ending in the instruction to put the final answer in
`\\boxed{}`. The splits are disjoint: no problem text of the held-out split is in the training split. The same
seed writes the same files.
"""

from __future__ import annotations

import random
from typing import Callable

from nemo_grpo.data.splits import save_splits, splits_main

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
    return save_splits(out_dir, problems[heldout:], problems[:heldout])


def main(argv: list[str] | None = None) -> None:
    splits_main("nemo_grpo.data.word_problems", __doc__, write_splits, 4000, 200, argv)


if __name__ == "__main__":
    main()
