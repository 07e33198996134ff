"""Core attention for Megatron's local layer spec through `torch.nn.functional.scaled_dot_product_attention`.

Megatron-Core's local `DotProductAttention` materialises the [b, heads, s, s] scores (baddbmm, masked softmax,
bmm); SDPA picks a fused kernel instead: flash or memory-efficient on GPUs, a fused CPU kernel here. It is the
default core attention where Transformer Engine is absent (`policy.megatron_cfg.attention_backend`).

Under context parallelism (backends/context_parallel.py) the worker passes `ContextParams`: the rank's queries
attend over the K and V of the whole row, gathered over the CP group. A packed row attends per segment
(backends/varlen.py): the worker passes its boundaries as Megatron's
`PackedSeqParams` with qkv_format "sbhd" (the row stays [s, 1, ...]: Megatron's THD path and its RoPE by
cu_seqlens are not taken; RoPE positions come from mcore/model.py `RotaryPositions`) and no attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from nemo_grpo.backends.context_parallel import ContextShard
from nemo_grpo.backends.varlen import packed_attention


class SDPAttention(MegatronModule):
    """Drop-in for megatron.core.transformer.dot_product_attention.DotProductAttention (same constructor and
    forward): query [sq, b, np, hn], key and value [sk, b, ng, hn] (ng KV groups of this TP rank) ->
    context [sq, b, np * hn]. attention_mask: None (causal) or Megatron's convention, True where a query may
    NOT attend ([b or 1, 1, sq, sk]; our packed rows' block-diagonal causal mask). packed_seq_params: a packed
    row's segments (qkv_format "sbhd", cu_seqlens_q [n + 1], b = 1), attended per segment."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        unsupported = {"context_parallel_size": config.context_parallel_size != 1,
                       "window_size": config.window_size is not None,
                       "softmax_type": config.softmax_type != "vanilla",
                       "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling}
        if any(unsupported.values()):
            raise ValueError(f"SDPA core attention does not implement {[k for k, v in unsupported.items() if v]}; "
                             f"set policy.megatron_cfg.attention_backend=unfused")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else self.head_dim ** -0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPA core attention takes no attention bias")
        sq, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads or groups, s, hn]
        context = getattr(packed_seq_params, "context", None)
        if context is not None:  # this CP rank's positions over the whole row's keys
            out = context.attend(q, k, v, self.softmax_scale, self.dropout if self.training else 0.0)
            return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "sbhd" or attention_mask is not None:
                raise ValueError("SDPA core attention takes packed_seq_params as one sbhd row without a mask "
                                 f"(got qkv_format {packed_seq_params.qkv_format!r}); THD needs Transformer Engine")
            context = packed_attention(q, k, v, packed_seq_params.cu_seqlens_q, self.softmax_scale,
                                       self.dropout if self.training else 0.0)  # [1, np, sq, hn]
            return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
        causal = attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        context = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
            dropout_p=self.dropout if self.training else 0.0, is_causal=causal and sq > 1,
            scale=self.softmax_scale, enable_gqa=self.heads != self.groups)  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)


def segment_params(cu_seqlens: torch.Tensor) -> PackedSeqParams:
    """A packed row's segment boundaries [n + 1] as what GPTModel passes down to SDPAttention (qkv_format sbhd:
    Megatron keeps the row's [s, 1, ...] layout; max_seqlen sizes its RoPE table, which RotaryPositions
    re-indexes by the per-sequence positions, all below the longest segment)."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


@dataclass
class ContextParams(PackedSeqParams):
    """PackedSeqParams carrying a context-parallel shard down to SDPAttention (GPTModel passes them through)."""
    context: Optional[ContextShard] = None


def context_params(shard: ContextShard) -> ContextParams:
    """Under context parallelism: qkv_format sbhd (Megatron keeps its [s, b, ...] layout and its own CP is off);
    max_seqlen the whole row, so GPTModel's RoPE table covers every true position RotaryPositions looks up."""
    return ContextParams(qkv_format="sbhd", max_seqlen_q=shard.width, max_seqlen_kv=shard.width, context=shard)
