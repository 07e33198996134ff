"""nemo_grpo.data.word_problems: the SmolLM2 recipe's data, split into train and held-out problems."""

import json

from nemo_grpo.data.word_problems import INSTRUCTION, write_splits


def test_word_problem_splits_are_disjoint_and_reproducible(tmp_path):
    train, heldout = write_splits(str(tmp_path / "a"), 300, 50, seed=0)
    again, _ = write_splits(str(tmp_path / "b"), 300, 50, seed=0)
    rows = {p: [json.loads(line) for line in open(p)] for p in (train, heldout)}
    assert len(rows[train]) == 300 and len(rows[heldout]) == 50
    assert not {r["input"] for r in rows[train]} & {r["input"] for r in rows[heldout]}
    assert open(train).read() == open(again).read()
    assert all(r["input"].endswith(INSTRUCTION) and r["output"].lstrip("-").isdigit() for r in rows[heldout])


def test_review_splits_have_disjoint_subjects(tmp_path):
    """data/reviews.py: the held-out subjects are kinds of things the training split never names; seeded."""
    from nemo_grpo.data import reviews

    train, heldout = reviews.write_splits(str(tmp_path / "a"), 320, 64, seed=0)
    again, _ = reviews.write_splits(str(tmp_path / "b"), 320, 64, seed=0)
    rows = [json.loads(line) for line in open(train)]
    assert open(train).read() == open(again).read() and len(rows) == 320
    assert len({r["input"] for r in rows}) == 320 == len(reviews.TRAIN_KINDS) * len(reviews.QUALIFIERS)
    held = [json.loads(line)["input"] for line in open(heldout)]
    assert all(r["output"] == "negative" for r in rows) and len(held) == 64
    assert not any(kind in text for kind in reviews.TRAIN_KINDS for text in held)
