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
