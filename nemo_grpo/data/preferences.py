"""Preference pairs for reward models: reading, rendering with the reward model's chat template, batching.

A JSONL row is {"chosen": ..., "rejected": ...} with each side a list of chat messages
([{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]) or a plain response string
combined with a "prompt" string (the reward-bench layout: "prompt", "chosen", "rejected", "subset").
"""

from __future__ import annotations

import random
from typing import Any

import torch

from nemo_grpo.data.datasets import DataError, addition_problems, jsonl_rows

Messages = list[dict[str, str]]


def _as_messages(side: Any, prompt: Any, where: str) -> Messages:
    if isinstance(side, list) and all(isinstance(m, dict) and "content" in m for m in side):
        return [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in side]
    if isinstance(side, str):
        head = [{"role": "user", "content": str(prompt)}] if prompt is not None else []
        return head + [{"role": "assistant", "content": side}]
    raise DataError(f"{where}: 'chosen'/'rejected' must be a response string or a list of chat messages")


BUILTIN_PREFIX = "builtin:"


def addition_preferences(seed: int, wrong_per_problem: int = 4) -> list[dict[str, Any]]:
    """The default task as preferences: "a+b=" answered with the sum (chosen) vs another number (rejected)."""
    rng = random.Random(seed)
    pairs = []
    for p in addition_problems():
        for wrong in rng.sample([n for n in range(19) if str(n) != p["answer"]], wrong_per_problem):
            user = {"role": "user", "content": p["problem"]}
            pairs.append({"chosen": [user, {"role": "assistant", "content": p["answer"]}],
                          "rejected": [user, {"role": "assistant", "content": str(wrong)}], "subset": "addition"})
    return pairs


def read_preference_pairs(path: str, seed: int = 0, key: str = "data_path") -> list[dict[str, Any]]:
    """JSONL -> [{"chosen": Messages, "rejected": Messages, "subset": str}] (subset "all" when absent);
    "builtin:addition" generates the default task's pairs (seeded). `key` is the config key errors name."""
    if path == BUILTIN_PREFIX + "addition":
        return addition_preferences(seed)
    pairs = []
    for where, row in jsonl_rows(path, key):
        missing = [k for k in ("chosen", "rejected") if k not in row]
        if missing:
            raise DataError(f"{where}: missing key(s) {missing}; keys present: {sorted(row)}")
        pairs.append({"chosen": _as_messages(row["chosen"], row.get("prompt"), where),
                      "rejected": _as_messages(row["rejected"], row.get("prompt"), where),
                      "subset": str(row.get("subset", "all"))})
    return pairs


def render_conversation(tokenizer, messages: Messages, max_len: int) -> tuple[list[int], bool]:
    """Token ids of a whole conversation under the tokenizer's chat template (plain concatenation without
    one), keeping the last max_len tokens (the score is read at the end); (ids, truncated)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    else:
        text = "".join(m["content"] for m in messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] or [tokenizer.pad_token_id or 0]
    return (ids[-max_len:], True) if len(ids) > max_len else (ids, False)


def pad_id_of(tokenizer) -> int:
    """The tokenizer's pad id (0 when it has none): what right_padded fills with."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def right_padded(sequences: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Token lists -> {"input_ids" [B, T] right-padded, "input_lengths" [B]}."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    return {"input_ids": ids, "input_lengths": torch.tensor([len(s) for s in sequences], dtype=torch.long)}


def pair_batch(tokenized: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """[(chosen ids, rejected ids)] -> a training batch with rows (chosen_0, rejected_0, chosen_1, ...):
    input_ids [2P, T], input_lengths, token_mask [2P, T] (the real tokens), sample_mask [2P] (ones)."""
    batch = right_padded([ids for pair in tokenized for ids in pair], pad_id)
    t = batch["input_ids"].shape[1]
    batch["token_mask"] = (torch.arange(t)[None, :] < batch["input_lengths"][:, None]).float()
    batch["sample_mask"] = torch.ones(len(batch["input_lengths"]))
    return batch
