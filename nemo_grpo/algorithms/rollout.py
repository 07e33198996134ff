"""Rollouts: generate, ask the environments, continue while they ask for more turns; collate to tensors.

Each sample keeps one flat token sequence (prompt, model turns, environment turns) with a mask that is 1
only on tokens the model generated, so environment text never enters the loss.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional

import ray
import torch

from nemo_grpo.data.prompts import Datum, render_prompt


@dataclass
class Sample:
    """One response being rolled out (a "sample"); lists grow turn by turn."""

    datum: Datum
    token_ids: list[int]
    token_mask: list[float]
    generation_logprobs: list[float]
    message_log: list[dict[str, str]]
    env_info: dict[str, Any]
    reward: float = 0.0  # summed over turns (and over components when the environment returns several)
    reward_components: dict[str, float] = field(default_factory=dict)  # name -> summed over turns
    done: bool = False
    truncated: bool = False  # the last turn stopped at its token limit, not at EOS / a stop string
    response_length: int = 0
    answer: Optional[str] = None
    stop_strings: Optional[list[str]] = None
    turns: int = 0
    text: str = field(default="")
    # from an engine that records them (GenerationOutput.routed_experts): [len(token_ids), L, k] int16, -1 where
    # the engine ran no forward (the last sampled token, the environment's tokens after it)
    routed_experts: Optional[torch.Tensor] = None


def prompt_text(s: Sample) -> str:
    """The prompt's last message (the problem as the model saw it, before the chat template)."""
    return s.datum.message_log[-1]["content"] if s.datum.message_log else ""


def response_text(s: Sample) -> str:
    """Every turn after the prompt: the model's replies, environment turns marked `[role] `."""
    turns = s.message_log[len(s.datum.message_log):]
    return "\n".join(m["content"] if m["role"] == "assistant" else f"[{m['role']}] {m['content']}" for m in turns)


def new_sample(datum: Datum) -> Sample:
    ids = list(datum.prompt_ids)
    return Sample(datum=datum, token_ids=ids, token_mask=[0.0] * len(ids), generation_logprobs=[0.0] * len(ids),
                  message_log=copy.deepcopy(datum.message_log), env_info=dict(datum.extra_env_info),
                  stop_strings=datum.stop_strings)


def _observation_ids(tokenizer, log_before: list[dict], observation: dict) -> list[int]:
    """Tokens that the chat template adds for `observation` (and the next generation prompt)."""
    before = render_prompt(tokenizer, log_before)
    after = render_prompt(tokenizer, log_before + [observation])
    if after[: len(before)] == before:
        return after[len(before):]
    return render_prompt(tokenizer, [observation])


def _generate_turn(samples: list[Sample], engine, tokenizer, max_new_tokens: int, max_seq_len: int,
                   seed: int, greedy: bool) -> list[Sample]:
    """One generation call for every unfinished sample; returns the samples that generated."""
    active = [s for s in samples if not s.done]
    budget = min(max_new_tokens, max_seq_len - max(len(s.token_ids) for s in active))
    if budget <= 0:
        for s in active:
            s.done, s.truncated = True, True
        return []
    outputs = engine.generate([s.token_ids for s in active], greedy=greedy, seed=seed,
                              stop_strings=[s.stop_strings for s in active], max_new_tokens=budget)
    for s, out in zip(active, outputs):
        s.token_ids += out.token_ids
        s.token_mask += [1.0] * len(out.token_ids)
        s.generation_logprobs += out.logprobs
        s.routed_experts = out.routed_experts  # the call's whole context: every earlier turn's tokens too
        s.response_length += len(out.token_ids)
        s.truncated = out.finish_reason == "length"
        s.text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        s.message_log.append({"role": "assistant", "content": s.text})
    return active


def _step_environments(active: list[Sample], task_to_env: dict, tokenizer, last_turn: bool) -> None:
    """Send each sample to its task's environment (all environments in parallel) and apply the results."""
    by_task = defaultdict(list)
    for s in active:
        by_task[s.datum.task_name].append(s)
    futures = {task: task_to_env[task].step.remote([s.message_log for s in group], [s.env_info for s in group])
               for task, group in by_task.items()}
    for task, ret in zip(futures, ray.get(list(futures.values()))):
        for i, s in enumerate(by_task[task]):
            _add_reward(s, ret.rewards, i)
            s.answer = ret.answers[i]
            s.turns += 1
            if ret.metadata[i] is not None:
                s.env_info = ret.metadata[i]
            if bool(ret.terminateds[i]) or last_turn:
                s.done = True
                continue
            obs = ret.observations[i]
            obs_ids = _observation_ids(tokenizer, s.message_log, obs)
            s.message_log.append(obs)
            s.token_ids += obs_ids
            s.token_mask += [0.0] * len(obs_ids)
            s.generation_logprobs += [0.0] * len(obs_ids)
            if s.routed_experts is not None:
                r = s.routed_experts
                s.routed_experts = torch.cat([r, r.new_full((len(obs_ids), *r.shape[1:]), -1)])
            if ret.next_stop_strings[i] is not None:
                s.stop_strings = ret.next_stop_strings[i]


def _add_reward(s: Sample, rewards, i: int) -> None:
    """Add sample i's reward of one turn: rewards is a [B] tensor, or a dict name -> [B] tensor of reward
    components (GDPO's input; the sample's reward is then their sum)."""
    if isinstance(rewards, dict):
        for name, values in rewards.items():
            value = float(values[i])
            s.reward_components[name] = s.reward_components.get(name, 0.0) + value
            s.reward += value
    else:
        s.reward += float(rewards[i])


def run_rollouts(datums: list[Datum], engine, tokenizer, task_to_env: dict, *, max_new_tokens: int,
                 max_turns: int, max_seq_len: int, seed: int, greedy: bool = False, timer=None) -> list[Sample]:
    """Roll out one sample per datum for up to max_turns turns within max_seq_len tokens."""
    samples = [new_sample(d) for d in datums]
    for turn in range(max_turns):
        if all(s.done for s in samples):
            break
        with _section(timer, "generation"):
            active = _generate_turn(samples, engine, tokenizer, max_new_tokens, max_seq_len,
                                    seed * 1000 + turn, greedy)
        if active:
            with _section(timer, "environment"):
                _step_environments(active, task_to_env, tokenizer, last_turn=turn == max_turns - 1)
    return samples


class _section:
    def __init__(self, timer, name):
        self.ctx = timer.time(name) if timer is not None else None

    def __enter__(self):
        return self.ctx.__enter__() if self.ctx else None

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc) if self.ctx else False


def collate(samples: list[Sample], pad_id: int) -> dict[str, Any]:
    """Samples -> the training batch dict (right-padded tensors; see backends' data contract).

    input_ids [N, T], input_lengths [N], token_mask [N, T], generation_logprobs [N, T], truncated [N] bool,
    response_lengths [N]; routed_experts [N, T, L, k] int16 (-1 where none) when every sample has the engine's
    routes. (Rewards stay on the samples, raw; the trainer's Rollouts hold them scaled and shaped.)
    """
    n, t = len(samples), max(len(s.token_ids) for s in samples)
    batch = {
        "input_ids": torch.full((n, t), pad_id, dtype=torch.long),
        "token_mask": torch.zeros((n, t)),
        "generation_logprobs": torch.zeros((n, t)),
    }
    for i, s in enumerate(samples):
        k = len(s.token_ids)
        batch["input_ids"][i, :k] = torch.tensor(s.token_ids)
        batch["token_mask"][i, :k] = torch.tensor(s.token_mask)
        batch["generation_logprobs"][i, :k] = torch.tensor(s.generation_logprobs)
    batch["input_lengths"] = torch.tensor([len(s.token_ids) for s in samples])
    batch["truncated"] = torch.tensor([s.truncated for s in samples])
    batch["response_lengths"] = torch.tensor([s.response_length for s in samples])
    if all(s.routed_experts is not None for s in samples):
        shape = samples[0].routed_experts.shape[1:]
        batch["routed_experts"] = torch.full((n, t, *shape), -1, dtype=torch.int16)
        for i, s in enumerate(samples):
            batch["routed_experts"][i, :len(s.token_ids)] = s.routed_experts
    return batch
