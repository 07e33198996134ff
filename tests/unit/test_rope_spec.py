"""RoPE scaling as ModelSpec reads it from an HF config: YaRN's frequencies and attention factor against a hand
computation, and a type the Megatron back end does not build named at config time. (Log-prob parity with HF is
in tests/functional/test_rope_scaling.py.)"""

import math

import pytest
import torch

from nemo_grpo.config import PolicyConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.models.spec import model_spec
from nemo_grpo.models.tiny import tiny_config
from nemo_grpo.validation import validate_model_layout


def yarn_spec(**rope):
    cfg = tiny_config("qwen3", rope_theta=10000.0, max_position_embeddings=256, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=64, **rope))
    return model_spec(cfg).rope_scaling


def test_yarn_frequencies_and_attention_factor_by_hand():
    """head_dim 32, theta 1e4, 64 original positions, beta 32 / 1: the correction range is dims [0, 5] (YaRN's
    eq. for the dim of r rotations, floored / ceiled), so frequency 0 is kept, 5..15 are divided by the factor
    and 1..4 blended linearly between; the attention factor is 0.1 ln(factor) + 1."""
    s = yarn_spec()
    base = 10000.0 ** (-torch.arange(0, 32, 2, dtype=torch.float64) / 32)  # [16]
    ramp = (torch.arange(16, dtype=torch.float64) / 5).clamp(0, 1)  # 0: kept (extrapolated), 1: interpolated
    want = base * (1 - ramp) + base / 4 * ramp
    assert s.kind == "yarn" and s.factor == 4.0 and s.original_max_positions == 64
    assert torch.allclose(torch.tensor(s.inv_freq, dtype=torch.float64), want, rtol=1e-6)
    assert s.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    mscaled = yarn_spec(mscale=1.0, mscale_all_dim=0.5)  # DeepSeek's keys: a ratio of two such factors
    assert mscaled.attention_factor == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    assert yarn_spec(attention_factor=1.0).attention_factor == 1.0  # given: taken as is
    untruncated = yarn_spec(truncate=False)  # the range [-1.99, 4.03] unrounded changes frequency 1
    assert untruncated.inv_freq[0] == s.inv_freq[0] and untruncated.inv_freq[1] != s.inv_freq[1]


def test_rope_type_not_built_is_named_at_config_time(tmp_path):
    """Dynamic NTK, which the Megatron back end does not build: model_spec and the validation before any worker
    starts name the type and the key; the DTensor back end (HF's own model) takes it."""
    cfg = tiny_config("llama", rope_scaling=dict(rope_type="dynamic", factor=2.0))
    message = ("config key 'policy.model_name': the model's rope_type 'dynamic' is not built by the megatron back "
               r"end \(built: default, llama3, linear, yarn\); use policy.backend=dtensor")
    with pytest.raises(ConfigError, match=message):
        model_spec(cfg)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=message):
        validate_model_layout(PolicyConfig(model_name=str(tmp_path), backend="megatron"), str(tmp_path))
    validate_model_layout(PolicyConfig(model_name=str(tmp_path), backend="dtensor"), str(tmp_path))
    assert model_spec(cfg, any_rope=True).rope_scaling is None  # the planner sizes it as plain RoPE
