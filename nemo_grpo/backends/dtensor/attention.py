"""Packed rows at varlen cost, and context parallelism, on the DTensor back end: a Hugging Face attention function
(transformers' AttentionInterface) that runs backends/varlen.py per segment, or a CP shard's attention
(backends/context_parallel.py: this rank's queries over the whole row's gathered keys, `context_shard`).

The model is built with `attn_implementation=VARLEN` when sequence packing or context parallelism is on.
transformers builds no mask for an implementation it has no mask function for, and passes the forward's keyword
arguments through to the attention function: the worker hands the packed row's boundaries in as `cu_seq_lens_q` (the
keyword of HF's own flash-attention varlen path). A packed row given its 4D block-diagonal mask instead
(policy.sequence_packing.attention=mask) goes to HF's SDPA attention with it.
"""

from __future__ import annotations

from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from nemo_grpo.backends.varlen import packed_attention

VARLEN = "nemo_grpo_varlen"


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                             scaling: Optional[float] = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF's attention signature: query [r, heads, s, d], key and value [r, kv_heads, s, d] (this TP rank's heads),
    context_shard (context parallelism: s is this CP rank's positions), or one packed row with cu_seq_lens_q
    [n + 1] (or a dense attention_mask [1, 1, s, s]) -> ([r, s, heads, d], None)."""
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{VARLEN} attention does not implement sliding-window attention")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    context = kwargs.get("context_shard")
    if context is not None:
        return context.attend(query, key, value, scale, dropout).transpose(1, 2).contiguous(), None
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None and attention_mask is not None and attention_mask.dim() == 4:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if cu_seqlens is None or attention_mask is not None:
        raise ValueError(f"{VARLEN} attention runs packed rows only: cu_seq_lens_q, or a 4D mask and no segments")
    out = packed_attention(query, key, value, cu_seqlens, scale, dropout)  # [1, heads, s, d]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(VARLEN, varlen_attention_forward)


def varlen_kwargs(cu_seqlens: torch.Tensor) -> dict:
    """The forward's keyword arguments that carry a packed row's boundaries [n + 1] to the attention function."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": longest,
            "max_length_k": longest}
