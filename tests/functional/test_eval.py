"""`python -m nemo_grpo.eval` end to end, in this process on the session's Ray cluster: the built-in tiny model
samples 4 answers to 12 addition problems on the torch engine; the outputs are checked against each other and
pass@k / cons@k against their definitions, recomputed from the written samples."""

import itertools
import json
import os
from collections import Counter

import pytest
from train_runs import ROOT, builtin_model_cache  # noqa: F401 (autouse fixture)

N, K, PROMPTS = 4, 2, 12


def _by_hand_pass_at_k(n: int, c: int, k: int) -> float:
    """The fraction of k-subsets of the n samples that hold a correct one (the definition, by enumeration)."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_eval_entry_point(user_console, ray_cluster, tmp_path, capsys):
    """One run: its exit status and table, then the files (check_outputs) and the metrics' definitions."""
    from nemo_grpo.eval import main

    argv = ["--config", os.path.join(ROOT, "configs", "eval_tiny_cpu.yaml"), f"eval.save_path={tmp_path}",
            f"eval.num_tests_per_prompt={N}", f"eval.k_value={K}", f"eval.max_num_prompts={PROMPTS}",
            "eval.num_prompts_per_step=5", "eval.progress_bar=false", "policy.generation.backend=torch"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert f"pass@{K}" in table and "<- eval.metric" in table and "cons@2" in table
    with open(tmp_path / "samples.jsonl", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    with open(tmp_path / "summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    check_outputs(rows, summary)
    check_definitions(rows, summary["metrics"])


def check_outputs(rows: list[dict], summary: dict) -> None:
    """samples.jsonl: every (prompt, sample) in order, a group sharing its prompt; summary.json: its means."""
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(PROMPTS) for s in range(N)]
    assert all(r["prompt"] == rows[r["prompt_index"] * N]["prompt"] for r in rows)
    assert rows[0]["prompt"] == "0+0=" and rows[0]["ground_truth"] == "0"
    assert all(r["reward"] in (0.0, 1.0) and 1 <= r["response_length"] <= 4 for r in rows)
    assert all(r["reward"] == float(r["answer"] == r["ground_truth"]) for r in rows)  # math-verify on digits
    m = summary["metrics"]
    assert (summary["metric"], summary["score"]) == (f"pass@{K}", m[f"pass@{K}"])
    assert m["num_samples"] == N * PROMPTS and m["num_prompts"] == PROMPTS
    assert m["pass@1"] == pytest.approx(sum(r["reward"] for r in rows) / len(rows))
    assert m["mean_response_length"] == pytest.approx(sum(r["response_length"] for r in rows) / len(rows))
    assert m["fraction_truncated"] == pytest.approx(sum(r["truncated"] for r in rows) / len(rows))
    assert 0 < m["pass@1"] < m[f"pass@{K}"] < 1  # the warm-started model is right about a quarter of the time


def check_definitions(rows: list[dict], metrics: dict) -> None:
    """pass@k: the fraction of k-subsets with a correct sample; cons@k: the most frequent answer of the first k
    (a tie: the first seen) equals the reference."""
    groups = [rows[p * N:(p + 1) * N] for p in range(PROMPTS)]
    pass_k = [_by_hand_pass_at_k(N, sum(r["reward"] > 0 for r in g), K) for g in groups]
    assert metrics[f"pass@{K}"] == pytest.approx(sum(pass_k) / PROMPTS)
    cons = []
    for g in groups:
        votes = Counter(r["answer"] for r in g[:K] if r["answer"] is not None)
        top = max(votes.values(), default=0)
        winner = next((r["answer"] for r in g[:K] if r["answer"] is not None and votes[r["answer"]] == top), None)
        cons.append(float(winner is not None and winner == g[0]["ground_truth"]))
    assert metrics[f"cons@{K}"] == pytest.approx(sum(cons) / PROMPTS)
