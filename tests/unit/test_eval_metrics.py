"""The evaluation metrics (algorithms/metrics.py) against hand computations and brute force: pass@k's unbiased
estimator, cons@k's majority vote, and the summary GRPO's validation reports through the same function."""

import itertools
import math

import pytest

from nemo_grpo.algorithms.metrics import cons_at_k, group_metrics, majority_answer, pass_at_k


@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (4, 2, 1, 0.5),  # k = 1: c / n
    (10, 3, 2, 1 - 21 / 45),  # 1 - C(7,2)/C(10,2)
    (4, 0, 3, 0.0),  # nothing correct
    (4, 3, 2, 1.0),  # n - c < k: every pair holds a correct sample
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_the_chance_that_k_draws_hold_a_correct_sample():
    """Brute force: the fraction of the k-subsets of n samples (c of them correct) with a correct one."""
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                hit = sum(any(i < c for i in s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(hit, abs=1e-12), (n, c, k)


def test_pass_at_k_is_stable_where_the_binomials_are_huge():
    """n = 1000: C(1000, 500) has 300 digits; the product form stays exact to float precision."""
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)
    exact = 1 - math.comb(990, 100) / math.comb(1000, 100)  # Python's integers: exact
    assert pass_at_k(1000, 10, 100) == pytest.approx(exact, rel=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_majority_answer_skips_missing_answers_and_breaks_ties_by_order():
    assert majority_answer(["3", None, "2", "2", None, None]) == "2"  # None does not vote
    assert majority_answer(["3", "2", "2", "3"]) == "3"  # tie: the first seen
    assert majority_answer([None, None]) is None


@pytest.mark.parametrize("answers, correct, k, expected", [
    (["2", "3", "2", None], [True, False, True, False], 4, 1.0),  # "2" wins 2 to 1, and "2" is right
    (["3", "3", "2"], [False, False, True], 3, 0.0),  # the right answer is in the minority
    (["3", "3", "2"], [False, False, True], 1, 0.0),  # only the first sample votes
    (["2", "3", "3", "3"], [True, False, False, False], 2, 1.0),  # first 2: a tie, "2" seen first
    ([None, None], [False, False], 2, 0.0),  # no answer: no vote
])
def test_cons_at_k(answers, correct, k, expected):
    assert cons_at_k(answers, correct, k) == expected


def test_group_metrics_by_hand():
    """2 prompts x 4 samples: prompt 0 has 1 correct (pass@2 = 0.5), prompt 1 has 3 (pass@2 = 1)."""
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    answers = ["4", "5", "5", None, "7", "7", "8", "7"]
    lengths = [2, 3, 4, 5, 2, 2, 2, 2]
    truncated = [False, False, False, True, False, False, False, False]
    m = group_metrics(rewards, answers, lengths, truncated, n=4, k=2)
    assert m == pytest.approx({
        "accuracy": 4 / 8, "pass@1": 4 / 8, "pass@2": (0.5 + 1.0) / 2,
        "cons@2": (1.0 + 1.0) / 2,  # prompt 0's first two: a tie "4"/"5", "4" first and right; prompt 1: "7"
        "mean_response_length": 22 / 8, "fraction_truncated": 1 / 8, "num_prompts": 2.0, "num_samples": 8.0})
    assert group_metrics(rewards, answers, lengths, truncated, n=4, k=4)["cons@4"] == 0.5  # "5" wins prompt 0


def test_group_metrics_rejects_partial_groups_and_k_above_n():
    with pytest.raises(ValueError):
        group_metrics([1.0] * 6, [None] * 6, [1] * 6, [False] * 6, n=4)
    with pytest.raises(ValueError):
        group_metrics([1.0] * 4, [None] * 4, [1] * 4, [False] * 4, n=4, k=5)
    with pytest.raises(ValueError):
        group_metrics([], [], [], [], n=1)
