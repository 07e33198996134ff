"""Mixture-of-Experts models at config time: the DTensor back end takes Qwen3-MoE (HF's own model under FSDP2);
the Megatron back end does not build experts yet and says so, naming the key, before any worker starts.
(Parity with HF is in tests/functional/test_dtensor_policy.py.)"""

import pytest

from nemo_grpo.config import PolicyConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.models.spec import moe_experts
from nemo_grpo.models.tiny import tiny_config
from nemo_grpo.validation import validate_model_layout


def test_moe_on_megatron_is_named_dtensor_takes_it(tmp_path):
    cfg = tiny_config("qwen3_moe")
    assert moe_experts(cfg) == 8 and moe_experts(tiny_config("qwen3")) == 0
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"config key 'policy.backend': megatron does not build Mixture-of-Experts "
                                          r"models yet \(.*: 8 experts\); use policy.backend=dtensor"):
        validate_model_layout(torch_engine(PolicyConfig(model_name=str(tmp_path), backend="megatron")), str(tmp_path))
    validate_model_layout(torch_engine(PolicyConfig(model_name=str(tmp_path), backend="dtensor")), str(tmp_path))


def test_moe_refit_into_vllm_is_named(tmp_path):
    tiny_config("qwen3_moe").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"config key 'policy.generation.backend': the refit of Mixture-of-Experts "
                                          r"weights into vLLM is not built yet .* policy.generation.backend=torch"):
        validate_model_layout(PolicyConfig(model_name=str(tmp_path), backend="dtensor"), str(tmp_path))


def torch_engine(cfg: PolicyConfig) -> PolicyConfig:
    cfg.generation.backend = "torch"
    return cfg
