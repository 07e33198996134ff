"""RoPE scaling on the Megatron back end (Llama 3.1+ `llama3`, `linear`) against Hugging Face.

Tiny Llama models whose HF config carries `rope_scaling`, with rows longer than original_max_position_embeddings
(64, rows up to 80 tokens) so that the scaled frequencies matter: of the 16 frequencies of head_dim 32 at
rope_theta 10000, 3 are kept, 2 are blended and 11 divided by the factor. The llama3 parameters differ from
Llama 3.1's (factor 8, 1, 4, 8192), which GPTModel's own rope_scaling flag would assume.
"""

import json

import pytest
import torch
from policy_checks import assert_logprobs_match_hf, check_train_parity, hf_logprobs, load_hf, make_batch, policy_config
from test_mcore_policy import megatron_policy

from nemo_grpo.errors import ConfigError
from nemo_grpo.models.spec import model_spec
from nemo_grpo.models.tiny import tiny_config
from nemo_grpo.validation import validate_model_layout

LLAMA3 = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0,
              original_max_position_embeddings=64)
LONG = 80  # > original_max_position_embeddings


def scaled_llama(tiny_model_dir, rope_scaling: dict) -> str:
    return tiny_model_dir("llama", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                          rope_scaling=rope_scaling)


def test_scaling_changes_the_logprobs(tiny_model_dir):
    """The parity below is not vacuous: HF's log-probs of the same weights without the scaling differ."""
    path = scaled_llama(tiny_model_dir, LLAMA3)
    batch = make_batch(3, seed=11, t=LONG)
    scaled = load_hf(path).eval()
    plain = load_hf(path).eval()
    plain.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    plain.model.rotary_emb.__init__(plain.config)
    with torch.no_grad():
        assert (hf_logprobs(scaled, batch) - hf_logprobs(plain, batch)).abs().max().item() > 1e-2


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp", "pp2"])
def test_llama3_scaling_matches_hf(ray_cluster, tiny_model_dir, layout, tmp_path):
    path = scaled_llama(tiny_model_dir, LLAMA3)
    batch = make_batch(5, seed=12, t=LONG)
    with torch.no_grad():
        ref = hf_logprobs(load_hf(path).eval(), batch)
    with megatron_policy(None, path, layout, logprob_batch_size=4) as policy:
        error = (policy.get_logprobs(batch) - ref).abs().max().item()
        print(f"llama3 RoPE scaling, {layout}: log-prob error against HF {error:.1e}")
        assert error <= 1e-5
        if layout == "tp2_sp":
            check_train_parity(policy, path, make_batch(4, seed=13, t=LONG))
        if layout == "tp1":
            policy.save_pretrained(str(tmp_path / "hf"))
    if layout == "tp1":
        with open(tmp_path / "hf" / "config.json") as f:
            saved = json.load(f)
        rope = saved.get("rope_parameters") or saved.get("rope_scaling")
        assert {k: rope[k] for k in LLAMA3} == LLAMA3
        assert load_hf(str(tmp_path / "hf")).config.rope_parameters["rope_type"] == "llama3"


def test_linear_scaling_matches_hf(ray_cluster, tiny_model_dir):
    path = scaled_llama(tiny_model_dir, dict(rope_type="linear", factor=2.0))
    with megatron_policy(None, path, "tp1", logprob_batch_size=4) as policy:
        assert_logprobs_match_hf(policy, path, make_batch(4, seed=14, t=LONG))


def test_rope_type_not_built_is_named_at_config_time(tiny_model_dir):
    yarn = dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=64)
    with pytest.raises(ConfigError, match="'policy.model_name': the model's rope_type 'yarn' is not built by the "
                                          "megatron back end .*use policy.backend=dtensor"):
        model_spec(tiny_config("llama", rope_scaling=yarn))
    path = scaled_llama(tiny_model_dir, yarn)
    with pytest.raises(ConfigError, match="'policy.model_name': the model's rope_type 'yarn'"):
        validate_model_layout(policy_config(path, backend="megatron"), path)  # before any worker starts
    validate_model_layout(policy_config(path, backend="dtensor"), path)  # DTensor runs HF's YaRN
