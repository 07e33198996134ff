"""Hugging Face <-> Megatron-Core (local layer spec) weights for Llama / Qwen2 / Qwen3, any TP x PP layout.

Pure functions, no process groups. The mapping is one table (`entries`): each HF tensor names the pipeline
stage that owns it, the Megatron parameter (stage-local name) that holds it and how it is split:
  copy   replicated over TP                          (norms, Qwen3 q/k norms, the scalar head)
  col    split along dim 1                           (o_proj -> linear_proj, down_proj -> linear_fc2)
  vocab  rows padded to the TP-divisible vocabulary, then split along dim 0 (embeddings, lm_head)
  q/k/v  fused into linear_qkv grouped per KV group: for group g the rows [q heads of g, k_g, v_g]; split dim 0
  gate/up  fused into linear_fc1; TP rank r holds [gate shard r; up shard r]
Loading (`to_megatron`) maps full HF tensors to this rank's shards; export (`to_hf`) maps the TP shards of the
owning stage back to full HF tensors, bit-exactly (slicing and concatenation only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

CAUSAL_LM = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
SEQ_CLS = {"LlamaForSequenceClassification": "llama", "Qwen2ForSequenceClassification": "qwen2",
           "Qwen3ForSequenceClassification": "qwen3"}


@dataclass(frozen=True)
class ModelSpec:
    """What the Megatron model needs from an HF config (a decoder of one of the supported families)."""
    family: str  # llama | qwen2 | qwen3
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    padded_vocab: int  # vocab rounded up to a multiple of tp (padded logits are masked out)
    qkv_bias: bool
    qk_norm: bool
    tied: bool
    scalar_head: bool
    rope_theta: float
    eps: float
    max_positions: int
    transformer_engine: bool = False  # TE layer spec: the pre-attention / pre-MLP norms live in the fused linears


@dataclass(frozen=True)
class Entry:
    hf: str
    shape: tuple
    stage: int
    mcore: str
    kind: str


def _rope_theta(cfg, strict: bool = True) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if strict and kind not in (None, "default"):
        raise ValueError(f"megatron back end: rope_type '{kind}' is not supported (only default RoPE)")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def model_spec(cfg, tp: int = 1, pp: int = 1, scalar_head: bool = False,
               transformer_engine: bool = False, any_rope: bool = False,
               layout_key: str = "policy.megatron_cfg") -> ModelSpec:
    """HF config -> ModelSpec; raises ValueError naming an unknown architecture or a size tp/pp cannot split
    (the sizes named under layout_key). any_rope: accept RoPE scalings the Megatron back end cannot build (for
    sizing a model only)."""
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    family = CAUSAL_LM.get(arch) or SEQ_CLS.get(arch) or {"llama": "llama", "qwen2": "qwen2",
                                                           "qwen3": "qwen3"}.get(getattr(cfg, "model_type", ""))
    if family is None:
        raise ValueError(f"megatron back end: architecture '{arch}' (model_type '{getattr(cfg, 'model_type', '?')}') "
                         f"is not supported; known: {', '.join(sorted(CAUSAL_LM) + sorted(SEQ_CLS))}")
    if family != "qwen2" and getattr(cfg, "attention_bias", False):
        raise ValueError(f"megatron back end: {arch} with attention_bias=True (an o_proj bias) is not supported")
    if getattr(cfg, "mlp_bias", False) or getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"megatron back end: {arch} with mlp_bias or sliding-window attention is not supported")
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    sizes = {"num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": cfg.intermediate_size}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ValueError(f"{layout_key}.tensor_model_parallel_size={tp} does not divide the model's "
                         + ", ".join(f"{k}={v}" for k, v in bad.items()))
    if cfg.num_hidden_layers % pp:
        raise ValueError(f"{layout_key}.pipeline_model_parallel_size={pp} does not divide the model's "
                         f"num_hidden_layers={cfg.num_hidden_layers}")
    return ModelSpec(
        family=family, num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, ffn=cfg.intermediate_size,
        heads=heads, kv_heads=kv, head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        vocab=cfg.vocab_size, padded_vocab=-(-cfg.vocab_size // tp) * tp, qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3", tied=bool(getattr(cfg, "tie_word_embeddings", False)) and not scalar_head,
        scalar_head=scalar_head, rope_theta=_rope_theta(cfg, strict=not any_rope), eps=cfg.rms_norm_eps,
        max_positions=cfg.max_position_embeddings, transformer_engine=transformer_engine)


def _layer_entries(s: ModelSpec, g: int, stage: int, local: int) -> list[Entry]:
    h, m = f"model.layers.{g}.", f"decoder.layers.{local}."
    q, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    att, mlp = m + "self_attention.", m + "mlp."
    norms = (att + "linear_qkv.layer_norm_weight", mlp + "linear_fc1.layer_norm_weight") if s.transformer_engine \
        else (m + "input_layernorm.weight", m + "pre_mlp_layernorm.weight")
    out = [Entry(h + "self_attn.q_proj.weight", (q, s.hidden), stage, att + "linear_qkv.weight", "q"),
           Entry(h + "self_attn.k_proj.weight", (kvd, s.hidden), stage, att + "linear_qkv.weight", "k"),
           Entry(h + "self_attn.v_proj.weight", (kvd, s.hidden), stage, att + "linear_qkv.weight", "v")]
    if s.qkv_bias:
        out += [Entry(h + f"self_attn.{x}_proj.bias", (n,), stage, att + "linear_qkv.bias", x)
                for x, n in (("q", q), ("k", kvd), ("v", kvd))]
    out.append(Entry(h + "self_attn.o_proj.weight", (s.hidden, q), stage, att + "linear_proj.weight", "col"))
    if s.qk_norm:
        out += [Entry(h + "self_attn.q_norm.weight", (s.head_dim,), stage, att + "q_layernorm.weight", "copy"),
                Entry(h + "self_attn.k_norm.weight", (s.head_dim,), stage, att + "k_layernorm.weight", "copy")]
    return out + [
        Entry(h + "mlp.gate_proj.weight", (s.ffn, s.hidden), stage, mlp + "linear_fc1.weight", "gate"),
        Entry(h + "mlp.up_proj.weight", (s.ffn, s.hidden), stage, mlp + "linear_fc1.weight", "up"),
        Entry(h + "mlp.down_proj.weight", (s.hidden, s.ffn), stage, mlp + "linear_fc2.weight", "col"),
        Entry(h + "input_layernorm.weight", (s.hidden,), stage, norms[0], "copy"),
        Entry(h + "post_attention_layernorm.weight", (s.hidden,), stage, norms[1], "copy")]


def entries(s: ModelSpec, pp: int = 1) -> list[Entry]:
    """Every tensor of the HF state_dict (tied lm_head.weight included, read from the embedding), in order."""
    per, last = s.num_layers // pp, pp - 1
    out = [Entry("model.embed_tokens.weight", (s.vocab, s.hidden), 0, "embedding.word_embeddings.weight", "vocab")]
    for g in range(s.num_layers):
        out += _layer_entries(s, g, g // per, g % per)
    out.append(Entry("model.norm.weight", (s.hidden,), last, "decoder.final_layernorm.weight", "copy"))
    if s.scalar_head:
        out.append(Entry("score.weight", (1, s.hidden), last, "output_layer.weight", "copy"))
    elif s.tied:
        out.append(Entry("lm_head.weight", (s.vocab, s.hidden), 0, "embedding.word_embeddings.weight", "vocab"))
    else:
        out.append(Entry("lm_head.weight", (s.vocab, s.hidden), last, "output_layer.weight", "vocab"))
    return out


SPLIT_DIM = {"col": 1, "vocab": 0, "q": 0, "k": 0, "v": 0, "gate": 0, "up": 0}  # kinds split over TP


def tp_split_dims(s: ModelSpec, pp: int, pp_rank: int) -> dict[str, int]:
    """Stage-local Megatron parameter -> the dim it is split along over TP (replicated ones are absent)."""
    dims = {e.mcore: SPLIT_DIM[e.kind] for e in entries(s, pp) if e.stage == pp_rank and e.kind in SPLIT_DIM}
    if s.tied and pp > 1 and pp_rank == pp - 1:
        dims["output_layer.weight"] = 0  # the last stage's copy of the tied embedding
    return dims


def tied_aliases(s: ModelSpec) -> frozenset:
    return frozenset({"lm_head.weight"}) if s.tied else frozenset()


# ---------------------------------------------------------------------------------------------- HF -> Megatron
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelSpec) -> torch.Tensor:
    """q [nh*d, ...], k/v [ng*d, ...] -> linear_qkv [(nh + 2*ng)*d, ...] grouped per KV group."""
    rest, ng, d = q.shape[1:], s.kv_heads, s.head_dim
    parts = [q.reshape(ng, s.heads // ng * d, *rest), k.reshape(ng, d, *rest), v.reshape(ng, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _shard(kind: str, full: list[torch.Tensor], s: ModelSpec, tp: int, r: int) -> torch.Tensor:
    """Full HF tensor(s) of one Megatron parameter -> TP rank r's shard."""
    if kind == "copy":
        return full[0]
    if kind == "col":
        return full[0].chunk(tp, dim=1)[r]
    if kind == "vocab":
        x = full[0]
        x = torch.cat([x, x.new_zeros(s.padded_vocab - x.shape[0], *x.shape[1:])]) if s.padded_vocab > x.shape[0] else x
        return x.chunk(tp, dim=0)[r]
    if kind == "qkv":
        return fuse_qkv(*full, s).chunk(tp, dim=0)[r]
    if kind == "fc1":
        return torch.cat([full[0].chunk(tp, dim=0)[r], full[1].chunk(tp, dim=0)[r]])
    raise AssertionError(kind)


def to_megatron(get: Callable[[str], torch.Tensor], s: ModelSpec, tp: int, tp_rank: int, pp: int,
                pp_rank: int) -> dict[str, torch.Tensor]:
    """HF tensors by name (`get`) -> the state dict of the Megatron model chunk at (tp_rank, pp_rank)."""
    grouped: dict[str, list[Entry]] = {}
    for e in entries(s, pp):
        if e.stage == pp_rank and not (e.hf == "lm_head.weight" and s.tied):
            grouped.setdefault(e.mcore, []).append(e)
    out = {}
    for name, es in grouped.items():
        kind = {"q": "qkv", "gate": "fc1"}.get(es[0].kind, es[0].kind)
        out[name] = _shard(kind, [get(e.hf) for e in es], s, tp, tp_rank).contiguous()
    if s.tied and pp > 1 and pp_rank == pp - 1:  # the last stage's copy of the tied embedding
        out["output_layer.weight"] = _shard("vocab", [get("model.embed_tokens.weight")], s, tp, tp_rank).contiguous()
    return out


# ---------------------------------------------------------------------------------------------- Megatron -> HF
def to_hf(e: Entry, shards: list[torch.Tensor], s: ModelSpec) -> torch.Tensor:
    """The TP shards (in TP rank order) of Megatron parameter e.mcore -> the full HF tensor e.hf."""
    if e.kind == "copy":
        return shards[0]
    if e.kind == "col":
        return torch.cat(shards, dim=1)
    if e.kind == "vocab":
        return torch.cat(shards, dim=0)[: s.vocab]
    if e.kind in ("gate", "up"):
        return torch.cat([x.chunk(2, dim=0)[e.kind == "up"] for x in shards], dim=0)
    if e.kind in ("q", "k", "v"):
        full = torch.cat(shards, dim=0)
        ng, d = s.kv_heads, s.head_dim
        groups = full.reshape(ng, (s.heads // ng + 2) * d, *full.shape[1:])
        q, k, v = groups.split([s.heads // ng * d, d, d], dim=1)
        return {"q": q, "k": k, "v": v}[e.kind].reshape(-1, *full.shape[1:])
    raise AssertionError(e.kind)
