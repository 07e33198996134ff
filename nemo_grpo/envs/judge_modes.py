"""Asking env.llm_judge's judge: one implementation for the LLM-judge environment (envs/llm_judge_env.py, all three
modes) and the math environment's judge fallback (envs/math_env.py, equivalence).

`JudgeAsker` starts the judge the config names (or takes a started one), fills the template, asks with
judging.judge_with_retries (greedy first attempts when cfg.greedy, then a new seed per attempt) and counts what the
judge_* metrics report (`counter_metrics`). `JudgeAsker.equivalence` is the equivalence mode: the judge says whether
{response}'s answer equals {reference}; with check_twice_swap an "equal" is asked again with the two swapped and
stands only if the judge says so again; reward 1 or 0, default_score when a verdict never parsed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from nemo_grpo.config import LlmJudgeConfig
from nemo_grpo.envs import judging
from nemo_grpo.envs.interface import MessageLog

RECORD = "llm_judge"  # the metadata key of a sample's judge record
COUNTERS = ("seconds", "judge_calls", "judge_requests", "retries", "parse_failures", "request_failures",
            "truncated_prompts")


class JudgeAsker:
    """The judge of an env.llm_judge config, its template, and the counters of what it was asked."""

    def __init__(self, cfg: LlmJudgeConfig, template: Optional[str] = None, replicas=None, num_threads: int = 1,
                 judge=None, api_key: Optional[str] = None):
        """template: the prompt template's text (None: read from judge_prompt_template_fpath); replicas: an
        in-cluster judge engine's scheduling strategies (None: one replica, anywhere); num_threads: torch threads
        per engine worker; judge: a started judge to use (its owner shuts it down) instead of starting one;
        api_key: an HTTP judge's key (None: from api_key_env here)."""
        from nemo_grpo.envs.judge_clients import EngineJudge, HttpJudge

        if template is None:
            with open(cfg.judge_prompt_template_fpath, encoding="utf-8") as f:
                template = f.read()
        problem = judging.template_problem(template, cfg.mode)
        if problem is not None:
            raise ValueError(f"env.llm_judge.judge_prompt_template_fpath {problem}")
        self.cfg, self.template = cfg, template
        self.owns_judge = judge is None
        if judge is None:
            judge = EngineJudge(cfg, replicas or (None,), num_threads) if cfg.in_cluster else HttpJudge(cfg, api_key)
        self.judge = judge
        self._asks = 0  # ask() calls so far: each attempt's seed comes from it
        self.stats = dict.fromkeys(COUNTERS, 0)

    def conversation(self, values: dict[str, str]) -> list[dict[str, str]]:
        """The judge's conversation: the system message (if any), then the template filled with `values`."""
        c = self.cfg
        system = [{"role": "system", "content": c.judge_system_message}] if c.judge_system_message else []
        return system + [{"role": "user", "content": judging.fill_template(self.template, values)}]

    def _seed(self, attempt: int) -> Optional[int]:
        """Attempt 0: None (greedy) when cfg.greedy; every other attempt a seed of its own."""
        return None if attempt == 0 and self.cfg.greedy else self._asks * 1000 + attempt

    def ask(self, conversations: list[list[dict]], parse: Callable) -> list[judging.Judgment]:
        """Judge every conversation (judging.judge_with_retries), counting calls, time, retries and failures."""
        if not conversations:
            return []
        if self.judge is None:
            raise RuntimeError("the LLM judge was asked after shutdown()")
        self._asks += 1
        start = time.perf_counter()
        judged, calls = judging.judge_with_retries(conversations, self.judge, parse, self.cfg.parse_retries,
                                                   self._seed)
        s = self.stats
        s["seconds"] += time.perf_counter() - start
        s["judge_calls"] += calls
        s["judge_requests"] += sum(len(j.replies) for j in judged)
        s["retries"] += sum(j.retries for j in judged)
        s["parse_failures"] += sum(j.value is None for j in judged)
        s["request_failures"] += sum(reply is None for j in judged for reply in j.replies)
        take_truncated = getattr(self.judge, "take_truncated", None)  # the clients have it; a plain callable not
        s["truncated_prompts"] += take_truncated() if take_truncated else 0
        return judged

    def equivalence(self, samples: list[dict[str, str]]) -> tuple[list[float], list[dict]]:
        """Rewards and records of equivalence judgments of samples {"response", "reference"[, "prompt"]}: a record
        holds the replies and the parsed verdict ("equal"), and with check_twice_swap, for a first "equal", the
        swapped ask's ("swap_replies", "swap_equal")."""
        c = self.cfg

        def parse(reply):
            return judging.parse_equivalence(reply, c.judge_equal_label, c.judge_not_equal_label)

        first = self.ask([self.conversation(s) for s in samples], parse)
        records = [{"replies": j.replies, "equal": j.value} for j in first]
        again = [i for i, j in enumerate(first) if j.value is True] if c.check_twice_swap else []
        swapped = self.ask([self.conversation(dict(samples[i], response=samples[i]["reference"],
                                                   reference=samples[i]["response"])) for i in again], parse)
        for i, j in zip(again, swapped):
            records[i].update(swap_replies=j.replies, swap_equal=j.value)
        rewards = [c.default_score if (v := equivalence_verdict(r)) is None else float(v) for r in records]
        return rewards, records

    def take_stats(self) -> dict[str, float]:
        """The counters since the previous take_stats(), and zero them."""
        s, self.stats = self.stats, dict.fromkeys(COUNTERS, 0)
        return s

    def shutdown(self) -> None:
        """Free the judge (an in-cluster engine, an HTTP client) if this asker started it; safe twice."""
        judge, self.judge = self.judge, None
        if judge is not None and self.owns_judge:
            judge.shutdown()


def equivalence_verdict(record: dict) -> Optional[bool]:
    """An equivalence record's verdict: equal when every ask said so (the first, and the swapped one if asked),
    None when one never parsed."""
    verdicts = [record["equal"], record.get("swap_equal", record["equal"])]
    return None if None in verdicts else all(verdicts)


def counter_metrics(stats: dict[str, float]) -> dict[str, float]:
    """The judge's metrics from take_stats(): judge_calls (attempt rounds), judge_requests, retries,
    parse_failures (judgments given default_score), request_failures (HTTP requests that failed),
    truncated_prompts, and seconds_per_call when there was a call."""
    metrics = {k: float(stats[k]) for k in COUNTERS if k != "seconds"}
    if stats["judge_calls"]:
        metrics["seconds_per_call"] = stats["seconds"] / stats["judge_calls"]
    return metrics


def template_values(message_log: MessageLog, env_info: dict[str, Any]) -> dict[str, str]:
    """A sample's template values: prompt (the last user message before the reply), response (the last
    message), reference (env_info["ground_truth"], "" without one)."""
    before = message_log[:-1]
    prompt = next((m.get("content") or "" for m in reversed(before) if m.get("role") == "user"), "")
    response = (message_log[-1].get("content") or "") if message_log else ""
    reference = env_info.get("ground_truth")
    return {"prompt": str(prompt), "response": str(response), "reference": "" if reference is None else str(reference)}
