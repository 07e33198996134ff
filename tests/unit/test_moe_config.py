"""Mixture-of-Experts models at config time: the DTensor back end takes Qwen3-MoE (HF's own model under FSDP2);
the Megatron back end does not build experts yet and says so, naming the key, before any worker starts. And the
expert tensors' two layouts. (Parity with HF is in tests/functional/test_dtensor_policy.py.)"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nemo_grpo.config import PolicyConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.models.experts import fused_expert_names, unfuse_experts
from nemo_grpo.models.spec import moe_experts
from nemo_grpo.models.tiny import tiny_config
from nemo_grpo.planning.params import active_params, decoder_spec, hf_config, total_params
from nemo_grpo.validation import validate_model_layout


def test_moe_on_megatron_is_named_dtensor_takes_it(tmp_path):
    cfg = tiny_config("qwen3_moe")
    assert moe_experts(cfg) == 8 and moe_experts(tiny_config("qwen3")) == 0
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"config key 'policy.backend': megatron does not build Mixture-of-Experts "
                                          r"models yet \(.*: 8 experts\); use policy.backend=dtensor"):
        validate_model_layout(PolicyConfig(model_name=str(tmp_path), backend="megatron"), str(tmp_path))
    validate_model_layout(PolicyConfig(model_name=str(tmp_path), backend="dtensor"), str(tmp_path))


def test_fused_experts_split_into_the_checkpoints_tensors():
    """transformers 5's fused layout -> each expert's checkpoint tensors (what vLLM's loader reads), by hand."""
    E, F, H = 3, 2, 4
    gate_up, down = torch.arange(E * 2 * F * H).view(E, 2 * F, H), torch.arange(E * H * F).view(E, H, F)
    p = "model.layers.0.mlp.experts"
    out = dict(unfuse_experts([(f"{p}.gate_up_proj", gate_up), (f"{p}.down_proj", down), ("x", down)]))
    assert torch.equal(out[f"{p}.2.gate_proj.weight"], gate_up[2, :F]) and torch.equal(out[f"{p}.2.up_proj.weight"],
                                                                                         gate_up[2, F:])
    assert torch.equal(out[f"{p}.1.down_proj.weight"], down[1]) and out["x"] is down and len(out) == 3 * E + 1
    assert fused_expert_names(out) == {f"{p}.gate_up_proj", f"{p}.down_proj"}


@pytest.mark.parametrize("name,total,active", [("Qwen3-30B-A3B", 30.53e9, 3.35e9), ("Qwen3-235B-A22B", 235.09e9,
                                                                                       22.19e9)])
def test_moe_parameter_counts_match_the_published_models(name, total, active):
    """The planner's counts from the published config (KNOWN_MODELS) against the HF model built on the meta
    device: 30.5B total / 3.3B active and 235B / 22B, as Qwen publishes them."""
    cfg = hf_config(name, "policy.model_name")
    spec = decoder_spec(cfg, scalar_head=False, megatron=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert total_params(spec) == sum(p.numel() for p in model.parameters())
    assert total_params(spec) == pytest.approx(total, rel=1e-3)
    assert active_params(spec) == pytest.approx(active, rel=1e-3)


def test_the_planner_refuses_moe_on_megatron_as_training_does():
    """`python -m nemo_grpo.plan` must not plan a Megatron MoE run that training would refuse."""
    cfg = hf_config("Qwen3-30B-A3B", "policy.model_name")
    with pytest.raises(ConfigError, match=r"config key 'policy.backend': megatron does not build Mixture-of-Experts "
                                          r"models yet \(qwen3_moe: 128 experts\)"):
        decoder_spec(cfg, scalar_head=False, megatron=True)
