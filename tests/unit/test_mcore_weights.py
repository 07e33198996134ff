"""HF <-> Megatron weight mapping as pure functions: every TP x PP layout round-trips bit-exactly; errors name
the architecture or the size that does not split. (Parity with HF logits is in tests/functional/test_mcore_policy.py.)
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, MistralConfig

from nemo_grpo.backends.mcore import weights
from nemo_grpo.models.spec import model_spec
from nemo_grpo.models.tiny import tiny_config

# llama: GQA, untied lm_head; qwen2: qkv bias, tied; qwen3: GQA, q/k norms, tied
FAMILIES = {"llama": dict(num_key_value_heads=2, tie_word_embeddings=False), "qwen2": {},
            "qwen3": dict(num_key_value_heads=2)}


def hf_state(arch: str, scalar_head: bool = False) -> tuple[object, dict]:
    cfg = tiny_config(arch, num_hidden_layers=4, **FAMILIES[arch])
    torch.manual_seed(0)
    if scalar_head:
        cfg.num_labels = 1
        return cfg, AutoModelForSequenceClassification.from_config(cfg).state_dict()
    return cfg, AutoModelForCausalLM.from_config(cfg).state_dict()


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)]
CASES = [(arch, tp, pp) for arch in sorted(FAMILIES) for tp, pp in LAYOUTS] + [("qwen2", 4, 1)]  # 4 KV heads


@pytest.mark.parametrize("arch,tp,pp", CASES)
def test_round_trip_is_exact(arch, tp, pp):
    cfg, state = hf_state(arch)
    spec = model_spec(cfg, tp, pp)
    shards = {(r, p): weights.to_megatron(state.__getitem__, spec, tp, r, pp, p) for r in range(tp) for p in range(pp)}
    entries = weights.entries(spec, pp)
    assert sorted(e.hf for e in entries) == sorted(state)  # every HF tensor, tied lm_head included
    for e in entries:
        full = weights.to_hf(e, [shards[(r, e.stage)][e.mcore] for r in range(tp)], spec)
        assert full.shape == e.shape and torch.equal(full, state[e.hf]), e.hf
    sizes = {k: v.shape for k, v in shards[(0, 0)].items()}  # shards of a TP-split tensor are 1/tp of it
    qkv = sizes["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv[0] * tp == (spec.heads + 2 * spec.kv_heads) * spec.head_dim
    assert sizes["embedding.word_embeddings.weight"][0] * tp == spec.padded_vocab >= spec.vocab
    assert sum(1 for k in sizes if k.startswith("decoder.layers.")) > 0
    assert all(f"decoder.layers.{4 // pp}." not in k for k in sizes)  # a stage holds only its own layers


def test_tied_embedding_copy_on_last_stage():
    cfg, state = hf_state("qwen2")
    spec = model_spec(cfg, 1, 2)
    last = weights.to_megatron(state.__getitem__, spec, 1, 0, 2, 1)
    assert torch.equal(last["output_layer.weight"], state["model.embed_tokens.weight"])


def test_scalar_head_maps_score_weight():
    cfg, state = hf_state("qwen3", scalar_head=True)
    spec = model_spec(cfg, 2, 2, scalar_head=True)
    assert not spec.tied and "lm_head.weight" not in [e.hf for e in weights.entries(spec, 2)]
    last = weights.to_megatron(state.__getitem__, spec, 2, 1, 2, 1)
    assert torch.equal(last["output_layer.weight"], state["score.weight"])  # replicated over TP


def test_unknown_architecture_is_named():
    cfg = MistralConfig(hidden_size=64, num_attention_heads=2, intermediate_size=128, num_hidden_layers=2)
    cfg.architectures = ["MistralForCausalLM"]
    with pytest.raises(ValueError, match="MistralForCausalLM.*not supported.*Qwen3ForCausalLM"):
        model_spec(cfg)


def test_sizes_that_do_not_split_are_named():
    cfg, _ = hf_state("llama")
    with pytest.raises(ValueError, match="tensor_model_parallel_size': 3 .*num_attention_heads=4"):
        model_spec(cfg, tp=3)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size': 3 .*num_hidden_layers=4"):
        model_spec(cfg, pp=3)


def test_transformer_engine_spec_names_the_fused_norms():
    """TE's layer spec keeps the pre-attention / pre-MLP norms inside linear_qkv / linear_fc1 (TE is not
    installable on the CPU machine: these are the names Megatron's TE spec gives them)."""
    cfg, state = hf_state("qwen3")
    spec = model_spec(cfg, 2, 1, transformer_engine=True)
    names = {e.hf: e.mcore for e in weights.entries(spec)}
    assert names["model.layers.1.input_layernorm.weight"] == "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert names["model.layers.1.post_attention_layernorm.weight"] == "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    local = weights.to_megatron(state.__getitem__, spec, 2, 1, 1, 0)
    assert torch.equal(local["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"],
                       state["model.layers.0.post_attention_layernorm.weight"])
