"""Context parallelism (CP): a row's positions split over the `cp` ranks of a group, for both back ends.

Sharding, load-balanced: a row of width t (a multiple of 2·cp) is cut into 2·cp chunks of c = t / (2·cp);
CP rank r holds chunks r and 2·cp-1-r, so under causal attention every rank has the same work (its early chunk
sees few keys, its late chunk many). Every per-position input (token ids, RoPE positions, next-token targets) is
taken in that order; the model runs on the rank's 2c positions; per-position outputs are gathered back to the
row's [r, t] before any loss, so the loss code never sees CP.

Attention exchange: K and V are all-gathered over the group (Llama 3's choice, not a ring of point-to-point
sends): one collective per layer, the same code for GQA, packed rows and any layout, and on this CPU stack (gloo)
a ring would serialize 2·(cp-1) sends per layer where one all-gather overlaps them. Each local chunk then
attends to the keys up to its own end, causally (within each sequence of a packed row: one SDPA call per piece of
the chunk in one sequence), through a bottom-right-aligned causal mask that is a strided view of one line, so no
[chunk, keys] mask is ever made (a dense one cost more memory at 16k tokens than CP saved). The cost is the full
row's K and V on every rank for one layer at a time (kept for backward), [t, kv_heads, head_dim] each; queries,
MLP activations and logits cover t / cp positions.

Not torch's `context_parallel` (torch.distributed.tensor.experimental) for the DTensor back end: it swaps in ring
attention for the CUDA SDPA kernels only (flash, efficient, cuDNN), so on a CPU its ranks would silently attend
within their own chunks, and it takes no mask, so no packed rows. One implementation serves both back ends.

Weights: CP ranks hold the same weights, like data-parallel ranks; each computes the gradient of its own
positions' share, so gradients are summed over dp x cp (both back ends fold cp into their data-parallel
reduction: FSDP's mesh, Megatron's data-parallel group).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_grpo.layout import ParallelLayout

CALLS: Counter = Counter()  # "attend" -> calls, and "chunks r,s" -> the chunk pair this process attended with


@dataclass(frozen=True)
class ContextGroup:
    """This rank's context-parallel group: its size, this rank's index in it, the process group (None at size 1)."""
    size: int = 1
    rank: int = 0
    group: Any = None


def context_group(layout: ParallelLayout, rank: int) -> ContextGroup:
    """Collective over the world (dist.new_group must be called by every rank for every group): the CP group of
    `rank` = the ranks that differ from it only along cp (layout.py's order: tp fastest, then cp, dp, pp)."""
    if layout.cp == 1:
        return ContextGroup()
    mine = None
    for outer in range(layout.world // (layout.tp * layout.cp)):  # (dp, pp) pairs
        for tp in range(layout.tp):
            ranks = [tp + layout.tp * (cp + layout.cp * outer) for cp in range(layout.cp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = ContextGroup(layout.cp, ranks.index(rank), group)
    return mine


@dataclass
class ContextShard:
    """One CP rank's share of a micro-batch's rows of `width` positions. starts: a packed row's sequence starts
    (0 first, ascending; attention stays within a sequence); None: each row is one causal sequence."""
    group: ContextGroup
    width: int
    starts: Optional[tuple[int, ...]] = None

    def __post_init__(self):
        if self.width % (2 * self.group.size):
            raise ValueError(f"context parallelism over {self.group.size} ranks needs rows of a multiple of "
                             f"{2 * self.group.size} positions, got {self.width}")

    @property
    def chunk(self) -> int:
        return self.width // (2 * self.group.size)

    def spans(self, rank: Optional[int] = None) -> list[tuple[int, int]]:
        """The two [start, stop) position ranges CP rank `rank` (default: this one) holds, in local order."""
        r, n, c = self.group.rank if rank is None else rank, self.group.size, self.chunk
        return [(r * c, (r + 1) * c), ((2 * n - 1 - r) * c, (2 * n - r) * c)]

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """A full-row tensor (width along `dim`) -> this rank's positions along `dim` (2c)."""
        return torch.cat([x.narrow(dim, a, b - a) for a, b in self.spans()], dim)

    def _assemble(self, parts: list[torch.Tensor], dim: int) -> torch.Tensor:
        """Every rank's local tensor (rank order) -> the full row in position order along `dim`."""
        n, c = self.group.size, self.chunk
        chunks = [None] * (2 * n)
        for r, part in enumerate(parts):
            chunks[r], chunks[2 * n - 1 - r] = part.narrow(dim, 0, c), part.narrow(dim, c, c)
        return torch.cat(chunks, dim)

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's per-position outputs (2c along `dim`) -> the full row's (width along `dim`). Every CP rank
        must compute the same function of the result (the loss on the gathered log-probs): the backward keeps
        this rank's share of the gradient, with no communication."""
        return _GatherRow.apply(x, self, dim, False)

    def gather_kv(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Like gather, for tensors each rank uses differently (K and V): the backward sums every rank's gradient
        of the full row before keeping this rank's share."""
        return _GatherRow.apply(x, self, dim, True)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               dropout: float = 0.0) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole row. q [b, heads, 2c, d], k and v
        [b, groups, 2c, d] (heads a multiple of groups) -> [b, heads, 2c, d]. One SDPA call per piece of a
        local chunk within one sequence: its queries over that sequence's keys up to the piece's end."""
        CALLS["attend"] += 1
        CALLS["chunks " + ",".join(str(a // self.chunk) for a, _ in self.spans())] += 1
        kv = self.gather_kv(torch.stack([k, v]), dim=3)  # [2, b, groups, width, d]
        gqa, out, local = q.shape[1] != k.shape[1], [], 0
        for start, stop, first in self._pieces():
            n = stop - start
            out.append(_attend_lower_right(q[:, :, local:local + n], kv[0, :, :, first:stop],
                                           kv[1, :, :, first:stop], scale, dropout, gqa))
            local += n
        return torch.cat(out, dim=2)

    def _pieces(self) -> list[tuple[int, int, int]]:
        """(start, stop, first key) per piece of this rank's chunks, in local order: a chunk cut at its row's
        sequence starts (a packed row's sequences), first key = the start of the piece's sequence."""
        starts = self.starts or (0,)
        pieces = []
        for a, b in self.spans():
            cuts = [x for x in starts if a < x < b]
            for lo, hi in zip([a] + cuts, cuts + [b]):
                pieces.append((lo, hi, max(x for x in starts if x <= lo)))
        return pieces


def _attend_lower_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout: float,
                        gqa: bool) -> torch.Tensor:
    """q [b, heads, n, d] = the last n of the positions k, v [b, groups, m, d] cover (m >= n): query i attends
    keys 0 .. m - n + i (causal, aligned at the bottom right). SDPA's is_causal aligns at the top left, so the
    queries go in reversed, where the mask is a Toeplitz band: allowed(i', j) = j + i' <= m - 1, a strided view
    of one line of m + n - 1 values (no [n, m] tensor is made, or kept for the backward)."""
    n, m = q.shape[2], k.shape[2]
    line = torch.full((n + m - 1,), float("-inf"), dtype=q.dtype, device=q.device)
    line[:m] = 0.0
    mask = line.as_strided((n, m), (1, 1))
    out = F.scaled_dot_product_attention(q.flip(2), k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                         enable_gqa=gqa)
    return out.flip(2)


class _GatherRow(torch.autograd.Function):
    """all-gather of every CP rank's 2c positions into the row's order; backward: this rank's share of the
    gradient, summed over the group first when `sum_grads` (each rank's use of the row differs)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: ContextShard, dim: int, sum_grads: bool) -> torch.Tensor:
        ctx.shard, ctx.dim, ctx.sum_grads = shard, dim, sum_grads
        with torch.profiler.record_function("context_parallel.gather"):  # (bench/long_context.py reads the name)
            parts = [torch.empty_like(x) for _ in range(shard.group.size)]
            dist.all_gather(parts, x.contiguous(), group=shard.group.group)
            return shard._assemble(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sum_grads:
            with torch.profiler.record_function("context_parallel.gather_backward"):
                grad = grad.contiguous().clone()
                dist.all_reduce(grad, group=ctx.shard.group.group)
        return ctx.shard.take(grad, ctx.dim), None, None, None
