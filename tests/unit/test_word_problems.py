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
