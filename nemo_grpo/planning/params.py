"""Parameter counts of a decoder (Llama / Qwen2 / Qwen3 / Qwen3-MoE): in total, per token (`active_params`), per
Megatron rank (tp, pp stage, ep: `megatron_stage_split`) and per DTensor rank (tp x FSDP dp), all read off the one
back-end-neutral tensor table (nemo_grpo/models/spec.py); and of its LoRA adapters (`lora_layer_params`).

A model is described by its HF config: the `config.json` of the local directory when it exists, else the
published config of a known model family matched on the directory's name (so a plan can be made before the
weights are downloaded): see `KNOWN_MODELS`.
"""

from __future__ import annotations

import math
import os

from transformers import AutoConfig

from nemo_grpo.config import BUILTIN_MODEL_PREFIX, ConfigError
from nemo_grpo.models.builtin import builtin_config
from nemo_grpo.models.spec import HFTensor, ModelSpec, hf_tensors, model_spec, pipeline_stage

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=8192, num_key_value_heads=8, tie_word_embeddings=False)
_LLAMA31_ROPE = dict(max_position_embeddings=131072, rope_scaling=dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192, rope_theta=500000.0))
_LLAMA3_8B = dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
_LLAMA3_70B = dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64)
_QWEN = dict(vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True)
# Qwen3's MoE models: 128 experts, 8 per token, the top-8 weights renormalised, every layer sparse
_QWEN3_32B = dict(_QWEN, model_type="qwen3", tie_word_embeddings=False, hidden_size=5120, intermediate_size=25600,
                  num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                  attention_bias=False, max_position_embeddings=40960)
# Qwen3's long context (its model card): YaRN factor 4 over the 32,768 positions it was trained at
_QWEN3_YARN = dict(max_position_embeddings=131072, rope_scaling=dict(
    rope_type="yarn", factor=4.0, original_max_position_embeddings=32768, rope_theta=1000000.0))
_QWEN_MOE = dict(_QWEN, model_type="qwen3_moe", tie_word_embeddings=False, num_key_value_heads=4, head_dim=128,
                 num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], max_position_embeddings=40960)

# directory-name prefix (case-insensitive) -> the published config.json values of that model
KNOWN_MODELS = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5,
                         rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True),
    "meta-llama-3-8b": _LLAMA3_8B,
    "meta-llama-3-70b": _LLAMA3_70B,
    "llama-3.1-8b": dict(_LLAMA3_8B, **_LLAMA31_ROPE),
    "llama-3.1-70b": dict(_LLAMA3_70B, **_LLAMA31_ROPE),
    "llama-3.3-70b": dict(_LLAMA3_70B, **_LLAMA31_ROPE),
    "qwen2.5-1.5b": dict(_QWEN, model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         max_position_embeddings=32768),
    # a directory holding Qwen3-32B with the model card's rope_scaling added to its config.json
    "qwen3-32b-yarn": dict(_QWEN3_32B, **_QWEN3_YARN),
    "qwen3-32b": _QWEN3_32B,
    "qwen3-30b-a3b": dict(_QWEN_MOE, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32),
    "qwen3-235b-a22b": dict(_QWEN_MOE, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64),
    "skywork-reward-v2-qwen3-0.6b": dict(_QWEN, model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                         head_dim=128, max_position_embeddings=40960),
}


def hf_config(model_name: str, key: str):
    """The transformers config of `model_name` (builtin:*, a local directory, or a name KNOWN_MODELS matches).
    key: the config key naming it, for the error."""
    builtin = model_name.startswith(BUILTIN_MODEL_PREFIX)
    if builtin and not model_name.startswith(BUILTIN_MODEL_PREFIX + "smollm2"):
        return builtin_config()  # the tiny ones; builtin:smollm2-135m-instruct is planned by its name below
    if not builtin and os.path.isfile(os.path.join(model_name, "config.json")):
        return AutoConfig.from_pretrained(model_name)
    base = os.path.basename(os.path.normpath(model_name.removeprefix(BUILTIN_MODEL_PREFIX))).lower()
    for prefix, values in KNOWN_MODELS.items():
        if base.startswith(prefix):
            values = dict(values)
            return AutoConfig.for_model(values.pop("model_type"), **values)
    raise ConfigError(f"{key}: '{model_name}' has no config.json and its name matches no known model "
                      f"({', '.join(KNOWN_MODELS)}); copy the model's config.json there (weights are not "
                      f"needed to plan)")


def decoder_spec(cfg, scalar_head: bool, tp: int = 1, pp: int = 1, megatron: bool = True,
                 layout_key: str = "policy.megatron_cfg") -> ModelSpec:
    """HF config -> ModelSpec at (tp, pp); megatron=False sizes any RoPE (the DTensor back end runs them all)."""
    return model_spec(cfg, tp, pp, scalar_head=scalar_head, any_rope=not megatron, layout_key=layout_key)


def _stored(spec: ModelSpec) -> list[HFTensor]:
    """The tensors that are tensors of their own (a tied lm_head is the embedding)."""
    return [t for t in hf_tensors(spec) if not (spec.tied and t.name == "lm_head.weight")]


def _on_tp_rank(t: HFTensor, spec: ModelSpec, tp: int, vocab_parallel: bool) -> int:
    """Elements of HF tensor t on one tensor-parallel rank: replicated ones whole; the vocabulary padded and
    split with vocab_parallel (Megatron), else whole (DTensor); the other linear weights / tp."""
    if t.kind == "copy" or (t.kind == "vocab" and not vocab_parallel):
        return math.prod(t.shape)
    if t.kind == "vocab":
        return spec.padded_vocab * t.shape[1] // tp
    return math.prod(t.shape) // tp


def total_params(spec: ModelSpec) -> int:
    """Parameters of the HF model (a tied lm_head counted once)."""
    return sum(math.prod(t.shape) for t in _stored(spec))


def active_params(spec: ModelSpec) -> int:
    """Parameters one token computes with: all of a dense model; of an MoE, its experts_per_token experts of
    every layer, not all its experts."""
    idle = spec.num_layers * 3 * spec.hidden * spec.moe_ffn * (spec.experts - spec.experts_per_token)
    return total_params(spec) - idle


def is_expert(t: HFTensor) -> bool:
    """A routed expert's tensor (HF's fused mlp.experts.*): Megatron splits these over the expert-parallel ranks."""
    return ".mlp.experts." in t.name


def megatron_stage_split(spec: ModelSpec, tp: int, pp: int, stage: int, ep: int = 1) -> tuple[int, int]:
    """(non-expert, expert) parameters of one rank of pipeline stage `stage` under TP tp and EP ep: split tensors
    / tp (the vocabulary padded to spec.padded_vocab), replicated ones (norms, routers) whole; the routed experts
    / ep and whole over tp (expert tensor parallel size 1, as Megatron-Core's MoE recipes set it). With tied
    embeddings and pp > 1 the last stage holds its own copy of the embedding as output layer."""
    on_stage = [t for t in _stored(spec) if pipeline_stage(t, spec, pp) == stage]
    dense = sum(_on_tp_rank(t, spec, tp, vocab_parallel=True) for t in on_stage if not is_expert(t))
    if spec.tied and pp > 1 and stage == pp - 1:
        dense += spec.padded_vocab * spec.hidden // tp
    return dense, sum(math.prod(t.shape) for t in on_stage if is_expert(t)) // ep


def megatron_stage_params(spec: ModelSpec, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """All parameters of one rank of `stage` (megatron_stage_split's two parts)."""
    return sum(megatron_stage_split(spec, tp, pp, stage, ep))


def dtensor_rank_params(spec: ModelSpec, tp: int, dp: int) -> int:
    """Parameters one rank holds between steps under DTensor: the decoder layers' linear weights split over tp
    (embedding, lm_head and norms replicated over tp), then everything sharded over dp by FSDP2."""
    return -(-sum(_on_tp_rank(t, spec, tp, vocab_parallel=False) for t in _stored(spec)) // dp)


def largest_tensor(spec: ModelSpec) -> int:
    """Elements of the largest HF tensor (the embedding, or a layer's fused experts [E, 2F, H]): what the DTensor
    back end's sharded load reads at most at once (dtensor/loading.py; it reads only a rank's slice of each)."""
    return max(math.prod(t.shape) for t in _stored(spec))


def largest_fsdp_unit(spec: ModelSpec, tp: int, lora_per_layer: int = 0) -> int:
    """Parameters of the largest FSDP2 unit one rank all-gathers for a forward: a decoder layer (/tp, with its
    `lora_per_layer` adapter parameters) or the root module (embedding, final norm, lm_head or score:
    replicated over tp)."""
    layer = [t for t in hf_tensors(spec) if t.layer == 0]
    local_layer = sum(_on_tp_rank(t, spec, tp, vocab_parallel=False) for t in layer) + lora_per_layer
    root = total_params(spec) - spec.num_layers * sum(math.prod(t.shape) for t in layer)
    return max(local_layer, root)


def lora_layer_params(spec: ModelSpec, targets: list[str], rank: int, tp: int) -> int:
    """LoRA adapter parameters of one decoder layer on one tensor-parallel rank: A [rank, in] and B [out, rank] per
    targeted HF linear (leaf names, models/lora.py). Column-parallel layers (q, k, v, gate, up: split on out) keep
    A whole and B / tp; row-parallel ones (o_proj, down_proj: split on in) A / tp and B whole. Both back ends
    place them so (Megatron: one adapter per HF projection on its fused linear_qkv / linear_fc1)."""
    n = 0
    for t in hf_tensors(spec):
        leaf = t.name.split(".")[-2]
        if t.layer == 0 and t.name.endswith(".weight") and leaf in targets:
            out, inp = t.shape
            n += rank * inp // tp + out * rank if t.kind == "col" else rank * inp + out * rank // tp
    return n
