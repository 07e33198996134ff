"""The HF config of a model to plan (`hf_config`) and its ModelSpec (`decoder_spec`); parameter counts are
models/counts.py's, per rank the back ends' memory models'.

A model is described by its HF config: the `config.json` of the local directory when it exists, else the
published config of a known model family matched on the directory's name (so a plan can be made before the
weights are downloaded): see `KNOWN_MODELS`.
"""

from __future__ import annotations

import os

from transformers import AutoConfig

from nemo_grpo.config import BUILTIN_MODEL_PREFIX, ConfigError
from nemo_grpo.models.builtin import builtin_config
from nemo_grpo.models.spec import ModelSpec, model_spec

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


def decoder_spec(cfg, scalar_head: bool, tp: int = 1, pp: int = 1, any_rope: bool = False) -> ModelSpec:
    """HF config -> ModelSpec at (tp, pp); any_rope sizes a RoPE scaling that not every back end builds."""
    return model_spec(cfg, tp, pp, scalar_head=scalar_head, any_rope=any_rope)
