"""`LlmJudgeEnvironment`: rewards from a judge model's replies (env.llm_judge), in one of three modes.

- pointwise: the judge reads the template filled with the prompt, the response and the reference; its reply's
  number (judging.parse_number) or named label's score (score_labels: judging.parse_label), mapped from
  [score_min, score_max] to [0, 1], is the reward.
- pairwise: within each prompt's group, the judge compares responses two at a time (comparison_strategy; both
  orders with check_twice_swap); a response's reward is its win rate, ties counted half (judging.win_rates).
  A group is the samples of one `step` call whose conversations before the reply are identical: GRPO's G samples
  of a prompt (two data rows with the same prompt in one step form one group). A group of one sample has nothing
  to compare with and gets default_score.
- equivalence: the judge says whether the response's answer equals the reference (judge_equal_label /
  judge_not_equal_label); reward 1 or 0. With check_twice_swap an "equal" is asked again with the two swapped,
  and stands only if the judge says so again (NeMo Gym's equivalence_llm_judge). The asking and this mode are
  envs/judge_modes.py's JudgeAsker, which the math environment's judge fallback (env.math.judge_fallback) shares.

What is filled in: {prompt} is the last user message before the reply, {response} (response_1, response_2) the
reply (the conversation's last message), {reference} env_info["ground_truth"]. A reply that does not parse is
asked again, sampled with a new seed, up to parse_retries times, then its judgment is default_score; that is
counted, never an error. Each sample's metadata (its env_info, passed on) gets "llm_judge": what the judge was
asked about it and replied, and what was made of it. Every conversation terminates after judging.

    env = create_env("llm_judge", cfg.env.llm_judge, template=text)  # a Ray actor; an in-cluster judge starts
    ret = ray.get(env.step.remote(message_logs, env_infos))            # ret.rewards [B]
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from nemo_grpo.config import LlmJudgeConfig
from nemo_grpo.envs import judging
from nemo_grpo.envs.interface import EnvironmentInterface, EnvironmentReturn, MessageLog
from nemo_grpo.envs.judge_modes import RECORD, JudgeAsker, counter_metrics, template_values

log = logging.getLogger(__name__)
PREFIX = "llm_judge_env"


class LlmJudgeEnvironment(EnvironmentInterface):
    """Judges conversations with env.llm_judge's judge; started as a Ray actor by `create_env`."""

    def __init__(self, cfg: LlmJudgeConfig, template: Optional[str] = None, replicas=None, num_threads: int = 1,
                 judge=None, api_key: Optional[str] = None):
        """template: the judge's prompt template text (build.py reads it on the driver; None: read here from
        judge_prompt_template_fpath); replicas: the in-cluster judge engine's scheduling strategies
        (resource_plan.judge_replicas; None: one replica, anywhere); num_threads: torch threads per engine worker;
        judge: a started judge (judge_clients.EngineJudge or HttpJudge) to use instead of starting one, e.g. one that
        several environments share; its owner shuts it down, not this environment; api_key: an HTTP judge's key
        (build.py reads it on the driver)."""
        self.cfg = cfg
        self.asker = JudgeAsker(cfg, template, replicas, num_threads, judge, api_key)
        self._pairs = _new_pair_stats()

    # ------------------------------------------------------------------------------------------ modes
    def _pointwise(self, samples: list[dict]) -> tuple[list[float], list[dict]]:
        c = self.cfg
        if c.score_labels:
            def parse(reply):
                return judging.parse_label(reply, c.score_labels, ignore_case=True)
        else:
            def parse(reply):
                return judging.parse_number(reply, c.score_regex)
        judged = self.asker.ask([self.asker.conversation(s) for s in samples], parse)
        rewards = [c.default_score if j.value is None else judging.map_score(j.value, c.score_min, c.score_max)
                   for j in judged]
        return rewards, [{"replies": j.replies, "score": j.value} for j in judged]

    def _pairwise(self, samples: list[dict], groups: list[list[int]]) -> tuple[list[float], list[dict]]:
        """Each group's comparisons, asked all at once; rewards are the win rates within each group."""
        c = self.cfg
        asked = []  # (group, first, second) per conversation, group-local sample indices
        conversations = []
        for g, members in enumerate(groups):
            for a, b in judging.ordered_comparisons(len(members), c.comparison_strategy, c.check_twice_swap):
                sa, sb = samples[members[a]], samples[members[b]]
                asked.append((g, a, b))
                conversations.append(self.asker.conversation(dict(sa, response_1=sa["response"],
                                                                  response_2=sb["response"])))
        judged = self.asker.ask(conversations, lambda r: judging.parse_verdict(r, c.score_regex))
        by_group: list[list] = [[] for _ in groups]
        for (g, a, b), j in zip(asked, judged):
            by_group[g].append((a, b, j))
        rewards, records = [0.0] * len(samples), [dict() for _ in samples]
        for members, mine in zip(groups, by_group):
            verdicts = [(a, b, j.value) for a, b, j in mine]
            agree, compared = judging.position_consistency(verdicts)
            self._pairs["pairs_agreeing"] += agree
            self._pairs["pairs_swapped"] += compared
            for k, (i, reward) in enumerate(zip(members, judging.win_rates(len(members), verdicts,
                                                                            c.default_score))):
                rewards[i] = reward
                records[i] = {"group_index": k, "group_size": len(members), "comparisons": [
                    {"first": a, "second": b, "replies": j.replies, "verdict": j.value}
                    for a, b, j in mine if k in (a, b)]}
        self._pairs["single_sample_groups"] += sum(len(m) == 1 for m in groups)
        return rewards, records

    # ------------------------------------------------------------------------------------------ the contract
    def step(self, message_logs: list[MessageLog], env_infos: list[dict[str, Any]]) -> EnvironmentReturn:
        """Rewards [B] from the judge (see the module docstring); all terminated; metadata: env_info plus the
        sample's judge record under "llm_judge"."""
        if self.asker.judge is None:
            raise RuntimeError("LlmJudgeEnvironment.step called after shutdown()")
        infos = [dict(info or {}) for info in env_infos]
        samples = [template_values(log_, info) for log_, info in zip(message_logs, infos, strict=True)]
        if self.cfg.mode == "pairwise":
            rewards, records = self._pairwise(samples, prompt_groups(message_logs))
        elif self.cfg.mode == "equivalence":
            rewards, records = self.asker.equivalence(samples)
        else:
            rewards, records = self._pointwise(samples)
        for info, record, reward in zip(infos, records, rewards):
            info[RECORD] = dict(record, reward=reward)
        n = len(message_logs)
        return EnvironmentReturn(observations=[{"role": "environment", "content": ""} for _ in range(n)],
                                 metadata=infos, next_stop_strings=[None] * n,
                                 rewards=torch.tensor(rewards, dtype=torch.float32),  # [B]
                                 terminateds=torch.ones(n, dtype=torch.bool), answers=[None] * n)

    def global_post_process_and_metrics(self, batch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """llm_judge_env/: mean_score, num_samples over the batch; judge_calls (attempt rounds), judge_requests,
        seconds_per_call, retries, parse_failures (judgments given default_score), request_failures (requests that
        failed, HTTP), truncated_prompts, and pairwise position_consistency and single_sample_groups, all counted
        since the previous metrics call (one step's judging: its rollouts, and a validation's if one ran)."""
        rewards = torch.as_tensor(batch["rewards"], dtype=torch.float32).reshape(-1)  # [N]
        pairs, self._pairs = self._pairs, _new_pair_stats()
        metrics = {"num_samples": float(rewards.numel()), **counter_metrics(self.asker.take_stats())}
        if rewards.numel():
            metrics["mean_score"] = float(rewards.mean())
        if self.cfg.mode == "pairwise":
            metrics["single_sample_groups"] = float(pairs["single_sample_groups"])
            if pairs["pairs_swapped"]:
                metrics["position_consistency"] = pairs["pairs_agreeing"] / pairs["pairs_swapped"]
        return batch, {f"{PREFIX}/{k}": v for k, v in metrics.items()}

    def shutdown(self) -> None:
        """Free the in-cluster judge's engine (or the HTTP client) if this environment started it; safe twice."""
        asker = getattr(self, "asker", None)
        if asker is not None:
            asker.shutdown()


def _new_pair_stats() -> dict[str, int]:
    """pairwise: pairs whose two orders agree, pairs judged in both orders, groups of one sample."""
    return dict.fromkeys(("pairs_agreeing", "pairs_swapped", "single_sample_groups"), 0)


def prompt_groups(message_logs: list[MessageLog]) -> list[list[int]]:
    """The samples' indices grouped by the conversation before the reply (identical: one group), groups in order
    of first appearance, members in batch order."""
    groups: dict[tuple, list[int]] = {}
    for i, log_ in enumerate(message_logs):
        key = tuple((m.get("role"), m.get("content")) for m in log_[:-1])
        groups.setdefault(key, []).append(i)
    return list(groups.values())
