"""Causal attention over a packed row at varlen cost: only the diagonal blocks of its sequences.

A packed row (backends/model_inputs.py) holds sequences back to back, their boundaries in `cu_seqlens` [n + 1]
(0, len_0, len_0 + len_1, ..., s; the padding tail is a segment of its own). Through a dense block-diagonal mask
attention costs s² per row; here it costs sum(len²), by the first kernel that applies:
- flash-attention's `flash_attn_varlen_func` where it is installed and the tensors are fp16 / bf16 on a GPU;
- else PyTorch's own varlen flash kernel, `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, CUDA only),
  for fp16 / bf16 on a GPU without dropout; both are one kernel over the row;
- elsewhere one causal SDPA call per segment (CPU: its fused kernel). Nested (jagged) tensors were measured and
  rejected: on torch 2.13 their SDPA refuses is_causal=True on every backend.

Both back ends call `packed_attention` (DTensor through a Hugging Face attention function, dtensor/attention.py;
Megatron through mcore/attention.py `SDPAttention`). `CALLS` counts the calls per kernel in this process
("flash_varlen", "torch_varlen", "sdpa_segments"), so a test can check which path ran.
"""

from __future__ import annotations

import inspect
from collections import Counter
from functools import cache

import torch
import torch.nn.functional as F

try:  # GPU clusters; absent on the CPU stack
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the installation
    flash_attn_varlen_func = None
try:  # torch >= 2.10; its kernel runs on CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch version
    varlen_attn = None

CALLS: Counter = Counter()  # kernel name -> calls in this process
HALF = (torch.float16, torch.bfloat16)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     dropout: float = 0.0) -> torch.Tensor:
    """Causal attention within each segment of one packed row. q [1, heads, s, d], k and v [1, groups, s, d]
    (heads a multiple of groups: GQA), cu_seqlens [n + 1] (ends at s) -> [1, heads, s, d]."""
    if q.shape[0] != 1:
        raise ValueError(f"packed attention takes one row, got {q.shape[0]}")
    if int(cu_seqlens[-1]) != q.shape[2]:
        raise ValueError(f"segments cover {int(cu_seqlens[-1])} of the row's {q.shape[2]} positions")
    if q.is_cuda and q.dtype in HALF:
        if flash_attn_varlen_func is not None:
            return _one_kernel(q, k, v, cu_seqlens, scale, dropout, "flash_varlen")
        if varlen_attn is not None and dropout == 0.0:
            return _one_kernel(q, k, v, cu_seqlens, scale, dropout, "torch_varlen")
    return sdpa_per_segment(q, k, v, cu_seqlens, scale, dropout)


def sdpa_per_segment(q, k, v, cu_seqlens, scale, dropout=0.0):
    """One causal SDPA call per segment; shapes as packed_attention."""
    CALLS["sdpa_segments"] += 1
    bounds = cu_seqlens.tolist()
    gqa = q.shape[1] != k.shape[1]
    out = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=dropout,
                                          is_causal=True, scale=scale, enable_gqa=gqa)
           for a, b in zip(bounds[:-1], bounds[1:]) if b > a]  # each [1, heads, len, d]
    return torch.cat(out, dim=2)


def _one_kernel(q, k, v, cu_seqlens, scale, dropout, kernel):  # pragma: no cover - needs a GPU
    """A varlen kernel over the row as [total, heads or groups, d]; -> [1, heads, s, d]."""
    CALLS[kernel] += 1
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    q_, k_, v_ = (x[0].transpose(0, 1) for x in (q, k, v))  # [s, heads or groups, d]
    if kernel == "flash_varlen":  # its own GQA
        out = flash_attn_varlen_func(q_, k_, v_, cu, cu, longest, longest, dropout_p=dropout, softmax_scale=scale,
                                     causal=True)
    else:
        out = varlen_attn(q_, k_, v_, cu, cu, longest, longest, **_torch_varlen_options(q_, k_, scale))
    return out.transpose(0, 1)[None]  # [s, heads, d] -> [1, heads, s, d]


@cache
def _torch_varlen_parameters() -> frozenset:
    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen_options(q: torch.Tensor, k: torch.Tensor, scale: float) -> dict:
    """Causality, scale and GQA in the words of the installed torch: `window_size=(-1, 0)` from 2.11, `is_causal`
    in 2.10; `scale` and `enable_gqa` where they exist (without `enable_gqa` the flash kernel still takes fewer K/V
    heads than query heads)."""
    params = _torch_varlen_parameters()
    options = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params and q.shape[1] != k.shape[1]:
        options["enable_gqa"] = True
    if "scale" in params:
        options["scale"] = scale
    elif abs(scale * q.shape[-1] ** 0.5 - 1.0) > 1e-6:
        raise ValueError(f"this torch's varlen_attn has no `scale` (needs 1/sqrt(head_dim)), got {scale}")
    return options
