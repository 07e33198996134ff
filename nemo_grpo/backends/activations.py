"""Bytes of activations per token: what autograd saves for the backward of one decoder layer, and the logits.

The per-layer formulas were read off `torch.autograd.graph.saved_tensors_hooks` on the implementations the
back ends run (tests/unit/test_planner.py re-measures them on small models and asserts they match):
  hf        Hugging Face decoder layer, SDPA attention (the DTensor back end: no [s, s] scores kept)
  hf_eager  Hugging Face decoder layer, eager attention (scores and probabilities kept, K/V repeated per head)
  megatron  Megatron-Core local layer spec (unfused attention: scores kept, K/V repeated per head; its
            RMSNorms keep fp32 copies; rotary tables and the causal mask per layer)
  megatron_sdpa  the local spec with SDPA core attention (the default: no [s, s] terms; the fused qkv output,
            rotated q and k, the attention output and its log-sum-exp kept, K/V not repeated)
  megatron_te  Transformer Engine layer spec (flash attention; not measurable here: `megatron` without the
            [s, s] terms, plus the softmax log-sum-exp)
Notation: h hidden, f ffn, q = heads x head_dim, kv = kv_heads x head_dim, a heads, s sequence length,
B bytes of the compute dtype. Tensor-parallel ranks keep 1/tp of the head / ffn terms; the hidden-size terms
are replicated, or split along the sequence with Megatron's sequence parallelism. Context parallelism gives a
rank 1/cp of each sequence's tokens (the per-token figures hold for them) plus the full-length K and V of the
layer it runs (`gathered_kv_bytes`).
Mixture-of-Experts layers (spec.experts > 0; an estimate, not measured like the dense terms): a token's MLP
terms are those of its k = experts_per_token routed copies, each an MLP of width moe_ffn, plus each copy's
permuted input [k, h] and the router's fp32 logits, probabilities and scores [3, E]. Megatron keeps the experts
whole over its TP ranks (expert tensor parallel size 1), so these terms follow the tokens: / tp with sequence
parallelism (Megatron's MoE with tp > 1 needs it), else whole; DTensor keeps HF's experts replicated over tp.
The token dispatch adds `moe_dispatch_bytes` for the one layer running.
"""

from __future__ import annotations

from nemo_grpo.models.spec import ModelSpec

IMPLEMENTATIONS = ("hf", "hf_eager", "megatron", "megatron_sdpa", "megatron_te")


def layer_bytes_per_token(spec: ModelSpec, impl: str, dtype_bytes: int, seq_len: int, tp: int = 1,
                          sequence_parallel: bool = False, seqs_per_micro_batch: int = 1) -> float:
    """Bytes one decoder layer keeps for its backward, per token of a micro-batch of `seqs_per_micro_batch`
    sequences of `seq_len` tokens, on one tensor-parallel rank."""
    h, f, a, s, b = spec.hidden, spec.ffn, spec.heads, seq_len, dtype_bytes
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    lowp = b == 2  # bf16: fp32 copies kept by the norms and the softmax
    if impl in ("hf", "hf_eager"):
        hidden = b * 6 * h + (4 * h if lowp else 0) + 8  # 2 x (norm input, normed, linear input); rsqrt
        hidden += _moe_bytes(spec, b, 4)
        f = 0 if spec.experts else f  # the experts' terms are in hidden: replicated over tp
        if impl == "hf":
            split = b * (4 * f + 2 * q + 2 * kv) + 4 * a  # gate, up, act, down input; q, k, v, out; lse
        else:
            split = b * (4 * f + 4 * q) + a * s * (6 if lowp else 4)  # k, v repeated; fp32 (+bf16) probs
        return hidden + split / tp
    if impl in ("megatron", "megatron_sdpa", "megatron_te"):
        hidden = 16 * h + 8 + 2 * b * h  # 2 x fp32 (norm input, normed) + rsqrt; qkv and fc1 inputs
        hidden += _moe_bytes(spec, b, 5)
        f = 0 if spec.experts else f  # the experts' terms are in hidden: whole over tp (ETP 1), / tp with SP
        if impl == "megatron":
            split = b * (4 * q + 5 * f) + a * s * (6 if lowp else 4)  # proj in, q, k, v; fc1 out x2, ...
            per_layer = 4 * spec.head_dim * b * s + s * s  # rotary tables (x4) and the bool causal mask
        elif impl == "megatron_sdpa":
            split = b * (3 * q + 3 * kv + 5 * f) + 4 * a  # qkv out, rotated q and k, out, proj in; lse (fp32)
            per_layer = 4 * spec.head_dim * b * s
        else:
            split = b * (4 * q + 5 * f) + 4 * a
            per_layer = 4 * spec.head_dim * b * s
        tokens = seqs_per_micro_batch * s
        return hidden / (tp if sequence_parallel else 1) + split / tp + per_layer / tokens
    raise ValueError(f"activation implementation '{impl}' is unknown; known: {', '.join(IMPLEMENTATIONS)}")


def _moe_bytes(spec: ModelSpec, b: int, mlp_terms: int) -> float:
    """A Mixture-of-Experts layer's per-token terms (0 for a dense model): k routed copies, each with its permuted
    input [h] and `mlp_terms` tensors of the expert width (the dense formulas' MLP terms), and the router's fp32
    [3, E] (logits, probabilities, top-k scores)."""
    if not spec.experts:
        return 0.0
    return spec.experts_per_token * b * (spec.hidden + mlp_terms * spec.moe_ffn) + 12 * spec.experts


def moe_dispatch_bytes(spec: ModelSpec, dtype_bytes: int, tokens: float, copies: int = 3) -> float:
    """The alltoall token dispatcher's buffers while one MoE layer runs: `copies` of its `tokens` x k routed
    copies of the hidden state (permuted, received over the all-to-all, sorted by local expert; the combine
    goes back through as many), [tokens * k, h] in the compute dtype each. 0 for a dense model."""
    return copies * tokens * spec.experts_per_token * spec.hidden * dtype_bytes if spec.experts else 0.0


def layer_input_bytes_per_token(spec: ModelSpec, dtype_bytes: int, tp: int = 1,
                                sequence_parallel: bool = False) -> float:
    """With full recomputation a layer keeps only its input hidden state: [s, h] per sequence."""
    return dtype_bytes * spec.hidden / (tp if sequence_parallel else 1)


def gathered_kv_bytes(spec: ModelSpec, dtype_bytes: int, seq_len: int, tp: int = 1, rows: int = 1) -> float:
    """Context parallelism's K/V exchange, one layer: the K and V of every token of `rows` rows of `seq_len`
    all-gathered over the CP ranks, [seq_len, kv_heads / tp, head_dim] each in the compute dtype (Llama 3's
    all-gather; each rank's queries cover only its own chunks)."""
    return 2.0 * rows * seq_len * max(1, spec.kv_heads // tp) * spec.head_dim * dtype_bytes


def logits_bytes_per_token(vocab_on_rank: int, dtype_bytes: int) -> float:
    """Logits [.., V] in the compute dtype, their fp32 copy for the log-softmax and its fp32 gradient."""
    return vocab_on_rank * (dtype_bytes + 4 + 4)
