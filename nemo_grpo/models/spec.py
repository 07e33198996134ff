"""`ModelSpec`: the back-end-neutral description of a decoder (Llama / Qwen2 / Qwen3 families) and its tensors.

Both back ends and the memory planner read a model through it: `model_spec(hf_config, tp, pp)` checks that
the family is supported and that the layout splits its sizes; `hf_tensors(spec)` lists the HF state_dict with
how tensor parallelism splits each tensor, and `pipeline_stage` where a pipeline puts it. The Megatron back
end maps these names onto its own parameters (backends/mcore/weights.py); the planner counts them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from nemo_grpo.errors import ConfigError

CAUSAL_LM = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "Qwen3MoeForCausalLM": "qwen3_moe"}
SEQ_CLS = {"LlamaForSequenceClassification": "llama", "Qwen2ForSequenceClassification": "qwen2",
           "Qwen3ForSequenceClassification": "qwen3"}


@dataclass(frozen=True)
class RopeScaling:
    """An HF `rope_scaling` / `rope_parameters` the Megatron back end builds (MEGATRON_ROPE):
      llama3  Llama 3.1+: frequencies below original_max_positions / low_freq_factor divided by factor, above
              original_max_positions / high_freq_factor kept, smoothly blended between (Megatron's
              RotaryEmbedding._apply_scaling, which HF's _compute_llama3_parameters matches)
      linear  positions divided by factor (Megatron's seq_len_interpolation_factor)
      yarn    YaRN (https://arxiv.org/abs/2309.00071): inv_freq and attention_factor as Hugging Face's own
              _compute_yarn_parameters gives them for the config (beta_fast/beta_slow ramp between
              interpolated and extrapolated frequencies; mscale, mscale_all_dim or attention_factor, truncate)"""
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    inv_freq: Optional[tuple] = None  # yarn: the rotary inverse frequencies [head_dim / 2], fp32 values
    attention_factor: float = 1.0  # yarn: HF multiplies cos and sin by it, so q.k by its square


MEGATRON_ROPE = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder of one of the supported families, as both back ends and the planner see it (from its HF config)."""
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
    # HF's nn.Embedding(padding_idx=pad_token_id): that row gets no gradient from the input lookup (it still
    # does through a tied output layer). SmolLM2's pad is its EOS, <|im_end|>, a token of every chat turn.
    padding_idx: Optional[int] = None
    transformer_engine: bool = False  # Megatron's TE layer spec: the pre-attention / pre-MLP norms live in the fused linears
    rope_scaling: Optional[RopeScaling] = None  # None: plain RoPE (rope_type default)
    # Mixture-of-Experts (qwen3_moe; 0 for a dense model): routed experts per layer, experts a token goes to,
    # and each expert's MLP width (every layer sparse: decoder_sparse_step 1, no mlp_only_layers)
    experts: int = 0
    experts_per_token: int = 0
    moe_ffn: int = 0
    moe_norm_topk: bool = True  # HF norm_topk_prob: the top-k routing weights renormalised to sum to 1


def rope_parameters(cfg) -> dict:
    """The HF config's RoPE parameters (transformers 5 `rope_parameters`, older `rope_scaling`), rope_type set."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    params.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    return params


def check_rope(cfg, key: str = "policy.model_name") -> None:
    """A RoPE scaling the Megatron back end does not build is a ConfigError naming the type and `key`."""
    kind = rope_parameters(cfg)["rope_type"]
    if kind not in MEGATRON_ROPE:
        raise ConfigError(f"config key '{key}': the model's rope_type '{kind}' is not built by the megatron back end "
                          f"(built: {', '.join(MEGATRON_ROPE)}); use policy.backend=dtensor, which runs any "
                          f"RoPE Hugging Face does")


def _rope_scaling(cfg, strict: bool, model_key: str) -> Optional[RopeScaling]:
    """The RopeScaling of an HF config (None for plain RoPE, or for a type not built when strict is False)."""
    params = rope_parameters(cfg)
    kind = params["rope_type"]
    if strict:
        check_rope(cfg, model_key)
    if kind == "llama3":
        return RopeScaling(kind, float(params["factor"]), float(params["low_freq_factor"]),
                           float(params["high_freq_factor"]), int(params["original_max_position_embeddings"]))
    if kind == "linear":
        return RopeScaling(kind, float(params["factor"]))
    if kind == "yarn":
        return _yarn(cfg, params)
    return None


def _yarn(cfg, params: dict) -> RopeScaling:
    """rope_type yarn: the frequencies [head_dim / 2] and attention factor from transformers' own function."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # here: validation imports spec early

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](copy.deepcopy(cfg))  # it standardizes the config
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or cfg.max_position_embeddings / original  # HF's default when factor is None
    return RopeScaling("yarn", float(factor), original_max_positions=original,
                       inv_freq=tuple(inv_freq.float().tolist()), attention_factor=float(attention_factor))


def moe_experts(cfg) -> int:
    """Routed experts per MoE layer of an HF config (Qwen3-MoE / Qwen2-MoE `num_experts`, Mixtral's
    `num_local_experts`); 0 for a dense model."""
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0)


def check_divisible(cfg, tp: int, pp: int, tp_key: str, pp_key: Optional[str] = None) -> None:
    """Heads, KV heads and the MLP width must split evenly over tp, the layers over pp; a ConfigError names
    the layout key and every size it does not divide."""
    heads = cfg.num_attention_heads
    sizes = {"num_attention_heads": heads, "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or heads,
             "intermediate_size": cfg.intermediate_size}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        raise ConfigError(f"config key '{tp_key}': {tp} does not divide the model's "
                          + ", ".join(f"{k}={v}" for k, v in bad.items()))
    if pp_key and cfg.num_hidden_layers % pp:
        raise ConfigError(f"config key '{pp_key}': {pp} does not divide the model's "
                          f"num_hidden_layers={cfg.num_hidden_layers}")


def model_spec(cfg, tp: int = 1, pp: int = 1, scalar_head: bool = False,
               transformer_engine: bool = False, any_rope: bool = False,
               layout_key: str = "policy.megatron_cfg") -> ModelSpec:
    """HF config -> ModelSpec; raises ValueError naming an unknown architecture or a size tp/pp cannot split
    (the sizes named under layout_key). any_rope: accept RoPE scalings the Megatron back end cannot build (the
    DTensor back end runs them; the planner sizes them)."""
    arch = (getattr(cfg, "architectures", None) or ["?"])[0]
    family = CAUSAL_LM.get(arch) or SEQ_CLS.get(arch) or {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                                                           "qwen3_moe": "qwen3_moe"}.get(getattr(cfg, "model_type", ""))
    if family is None:
        raise ValueError(f"architecture '{arch}' (model_type '{getattr(cfg, 'model_type', '?')}') "
                         f"is not supported; known: {', '.join(sorted(CAUSAL_LM) + sorted(SEQ_CLS))}")
    if family != "qwen2" and getattr(cfg, "attention_bias", False):
        raise ValueError(f"{arch} with attention_bias=True (an o_proj bias) is not supported")
    if getattr(cfg, "mlp_bias", False) or getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"{arch} with mlp_bias or sliding-window attention is not supported")
    check_divisible(cfg, tp, pp, f"{layout_key}.tensor_model_parallel_size",
                    f"{layout_key}.pipeline_model_parallel_size")
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    return ModelSpec(
        family=family, num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, ffn=cfg.intermediate_size,
        heads=heads, kv_heads=kv, head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        vocab=cfg.vocab_size, padded_vocab=-(-cfg.vocab_size // tp) * tp, qkv_bias=family == "qwen2",
        qk_norm=family.startswith("qwen3"), tied=bool(getattr(cfg, "tie_word_embeddings", False)) and not scalar_head,
        scalar_head=scalar_head, rope_theta=float(rope_parameters(cfg)["rope_theta"]), eps=cfg.rms_norm_eps,
        padding_idx=getattr(cfg, "pad_token_id", None),
        max_positions=cfg.max_position_embeddings, transformer_engine=transformer_engine,
        rope_scaling=_rope_scaling(cfg, not any_rope, layout_key.rpartition(".")[0] + ".model_name"),
        **_moe_sizes(cfg, arch))


def _moe_sizes(cfg, arch: str) -> dict:
    """ModelSpec's MoE fields of an HF config ({} for a dense model); dense layers between sparse ones (Qwen3-MoE's
    decoder_sparse_step > 1 or mlp_only_layers) are a ValueError."""
    if not moe_experts(cfg):
        return {}
    if getattr(cfg, "decoder_sparse_step", 1) != 1 or getattr(cfg, "mlp_only_layers", None):
        raise ValueError(f"{arch} with dense layers among the sparse ones (decoder_sparse_step "
                         f"{cfg.decoder_sparse_step}, mlp_only_layers {cfg.mlp_only_layers}) is not supported")
    return {"experts": moe_experts(cfg), "experts_per_token": cfg.num_experts_per_tok,
            "moe_ffn": cfg.moe_intermediate_size, "moe_norm_topk": bool(getattr(cfg, "norm_topk_prob", True))}


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the HF state_dict: its name, full shape, decoder layer (None outside the layers) and kind,
    which says how tensor parallelism splits it:
      copy     replicated (norms, Qwen3 q/k norms, the scalar head)
      col      split along dim 1 (o_proj, down_proj)
      vocab    rows padded to the TP-divisible vocabulary, split along dim 0 (embeddings, lm_head)
      q k v gate up   split along dim 0 (Megatron fuses q/k/v and gate/up; see backends/mcore/weights.py)"""
    name: str
    shape: tuple
    layer: Optional[int]
    kind: str


def _layer_tensors(s: ModelSpec, g: int) -> list[HFTensor]:
    h = f"model.layers.{g}."
    q, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out = [HFTensor(h + f"self_attn.{x}_proj.weight", (n, s.hidden), g, x) for x, n in (("q", q), ("k", kvd), ("v", kvd))]
    if s.qkv_bias:
        out += [HFTensor(h + f"self_attn.{x}_proj.bias", (n,), g, x) for x, n in (("q", q), ("k", kvd), ("v", kvd))]
    out.append(HFTensor(h + "self_attn.o_proj.weight", (s.hidden, q), g, "col"))
    if s.qk_norm:
        out += [HFTensor(h + f"self_attn.{x}_norm.weight", (s.head_dim,), g, "copy") for x in ("q", "k")]
    if s.experts:  # transformers 5's fused layout (models/experts.py); replicated over DTensor's TP ranks
        out += [HFTensor(h + "mlp.gate.weight", (s.experts, s.hidden), g, "copy"),
                HFTensor(h + "mlp.experts.gate_up_proj", (s.experts, 2 * s.moe_ffn, s.hidden), g, "copy"),
                HFTensor(h + "mlp.experts.down_proj", (s.experts, s.hidden, s.moe_ffn), g, "copy")]
    else:
        out += [HFTensor(h + "mlp.gate_proj.weight", (s.ffn, s.hidden), g, "gate"),
                HFTensor(h + "mlp.up_proj.weight", (s.ffn, s.hidden), g, "up"),
                HFTensor(h + "mlp.down_proj.weight", (s.hidden, s.ffn), g, "col")]
    return out + [
        HFTensor(h + "input_layernorm.weight", (s.hidden,), g, "copy"),
        HFTensor(h + "post_attention_layernorm.weight", (s.hidden,), g, "copy")]


def hf_tensors(s: ModelSpec) -> list[HFTensor]:
    """Every tensor of the HF state_dict in order (a tied lm_head.weight included: it aliases the embedding)."""
    out = [HFTensor("model.embed_tokens.weight", (s.vocab, s.hidden), None, "vocab")]
    for g in range(s.num_layers):
        out += _layer_tensors(s, g)
    out.append(HFTensor("model.norm.weight", (s.hidden,), None, "copy"))
    if s.scalar_head:
        out.append(HFTensor("score.weight", (1, s.hidden), None, "copy"))
    else:
        out.append(HFTensor("lm_head.weight", (s.vocab, s.hidden), None, "vocab"))
    return out


def pipeline_stage(t: HFTensor, s: ModelSpec, pp: int) -> int:
    """The stage holding tensor t when pp stages split the layers evenly: the embedding (and a tied lm_head,
    which is the embedding) on the first, the final norm and an untied head on the last."""
    if t.layer is not None:
        return t.layer // (s.num_layers // pp)
    if t.name == "model.embed_tokens.weight" or (t.name == "lm_head.weight" and s.tied):
        return 0
    return pp - 1
