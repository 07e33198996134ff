"""One-sentence negative reviews: an instruction-following task an LLM judge scores, with held-out subjects.

    python -m nemo_grpo.data.reviews --out data/reviews [--train 480 --heldout 64 --seed 0]

writes `train.jsonl` and `heldout.jsonl` of `{"input", "output"}` rows: the instruction "Write a one-sentence negative
review of {subject}." with the sentiment asked for ("negative") as the reference. The subjects are a kind of thing
(a pizza restaurant, a laptop...) with a qualifier (a new, a local...); the two splits' kinds are disjoint, so the
held-out score is on things the policy never reviewed. The same seed writes the same files.
configs/grpo_smollm2_judge_cpu.yaml trains on them against a frozen SmolLM2 judge that reads each review and says
whether it is positive or negative (configs/judges/review_sentiment.txt).
"""

from __future__ import annotations

import random

from nemo_grpo.data.splits import save_splits, splits_main

INSTRUCTION = "Write a one-sentence negative review of {subject}."
SENTIMENT = "negative"
QUALIFIERS = ["a new", "a local", "a popular", "an expensive", "a cheap", "a family", "a famous", "a small"]
TRAIN_KINDS = [
    "pizza restaurant", "hotel by the sea", "smartphone", "science fiction movie", "pair of running shoes",
    "coffee shop", "bus service", "video game", "cookbook", "laptop", "theme park", "dentist", "umbrella",
    "music album", "train journey", "gym", "bakery", "car rental company", "museum", "bicycle", "television",
    "sushi bar", "hair salon", "airline", "backpack", "board game", "library", "zoo", "washing machine",
    "mobile app", "taxi company", "ice cream shop", "cinema", "hiking trail", "vacuum cleaner", "bookshop",
    "camping tent", "fitness tracker", "language course", "bank",
]
HELDOUT_KINDS = [
    "steakhouse", "ski resort", "tablet", "horror movie", "pair of headphones", "tea house", "ferry service",
    "puzzle game", "novel", "printer", "water park", "hospital", "wristwatch", "podcast", "road trip", "swimming pool",
]


def subjects(kinds: list[str]) -> list[str]:
    """Every qualifier with every kind: "a new pizza restaurant", ..."""
    return [f"{q} {kind}" for kind in kinds for q in QUALIFIERS]


def rows(kinds: list[str], count: int, rng: random.Random) -> list[dict[str, str]]:
    """`count` rows over the subjects of `kinds`, shuffled (each subject once before any repeats)."""
    pool = subjects(kinds)
    rng.shuffle(pool)
    return [{"input": INSTRUCTION.format(subject=pool[i % len(pool)]), "output": SENTIMENT} for i in range(count)]


def write_splits(out_dir: str, train: int, heldout: int, seed: int) -> tuple[str, str]:
    """Write `train.jsonl` and `heldout.jsonl` (disjoint subjects) under `out_dir`; returns their paths."""
    rng = random.Random(seed)
    return save_splits(out_dir, rows(TRAIN_KINDS, train, rng), rows(HELDOUT_KINDS, heldout, rng))


def main(argv: list[str] | None = None) -> None:
    splits_main("nemo_grpo.data.reviews", __doc__, write_splits, 480, 64, argv)


if __name__ == "__main__":
    main()
