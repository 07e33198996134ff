"""The generated data sets' common part (data/word_problems.py, data/reviews.py): a train and a held-out split
written as JSONL files of `{"input", "output"}` rows, and the command line that writes them."""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable


def save_splits(out_dir: str, train: list[dict], heldout: list[dict]) -> tuple[str, str]:
    """Write `train.jsonl` and `heldout.jsonl` under `out_dir` (created); returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = os.path.join(out_dir, "train.jsonl"), os.path.join(out_dir, "heldout.jsonl")
    for path, rows in zip(paths, (train, heldout)):
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return paths


def splits_main(prog: str, doc: str, write_splits: Callable[[str, int, int, int], tuple[str, str]], train: int,
                heldout: int, argv: list[str] | None = None) -> None:
    """`python -m <prog> --out DIR [--train N --heldout M --seed S]`: write_splits(DIR, N, M, S), paths printed."""
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for train.jsonl and heldout.jsonl")
    parser.add_argument("--train", type=int, default=train, help=f"training rows (default {train})")
    parser.add_argument("--heldout", type=int, default=heldout, help=f"held-out rows (default {heldout})")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for path in write_splits(args.out, args.train, args.heldout, args.seed):
        print(path)
