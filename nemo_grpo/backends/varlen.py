"""Causal attention over a packed row at varlen cost: only the diagonal blocks of its sequences.

A packed row (backends/model_inputs.py) holds sequences back to back, their boundaries in `cu_seqlens` [n + 1]
(0, len_0, len_0 + len_1, ..., s; the padding tail is a segment of its own). Through a dense block-diagonal mask
attention costs s² per row; here it costs sum(len²):
- flash-attention's `flash_attn_varlen_func` where it is installed and the tensors are fp16 / bf16 on a GPU
  (one kernel over the row);
- elsewhere one causal SDPA call per segment (CPU: its fused kernel). Nested (jagged) tensors were measured and
  rejected: on torch 2.13 their SDPA refuses is_causal=True on every backend.

Both back ends call `packed_attention` (DTensor through a Hugging Face attention function, dtensor/attention.py;
Megatron through mcore/attention.py `SDPAttention`). `CALLS` counts the calls per kernel in this process, so a
test can check which path ran.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

try:  # GPU clusters; absent on the CPU stack
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the installation
    flash_attn_varlen_func = None

CALLS: Counter = Counter()  # kernel name -> calls in this process


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each segment of one packed row. q [1, heads, s, d], k and v [1, groups, s, d]
    (heads a multiple of groups: GQA), cu_seqlens [n + 1] (ends at s) -> [1, heads, s, d]."""
    if q.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, got {q.shape[0]}")
    if int(cu_seqlens[-1]) != q.shape[2]:
        raise ValueError(f"segments cover {int(cu_seqlens[-1])} of the row's {q.shape[2]} positions")
    if flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _flash_varlen(q, k, v, cu_seqlens, scale, dropout)
    CALLS["sdpa_segments"] += 1
    bounds = cu_seqlens.tolist()
    gqa = q.shape[1] != k.shape[1]
    out = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=dropout,
                                          is_causal=True, scale=scale, enable_gqa=gqa)
           for a, b in zip(bounds[:-1], bounds[1:]) if b > a]  # each [1, heads, len, d]
    return torch.cat(out, dim=2)


def _flash_varlen(q, k, v, cu_seqlens, scale, dropout):  # pragma: no cover - needs flash-attn and a GPU
    """flash-attention's varlen kernel on [total, heads, d] (its own GQA); -> [1, heads, s, d]."""
    CALLS["flash_varlen"] += 1
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q_, k_, v_ = (x[0].transpose(0, 1) for x in (q, k, v))  # [s, heads or groups, d]
    out = flash_attn_varlen_func(q_, k_, v_, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scale,
                                 causal=True)  # [s, heads, d]
    return out.transpose(0, 1)[None]
