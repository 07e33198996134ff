"""models/lora.py: targets, the refit's trained tensors, the shared initialisation, resuming a checkpoint."""

import pytest
import torch

from nemo_grpo.config import LoraConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.models import lora


def test_default_targets_are_every_linear_layer_and_exclusions_apply():
    assert lora.target_modules(LoraConfig()) == list(lora.LINEAR_LAYERS)
    assert lora.target_modules(LoraConfig(target_modules=["v_proj", "q_proj"], exclude_modules=["v_proj"])) == \
        ["q_proj"]


def test_refits_resend_whole_engine_layers():
    """An adapter on q_proj changes vLLM's fused qkv layer: q, k and v (weights and biases) go again; nothing
    outside a targeted layer does."""
    names = [f"model.layers.0.self_attn.{p}.{w}" for p in ("q_proj", "k_proj", "v_proj") for w in ("weight", "bias")]
    names += ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.up_proj.weight",
              "model.layers.0.mlp.gate_proj.weight", "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    assert lora.trained_names(names, ["q_proj", "up_proj"]) == set(names[:6]) | {
        "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_proj.weight"}


def test_initial_a_depends_on_seed_layer_and_projection_only():
    a = lora.initial_a("model.layers.1.self_attn.q_proj", (4, 64), seed=3)
    assert torch.equal(a, lora.initial_a("model.layers.1.self_attn.q_proj", (4, 64), seed=3))
    for other in (("model.layers.1.self_attn.k_proj", 3), ("model.layers.2.self_attn.q_proj", 3),
                  ("model.layers.1.self_attn.q_proj", 4)):
        assert not torch.equal(a, lora.initial_a(other[0], (4, 64), seed=other[1]))
    assert a.abs().max() <= 1 / 64 ** 0.5  # nn.Linear's Kaiming-uniform bound, a = sqrt(5): 1 / sqrt(fan_in)


@pytest.mark.parametrize("saved, now, key", [
    ({}, LoraConfig(enabled=True), "enabled"),  # a full-parameter checkpoint resumed with LoRA on
    ({"lora": {"enabled": True, "rank": 8}}, LoraConfig(), "enabled"),
    ({"lora": {"enabled": True, "rank": 8}}, LoraConfig(enabled=True, rank=16), "rank"),
    ({"lora": {"enabled": True, "rank": 8, "target_modules": ["q_proj"]}}, LoraConfig(enabled=True), "target_modules"),
])
def test_a_checkpoint_resumes_only_with_its_lora_layout(saved, now, key):
    with pytest.raises(ConfigError, match=f"policy.lora.{key}'.*but the checkpoint ckpt/step_4 was trained with"):
        lora.check_resumable(saved, now, "ckpt/step_4")
    lora.check_resumable({"lora": {**LoraConfig().__dict__, **saved.get("lora", {})}},
                         LoraConfig(**{**LoraConfig().__dict__, **saved.get("lora", {})}), "ckpt/step_4")


def test_a_reward_model_trains_without_lora():
    with pytest.raises(ConfigError, match="policy.lora.enabled'.*reward model"):
        lora.validate_lora(LoraConfig(enabled=True), scalar_head=True)


def test_adapter_specs_are_what_peft_puts_on_the_model():
    """The adapter refit's plan (names, shapes) equals peft's adapters on the HF model: targets only, routed experts
    aside, A [r, in] and B [out, r] under peft's saved keys; the engine side's names (adapter_names) agree."""
    import peft
    from transformers import AutoModelForCausalLM

    from nemo_grpo.models.tiny import tiny_config
    from nemo_grpo.weights.transfer import TensorSpec

    cfg = LoraConfig(enabled=True, rank=4, target_modules=["q_proj", "v_proj", "down_proj"])
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64, num_key_value_heads=2))
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items()]
    want = peft.get_peft_model_state_dict(peft.get_peft_model(model, lora.peft_config(cfg)))
    got = lora.adapter_specs(specs, cfg)
    assert {s.name: s.shape for s in got} == {k: tuple(v.shape) for k, v in want.items()}
    assert all(s.dtype == torch.float32 for s in got)
    assert lora.adapter_names([s.name for s in specs], cfg) == set(want)
    assert lora.adapted_modules(["model.layers.0.mlp.experts.3.down_proj.weight"], ["down_proj"]) == []


def test_lora_refit_is_adapters_or_merged():
    assert lora.refits_adapters(LoraConfig(enabled=True)) and not lora.refits_adapters(LoraConfig())
    assert not lora.refits_adapters(LoraConfig(enabled=True, refit="merged")) and not lora.refits_adapters(None)
    with pytest.raises(ConfigError, match="policy.lora.refit'.*'weights' is not one of adapters, merged"):
        lora.validate_lora(LoraConfig(enabled=True, refit="weights"))


def test_vllm_lora_settings_follow_policy_lora():
    """vLLM takes max_lora_rank from a fixed set: the smallest >= policy.lora.rank; its LoRA layers are its fused
    linears that hold a target."""
    from nemo_grpo.generation.vllm_engine import lora_kwargs

    kwargs = lora_kwargs(LoraConfig(enabled=True, rank=4, target_modules=["k_proj", "up_proj"]))
    assert kwargs == {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8,
                      "lora_target_modules": ["qkv_proj", "gate_up_proj"]}
    assert lora_kwargs(LoraConfig(enabled=True, rank=16))["max_lora_rank"] == 16 and lora_kwargs(None) == {}
    with pytest.raises(ValueError, match="policy.lora.refit=merged"):
        lora_kwargs(LoraConfig(enabled=True, rank=1024))
