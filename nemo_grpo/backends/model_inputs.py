"""One micro-batch as the model sees it, padded or packed, and the way back to per-sequence results.

Padded: the b sequences are b rows, right-padded to the longest one (rounded up to `multiple`); causal attention
keeps the padding out of the real positions.
Packed (policy.sequence_packing): the b sequences lie back to back in one row, each with its own position ids
(0, 1, ... from its start) and its segment boundaries `cu_seqlens`, so no token sees another sequence; the row
is padded to a multiple of `multiple` with a segment of its own (never an all-masked query row, which would make
attention NaN). Attention runs per segment (backends/varlen.py), or, with `dense_mask`, through a block-diagonal
causal mask [1, 1, t, t] (s² attention: Megatron's unfused attention, and the reference path).

Both give per-position outputs [r, t] (r = b rows, or 1), and `to_rows` maps them back to the data contract's
[b, T]: each sequence's positions at columns 0..len-1, column 0 and the padding 0.

Context parallelism (`split_context`): the model sees this CP rank's share of the positions (ids, RoPE positions,
next-token targets; backends/context_parallel.py), and its per-position outputs are gathered back to [r, t]
(`logprobs_from_next`, `last_tokens`) before anything else reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
import torch.nn.functional as F

from nemo_grpo.backends.batching import attention_mask_from_lengths
from nemo_grpo.backends.context_parallel import ContextGroup, ContextShard


@dataclass
class ModelInputs:
    """input_ids [r, t]; attention_mask: padded [r, t] long (1 on real tokens), packed [1, 1, t, t] bool (True
    where a query may attend a key) or None (varlen); position_ids [r, t] (None: 0..t-1 on every row);
    token_mask [r, t] (1 on the sequences' tokens); seq_row, seq_start, seq_len [b]: where each sequence lies;
    cu_seqlens [n + 1] (packed only): the row's segment boundaries 0 .. t, the padding tail a segment.
    Under context parallelism (`context` set): input_ids, position_ids and targets [r, 2c] are this rank's
    positions, attention_mask is None; every other field describes the whole row."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: Optional[torch.Tensor]
    token_mask: torch.Tensor
    seq_row: torch.Tensor
    seq_start: torch.Tensor
    seq_len: torch.Tensor
    cu_seqlens: Optional[torch.Tensor] = None
    context: Optional[ContextShard] = None
    targets: Optional[torch.Tensor] = None  # set with context: the next token at each of its positions

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def varlen(self) -> bool:
        """A packed row whose attention runs per segment (no dense mask)."""
        return self.packed and self.attention_mask is None

    @property
    def width(self) -> int:
        """Positions of the row (all CP ranks' together)."""
        return self.context.width if self.context is not None else int(self.input_ids.shape[1])

    @property
    def next_tokens(self) -> torch.Tensor:
        """[r, s] the token after each position the model sees (0 after the last): what its logits predict."""
        return self.targets if self.targets is not None else F.pad(self.input_ids[:, 1:], (0, 1))

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position outputs of the positions the model saw [r, s, ...] -> the whole row's [r, t, ...]
        (gathered over the CP group; every CP rank must then compute the same thing from them)."""
        return values if self.context is None else self.context.gather(values, 1)

    def logprobs_from_next(self, next_logprobs: torch.Tensor) -> torch.Tensor:
        """[r, s] log p(next_tokens | prefix) at each position the model saw -> [r, t] log-probs of each position's
        own token (position p: log p(token p | tokens < p)), 0 in column 0 and where token_mask is 0."""
        lp = F.pad(self.gather(next_logprobs)[:, :-1], (1, 0))
        return torch.where(self.token_mask.bool(), lp, torch.zeros_like(lp))

    def to_rows(self, values: torch.Tensor, full_t: int, column_0: bool = False, fill=0) -> torch.Tensor:
        """Per-position values [r, t, ...] -> [b, full_t, ...]: sequence i's positions at columns 0..len_i-1;
        column 0 (no predecessor: a log-prob there would read the previous sequence; kept with column_0, e.g.
        the routes of each position) and the rest `fill`. Differentiable."""
        cols = torch.arange(full_t, device=values.device)
        index = (self.seq_start[:, None] + cols[None, :]).clamp(max=values.shape[1] - 1)  # [b, full_t]
        out = values[self.seq_row[:, None], index]
        keep = (cols[None, :] < self.seq_len[:, None]) & ((cols[None, :] > 0) | column_0)
        keep = keep.reshape(*keep.shape, *[1] * (out.dim() - 2))
        return torch.where(keep, out, torch.full_like(out, fill))

    def from_rows(self, values: torch.Tensor, fill) -> torch.Tensor:
        """Per-token data of the sequences [b, T, ...] (e.g. recorded routes) -> at the positions the model sees
        [r, t, ...] (the whole row under context parallelism): each sequence's first seq_len tokens where they
        lie, `fill` on padding. The inverse of to_rows with column_0."""
        b, full_t = values.shape[:2]
        out = values.new_full((self.token_mask.shape[0], self.width, *values.shape[2:]), fill)
        cols = torch.arange(full_t, device=values.device)
        real = cols[None, :] < self.seq_len[:, None]  # [b, T]
        out[self.seq_row[:, None].expand(b, full_t)[real], (self.seq_start[:, None] + cols[None, :])[real]] = \
            values[real]
        return out

    def last_tokens(self, values: torch.Tensor) -> torch.Tensor:
        """values [r, s, ...] of the positions the model saw -> [b, ...] at each sequence's last token (e.g. a
        scalar head's score)."""
        return self.gather(values)[self.seq_row, self.seq_start + self.seq_len - 1]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def natural_width(mb: dict[str, Any], packed: bool, multiple: int = 1) -> int:
    """Columns the micro-batch needs: its longest sequence (padded) or all its tokens (packed), rounded up."""
    lengths = mb["input_lengths"].clamp(min=1)
    return _round_up(int(lengths.sum() if packed else lengths.max()), multiple)


def model_inputs(mb: dict[str, Any], packed: bool, multiple: int = 1, width: Optional[int] = None,
                 dense_mask: bool = False) -> ModelInputs:
    """A micro-batch (input_ids [b, T], input_lengths [b]) -> ModelInputs of `width` columns (default: its
    natural width); `width` may exceed T, never cut a sequence. dense_mask: a packed row carries its
    block-diagonal mask (else attention goes per segment)."""
    width = width or natural_width(mb, packed, multiple)
    lengths = mb["input_lengths"].clamp(min=1)
    if packed:
        return _packed(mb["input_ids"], lengths, width, dense_mask)
    return _padded(mb["input_ids"], lengths, width)


def _padded(input_ids: torch.Tensor, lengths: torch.Tensor, width: int) -> ModelInputs:
    b, t = input_ids.shape
    ids = input_ids[:, :width] if t >= width else torch.nn.functional.pad(input_ids, (0, width - t))
    mask = attention_mask_from_lengths(lengths, width)
    return ModelInputs(ids, mask, None, mask, torch.arange(b, device=ids.device),
                       torch.zeros_like(lengths), lengths)


def _packed(input_ids: torch.Tensor, lengths: torch.Tensor, width: int, dense_mask: bool) -> ModelInputs:
    b, t = input_ids.shape
    device, total = input_ids.device, int(lengths.sum())
    if total > width:
        raise ValueError(f"packing {total} tokens into a row of {width}")
    real = torch.arange(t, device=device)[None, :] < lengths[:, None]  # [b, t]
    tail = width - total
    ids = torch.cat([input_ids[real], input_ids.new_zeros(tail)])  # [width]
    starts = torch.cumsum(lengths, 0) - lengths  # [b]
    segment = torch.cat([torch.repeat_interleave(torch.arange(b, device=device), lengths),
                         torch.full((tail,), b, device=device)])  # [width]; b = the padding tail
    seg_start = torch.cat([starts, torch.tensor([total], device=device)])
    positions = torch.arange(width, device=device) - seg_start[segment]  # restarts at 0 per sequence
    cu_seqlens = torch.cat([seg_start, torch.tensor([width], device=device)]) if tail else seg_start  # [n + 1]
    attend = None
    if dense_mask:
        col = torch.arange(width, device=device)
        attend = ((segment[:, None] == segment[None, :]) & (col[None, :] <= col[:, None]))[None, None]  # [q, k]
    token_mask = (segment < b).long()
    return ModelInputs(ids[None], attend, positions[None], token_mask[None], torch.zeros_like(lengths), starts,
                       lengths, cu_seqlens)


def split_context(inputs: ModelInputs, group: ContextGroup) -> ModelInputs:
    """Whole-row model inputs -> this CP rank's share (as is for a group of one). The row's width must be a
    multiple of 2 x group.size (the worker's width multiple)."""
    if group.size == 1:
        return inputs
    starts = tuple(inputs.cu_seqlens[:-1].tolist()) if inputs.packed else None
    shard = ContextShard(group, inputs.width, starts)
    r, t = inputs.input_ids.shape
    positions = inputs.position_ids
    if positions is None:
        positions = torch.arange(t, device=inputs.input_ids.device)[None].expand(r, t)
    return replace(inputs, input_ids=shard.take(inputs.input_ids), attention_mask=None,
                   position_ids=shard.take(positions), targets=shard.take(F.pad(inputs.input_ids[:, 1:], (0, 1))),
                   context=shard)
