"""Batches of the driver <-> worker data contract: pure functions over dicts of per-sample tensors.

A batch is a dict with the samples along dim 0: input_ids [B, T] long, right-padded; input_lengths [B] long
(the attention mask is derived from it); a training batch is a StepBatch's rows (nemo_grpo/batch.py: its fields
and shapes). Any other key (tensor or list with B entries) reaches the loss unchanged, sliced along dim 0.
Micro-batches are planned by the driver (Policy._micro_batch_plan), with the groupings below.
"""

from __future__ import annotations

from typing import Any

import torch


def batch_size_of(batch: dict[str, Any]) -> int:
    return int(batch["input_ids"].shape[0])


def _per_sample(batch: dict[str, Any], rows) -> dict[str, Any]:
    """rows(value) applied to every per-sample entry (tensors and lists with B entries); other values as-is."""
    n = batch_size_of(batch)
    out = {}
    for key, value in batch.items():
        per_sample = ((isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n)
                      or (isinstance(value, (list, tuple)) and len(value) == n))
        out[key] = rows(value) if per_sample else value
    return out


def slice_batch(batch: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows [start, stop) of every per-sample entry (tensors and lists with B entries); other values as-is."""
    return _per_sample(batch, lambda value: value[start:stop])


def take_rows(batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The rows `rows` (in that order) of every per-sample entry; other values as-is (cf. slice_batch)."""
    index = torch.tensor(rows, dtype=torch.long)

    def pick(value):
        if isinstance(value, torch.Tensor):
            return value.index_select(0, index.to(value.device))
        return [value[i] for i in rows]

    return _per_sample(batch, pick)


def fixed_size_groups(n: int, size: int) -> list[list[int]]:
    """Rows 0..n-1 in consecutive groups of `size` (the last may be shorter): the micro-batches without
    dynamic batching."""
    return [list(range(s, min(s + size, n))) for s in range(0, n, size)]


def token_budget_groups(lengths: list[int], budget: int, round_to: int) -> list[list[int]]:
    """Dynamic batching: row indices sorted by length (longest first) and cut into consecutive groups whose
    padded size, rows x (longest length rounded up to round_to), stays within `budget` tokens; a row longer
    than the budget is a group of its own. lengths [n] -> groups of indices covering 0..n-1 once."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        padded = -(-max(int(lengths[i]), 1) // round_to) * round_to
        if current and max(longest, padded) * (len(current) + 1) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, padded)
    return groups + ([current] if current else [])


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence packing: rows by length, longest first, each into the first bin with room for it, else a new
    bin; a row longer than `capacity` tokens is a bin of its own. lengths [n] -> bins of indices covering
    0..n-1 once (each bin becomes one packed row)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        need = max(int(lengths[i]), 1)
        k = next((j for j, r in enumerate(room) if r >= need), None)
        if k is None:
            bins.append([i])
            room.append(capacity - need)
        else:
            bins[k].append(i)
            room[k] -= need
    return bins


def concatenative(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sequence packing in row order: each row into the current bin while it fits, else a new bin (order kept)."""
    bins: list[list[int]] = []
    used = capacity
    for i, n in enumerate(lengths):
        need = max(int(n), 1)
        if bins and used + need <= capacity:
            bins[-1].append(i)
            used += need
        else:
            bins.append([i])
            used = need
    return bins


PACKING_ALGORITHMS = {"first_fit_decreasing": first_fit_decreasing, "concatenative": concatenative}


def equalize_group_counts(groups_per_rank: list[list[list[int]]]) -> list[list[list[int]]]:
    """Split the largest groups of the ranks that have fewer until every rank has as many: FSDP's collectives and
    the data-parallel gradient reduction need the same number of forwards on every rank. Each rank needs at
    least that many rows (the Policy gives every rank the same number of rows)."""
    target = max(len(groups) for groups in groups_per_rank)
    out = []
    for groups in groups_per_rank:
        groups = [list(g) for g in groups]
        while len(groups) < target:
            k = max(range(len(groups)), key=lambda j: len(groups[j]))
            if len(groups[k]) < 2:
                raise ValueError(f"cannot split {sum(map(len, groups))} rows into {target} micro-batches")
            g = groups.pop(k)
            groups[k:k] = [g[: len(g) // 2], g[len(g) // 2:]]
        out.append(groups)
    return out


def split_sizes(n: int, parts: int) -> list[int]:
    """n rows into `parts` contiguous shards as even as possible (the first n % parts get one more)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def attention_mask_from_lengths(input_lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B] lengths -> [B, seq_len] long mask, 1 on the first input_lengths[i] positions (right padding)."""
    return (torch.arange(seq_len, device=input_lengths.device)[None, :] < input_lengths[:, None]).long()


def next_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [B, S, V] (full vocabulary), targets [B, S] -> [B, S]: log_softmax(logits / temperature) at each
    position's target (the next token)."""
    scaled = logits.float() / temperature
    return scaled.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(scaled, dim=-1)


def token_logprobs_from_logits(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               temperature: float = 1.0) -> torch.Tensor:
    """logits [B, T, V] (full vocabulary), input_ids [B, T], attention_mask [B, T] -> logprobs [B, T].

    logprobs[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]]; column 0 and padding are 0.
    """
    lp = next_token_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)  # [B, T-1]
    lp = torch.where(attention_mask[:, 1:].bool(), lp, torch.zeros_like(lp))
    return torch.nn.functional.pad(lp, (1, 0))  # [B, T]
