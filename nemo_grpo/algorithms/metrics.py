"""Evaluation metrics over groups of samples: pass@k, cons@k (majority vote), length and truncation.

Written once for `python -m nemo_grpo.eval` and GRPO's validation (GRPOTrainer.validate). A sample is correct
when its reward is > 0 (the math environment's 1.0 / 0.0; the convention of its math/pass@G). Samples come in
groups: the n samples of one prompt, contiguous.

    pass_at_k(n=4, c=1, k=2)                  # 0.5: one correct answer among 4, two draws
    group_metrics(rewards, answers, lengths, truncated, n=4, k=2)   # {"pass@1", "pass@2", "cons@2", ...}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct among n samples (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code"): 1 - C(n - c, k) / C(n, k), the chance that k samples drawn without
    replacement hold a correct one. Computed as 1 - prod_{i = n-c+1}^{n} (1 - k / i): no huge binomials."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent extracted answer (None: no answer, does not vote); a tie goes to the answer seen
    first. None when no sample has an answer."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(a for a in answers if a is not None and votes[a] == top)


def cons_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """cons@k (maj@k) of one prompt: 1.0 when the majority answer of its first k samples is a correct one
    (some sample with that answer is correct), else 0.0 (also when none of them has an answer)."""
    answers, correct = list(answers[:k]), list(correct[:k])
    winner = majority_answer(answers)
    return float(winner is not None and any(ok for a, ok in zip(answers, correct) if a == winner))


def group_metrics(rewards: Sequence[float], answers: Sequence[str | None], lengths: Sequence[int],
                  truncated: Sequence[bool], n: int, k: int = 1) -> dict[str, float]:
    """Metrics of N = P x n samples (the n of each prompt contiguous), with k <= n:
    accuracy (mean reward), pass@1 (mean correctness), pass@k and cons@k (means over prompts),
    mean_response_length (tokens), fraction_truncated (stopped at the token limit), num_prompts, num_samples."""
    total = len(rewards)
    if total == 0 or n < 1 or total % n:
        raise ValueError(f"{total} samples are not a whole, non-empty number of groups of {n}")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]")
    correct = [r > 0 for r in rewards]
    groups = range(0, total, n)
    metrics = {
        "accuracy": sum(rewards) / total,
        "pass@1": sum(correct) / total,
        f"pass@{k}": sum(pass_at_k(n, sum(correct[g:g + n]), k) for g in groups) / len(groups),
        f"cons@{k}": sum(cons_at_k(answers[g:g + n], correct[g:g + n], k) for g in groups) / len(groups),
        "mean_response_length": sum(lengths) / total,
        "fraction_truncated": sum(bool(t) for t in truncated) / total,
        "num_prompts": float(len(groups)),
        "num_samples": float(total),
    }
    return metrics


def sample_metrics(samples: Sequence, n: int, k: int = 1) -> dict[str, float]:
    """group_metrics of rollout Samples (algorithms/rollout.py: reward, answer, response_length, truncated)."""
    return group_metrics([s.reward for s in samples], [s.answer for s in samples],
                         [s.response_length for s in samples], [s.truncated for s in samples], n, k)
