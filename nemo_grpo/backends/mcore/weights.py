"""Hugging Face <-> Megatron-Core (local layer spec) weights for Llama / Qwen2 / Qwen3, any TP x PP layout.

Pure functions, no process groups. The mapping is one table (`entries`), built on the neutral tensor list of
nemo_grpo/models/spec.py: each HF tensor names the pipeline stage that owns it, the Megatron parameter
(stage-local name) that holds it and how it is split:
  copy   replicated over TP                          (norms, Qwen3 q/k norms, the scalar head)
  col    split along dim 1                           (o_proj -> linear_proj, down_proj -> linear_fc2)
  rows   split along dim 0                           (LoRA's B of a column-parallel linear, mcore/lora.py)
  vocab  rows padded to the TP-divisible vocabulary, then split along dim 0 (embeddings, lm_head)
  q/k/v  fused into linear_qkv grouped per KV group: for group g the rows [q heads of g, k_g, v_g]; split dim 0
  gate/up  fused into linear_fc1; TP rank r holds [gate shard r; up shard r]
  experts_fc1 / experts_fc2   MoE: HF's fused [E, 2F, H] / [E, H, F] (models/experts.py) cut into the E / ep
         experts of this expert-parallel rank, expert e (global) -> `local_experts.{e mod E/ep}.linear_fc1.weight`
         [2F, H] (gate rows then up rows, as Megatron's gated fc1 and the dense MLP's TP=1 fc1) and `.linear_fc2`
         [H, F]; not split over TP (expert TP 1: every TP rank holds its EP rank's experts whole)
Loading (`to_megatron`) maps full HF tensors to this rank's shards; export (`to_hf`) maps the TP shards of the
owning stage back to full HF tensors, bit-exactly (slicing and concatenation only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nemo_grpo.models.spec import HFTensor, ModelSpec, hf_tensors, pipeline_stage

@dataclass(frozen=True)
class Entry:
    """An HF tensor (spec.HFTensor) placed on Megatron: its pipeline stage and the stage-local parameter."""
    hf: str
    shape: tuple
    stage: int
    mcore: str
    kind: str


# HF name inside a decoder layer -> the Megatron parameter holding it, inside decoder.layers.<local>.
_LAYER_PARAMS = {
    "self_attn.q_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.k_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.v_proj.weight": "self_attention.linear_qkv.weight",
    "self_attn.q_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.k_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.v_proj.bias": "self_attention.linear_qkv.bias",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.linear_fc1.weight",
    "mlp.up_proj.weight": "mlp.linear_fc1.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "mlp.gate.weight": "mlp.router.weight",  # MoE: the router (TopKRouter), [experts, hidden]
    "mlp.experts.gate_up_proj": "mlp.experts.local_experts",  # MoE: a prefix; the experts are SequentialMLP's
    "mlp.experts.down_proj": "mlp.experts.local_experts",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
}
# Transformer Engine's layer spec keeps the pre-attention / pre-MLP norms inside the fused linears
_TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
_OUTER_PARAMS = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
                 "model.norm.weight": "decoder.final_layernorm.weight",
                 "score.weight": "output_layer.weight", "lm_head.weight": "output_layer.weight"}


def _mcore_name(t: HFTensor, s: ModelSpec, pp: int) -> str:
    if t.layer is None:
        tied_head = t.name == "lm_head.weight" and s.tied
        return _OUTER_PARAMS["model.embed_tokens.weight" if tied_head else t.name]
    suffix = t.name.split(".", 3)[3]  # model.layers.<g>.<suffix>
    local = t.layer % (s.num_layers // pp)
    param = (_TE_NORMS.get(suffix) if s.transformer_engine else None) or _LAYER_PARAMS[suffix]
    return f"decoder.layers.{local}.{param}"


# MoE expert tensors: HF name suffix -> kind, and the Megatron linear inside each local expert
EXPERT_KINDS = {"mlp.experts.gate_up_proj": "experts_fc1", "mlp.experts.down_proj": "experts_fc2"}
EXPERT_LINEAR = {"experts_fc1": "linear_fc1.weight", "experts_fc2": "linear_fc2.weight"}


def _kind(t: HFTensor) -> str:
    return EXPERT_KINDS.get(t.name.split(".", 3)[3], t.kind) if t.layer is not None else t.kind


def entries(s: ModelSpec, pp: int = 1) -> list[Entry]:
    """Every tensor of the HF state_dict (tied lm_head.weight included, read from the embedding), in order."""
    return [Entry(t.name, t.shape, pipeline_stage(t, s, pp), _mcore_name(t, s, pp), _kind(t)) for t in hf_tensors(s)]


def expert_params(e: Entry, s: ModelSpec, ep: int) -> list[str]:
    """An expert entry's Megatron parameters on one expert-parallel rank, in local expert order."""
    return [f"{e.mcore}.{i}.{EXPERT_LINEAR[e.kind]}" for i in range(s.experts // ep)]


SPLIT_DIM = {"col": 1, "rows": 0, "vocab": 0, "q": 0, "k": 0, "v": 0, "gate": 0, "up": 0}  # kinds split over TP


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


def shard(kind: str, full: list[torch.Tensor], s: ModelSpec, tp: int, r: int) -> torch.Tensor:
    """Full HF tensor(s) of one Megatron parameter -> TP rank r's shard."""
    if kind == "copy":
        return full[0]
    if kind == "col":
        return full[0].chunk(tp, dim=1)[r]
    if kind == "rows":
        return full[0].chunk(tp, dim=0)[r]
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
                pp_rank: int, ep: int = 1, ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """HF tensors by name (`get`) -> the state dict of the Megatron model chunk at (tp_rank, pp_rank), with the
    experts of expert-parallel rank ep_rank (E / ep of them)."""
    grouped: dict[str, list[Entry]] = {}
    out = {}
    for e in entries(s, pp):
        if e.stage != pp_rank or (e.hf == "lm_head.weight" and s.tied):
            continue
        if e.kind in EXPERT_LINEAR:  # [E, ...] -> this EP rank's experts, one parameter each
            n = s.experts // ep
            mine = _read_experts(get, e.hf, range(ep_rank * n, (ep_rank + 1) * n))
            out.update({name: x.contiguous() for name, x in zip(expert_params(e, s, ep), mine)})
        else:
            grouped.setdefault(e.mcore, []).append(e)
    for name, es in grouped.items():
        kind = {"q": "qkv", "gate": "fc1"}.get(es[0].kind, es[0].kind)
        out[name] = shard(kind, [get(e.hf) for e in es], s, tp, tp_rank).contiguous()
    if s.tied and pp > 1 and pp_rank == pp - 1:  # the last stage's copy of the tied embedding
        out["output_layer.weight"] = shard("vocab", [get("model.embed_tokens.weight")], s, tp, tp_rank).contiguous()
    return out


def _read_experts(get: Callable[[str], torch.Tensor], name: str, experts: range) -> torch.Tensor:
    """Fused expert tensor `name` [E, ...] restricted to `experts`; only those are read when `get` can
    (models/reader.py hf_tensor_reader's read_experts)."""
    read = getattr(get, "read_experts", None)
    return read(name, experts) if read else get(name)[experts.start:experts.stop]


# ---------------------------------------------------------------------------------------------- Megatron -> HF
def to_hf(e: Entry, shards: list[torch.Tensor], s: ModelSpec) -> torch.Tensor:
    """The TP shards (in TP rank order) of Megatron parameter e.mcore -> the full HF tensor e.hf (experts: the
    worker stacks them, expert_params)."""
    if e.kind == "copy":
        return shards[0]
    if e.kind == "col":
        return torch.cat(shards, dim=1)
    if e.kind == "rows":
        return torch.cat(shards, dim=0)
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
