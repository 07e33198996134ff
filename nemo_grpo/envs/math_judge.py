"""The math environment's judge fallback (env.math.judge_fallback): env.llm_judge, in equivalence mode, decides the
answers math-verify could not parse, and is asked about a sample of the others to measure how often the two agree.

Which answers (math-verify's status of each, envs/math_env.py):
- UNPARSED (no answer found in the response's tail, or a reference math-verify cannot read): the judge's verdict is
  the reward (1 equal, 0 not, default_score when no reply parsed after the retries);
- VERIFIED (math-verify compared the two): the reward stays math-verify's; those whose hash of (answer tail,
  reference) falls below env.math.judge_agreement_fraction are asked as well, only to count agreement (the same
  answers each run);
- FAILED (the verifier timed out or errored): math-verify's 0.0 stands, the judge is not asked.
The judge sees {response} = the tail of the reply math-verify read (env.math.max_answer_chars), {reference} the
ground truth, {prompt} the last user message. Identical questions in one step are asked once. Each asked sample's
metadata gets "llm_judge": the judge's replies and verdicts (judge_modes.JudgeAsker.equivalence's record), its
"purpose" (fallback | agreement), "judge_reward" and the sample's "reward".
"""

from __future__ import annotations

import hashlib
from typing import Optional

from nemo_grpo.config import LlmJudgeConfig
from nemo_grpo.envs import judging
from nemo_grpo.envs.judge_modes import JudgeAsker, counter_metrics, equivalence_verdict

VERIFIED, UNPARSED, FAILED = "verified", "unparsed", "failed"  # math-verify's status of an answer
FALLBACK, AGREEMENT = "fallback", "agreement"  # why the judge was asked about a sample
COUNTS = ("judge_decided", "judge_undecided", "judge_agreement_samples", "judge_agreements")


def in_agreement_sample(response: str, reference: str, fraction: float) -> bool:
    """Whether (response, reference) is in the agreement sample: a hash of the two, read as a number in [0, 1),
    below `fraction` (deterministic: no seed, no process-dependent hashing)."""
    if fraction <= 0:
        return False
    text = f"{response}\x00{reference}".encode("utf-8", errors="surrogatepass")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") / 2**64 < fraction


def judge_purposes(samples: list[dict[str, str]], statuses: list[str], fraction: float) -> list[Optional[str]]:
    """Per sample: FALLBACK (math-verify could not parse), AGREEMENT (verified and in the agreement sample) or None
    (not asked)."""
    purposes = []
    for sample, status in zip(samples, statuses, strict=True):
        if status == UNPARSED:
            purposes.append(FALLBACK)
        elif status == VERIFIED and in_agreement_sample(sample["response"], sample["reference"], fraction):
            purposes.append(AGREEMENT)
        else:
            purposes.append(None)
    return purposes


class JudgeFallback:
    """The judge of env.llm_judge (equivalence) behind the math environment, and its counts since the last
    metrics() call."""

    def __init__(self, judge_cfg: LlmJudgeConfig, agreement_fraction: float, template: Optional[str] = None,
                 replicas=None, num_threads: int = 1, judge=None, api_key: Optional[str] = None):
        """judge_cfg: env.llm_judge (mode equivalence); the rest as judge_modes.JudgeAsker's."""
        if judge_cfg.mode != "equivalence":
            raise ValueError(f"env.math.judge_fallback needs env.llm_judge.mode equivalence, not {judge_cfg.mode}")
        if not 0 <= agreement_fraction <= 1:
            raise ValueError(f"env.math.judge_agreement_fraction must be in [0, 1], got {agreement_fraction}")
        self.fraction = agreement_fraction
        self.asker = JudgeAsker(judge_cfg, template, replicas, num_threads, judge, api_key)
        fields = judging.template_fields(self.asker.template)
        self._fields = [k for k in ("prompt", "response", "reference") if k in fields]  # what a question is
        self._counts = dict.fromkeys(COUNTS, 0)

    def judge(self, samples: list[dict[str, str]], rewards: list[float],
              statuses: list[str]) -> tuple[list[float], list[Optional[dict]]]:
        """The rewards after the judge's fallback verdicts and a record per sample (None where not asked).
        samples: template values {"prompt", "response" (the answer tail), "reference"}; rewards and statuses:
        math-verify's per sample."""
        purposes = judge_purposes(samples, statuses, self.fraction)
        keys = [tuple(s[k] for k in self._fields) if p else None for s, p in zip(samples, purposes)]
        unique: dict[tuple, int] = {}  # each distinct question once: its first sample
        for i, key in enumerate(keys):
            if key is not None:
                unique.setdefault(key, i)
        judged_rewards, judged_records = self.asker.equivalence([samples[i] for i in unique.values()])
        answers = dict(zip(unique, zip(judged_rewards, judged_records)))
        rewards, records = list(rewards), [None] * len(samples)
        for i, (key, purpose) in enumerate(zip(keys, purposes)):
            if purpose is None:
                continue
            judge_reward, record = answers[key]
            verdict = equivalence_verdict(record)
            if purpose == FALLBACK:
                rewards[i] = judge_reward
                self._counts["judge_decided" if verdict is not None else "judge_undecided"] += 1
            elif verdict is not None:
                self._counts["judge_agreement_samples"] += 1
                self._counts["judge_agreements"] += float(verdict) == rewards[i]
            records[i] = dict(record, purpose=purpose, judge_reward=judge_reward, reward=rewards[i])
        return rewards, records

    def metrics(self) -> dict[str, float]:
        """judge_decided / judge_undecided (answers math-verify could not parse given the judge's verdict /
        default_score: no reply parsed), judge_agreement_samples (agreement-sample answers with a judge verdict),
        judge_agreement (the fraction of those where it equals math-verify's; absent without any), and the judge's
        own counters prefixed judge_ (judge_modes.counter_metrics), all since the previous call."""
        counts, self._counts = self._counts, dict.fromkeys(COUNTS, 0)
        metrics = {k: float(counts[k]) for k in COUNTS if k != "judge_agreements"}
        if counts["judge_agreement_samples"]:
            metrics["judge_agreement"] = counts["judge_agreements"] / counts["judge_agreement_samples"]
        for k, v in counter_metrics(self.asker.take_stats()).items():
            metrics[k if k.startswith("judge_") else f"judge_{k}"] = v
        return metrics

    def shutdown(self) -> None:
        self.asker.shutdown()
