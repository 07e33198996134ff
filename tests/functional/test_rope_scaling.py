"""RoPE scaling on the Megatron back end (Llama 3.1+ `llama3`, `linear`, `yarn`) against Hugging Face; on the
DTensor back end (`llama3`, `yarn`), whose model is built on the meta device and its rotary buffers recomputed.

Tiny Llama models whose HF config carries `rope_scaling`, with rows longer than original_max_position_embeddings
(64, rows up to 80 tokens) so that the scaled frequencies matter: of the 16 frequencies of head_dim 32 at
rope_theta 10000, 3 are kept, 2 are blended and 11 divided by the factor. The llama3 parameters differ from
Llama 3.1's (factor 8, 1, 4, 8192), which GPTModel's own rope_scaling flag would assume.

YaRN on a tiny Qwen3 (q/k norms before the rotation), factor 4 over 64 original positions, rows of 240 tokens.
(A type the Megatron back end does not build is a ConfigError: tests/unit/test_rope_spec.py.)
"""

import json

import pytest
import torch
from policy_checks import (CLUSTER, assert_logprobs_match_hf, check_train_parity, hf_logprobs, load_hf, make_batch,
                           policy_config)
from test_mcore_policy import megatron_policy

from nemo_grpo.policy import Policy


LLAMA3 = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=2.0,
              original_max_position_embeddings=64)
LONG = 80  # > original_max_position_embeddings
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
YARN_LONG = 240  # > 3 x original_max_position_embeddings; max_position_embeddings 256 = factor x original


def scaled_llama(tiny_model_dir, rope_scaling: dict) -> str:
    return tiny_model_dir("llama", num_key_value_heads=2, tie_word_embeddings=False, rope_theta=10000.0,
                          rope_scaling=rope_scaling)


def yarn_qwen3(tiny_model_dir) -> str:
    return tiny_model_dir("qwen3", num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=256,
                          rope_scaling=YARN)


def with_rope(model, rope: dict):
    """The HF model with its rotary embedding rebuilt for other RoPE parameters (same weights), in eval mode."""
    model.config.rope_parameters = dict(rope, rope_theta=10000.0)
    model.model.rotary_emb.__init__(model.config)
    return model.eval()


def test_scaling_changes_the_logprobs(tiny_model_dir):
    """The parity below is not vacuous: HF's log-probs of the same weights without the scaling differ."""
    path = scaled_llama(tiny_model_dir, LLAMA3)
    batch = make_batch(3, seed=11, t=LONG)
    scaled = load_hf(path).eval()
    plain = with_rope(load_hf(path), {"rope_type": "default"})
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


def test_yarn_changes_the_logprobs(tiny_model_dir):
    """Both halves of YaRN move HF's own log-probs by more than 1e-2: the frequencies (against plain RoPE) and
    the attention factor (against YaRN's frequencies with attention_factor 1), so the parity below checks both."""
    path = yarn_qwen3(tiny_model_dir)
    batch = make_batch(3, seed=15, t=YARN_LONG)
    with torch.no_grad():
        yarn = hf_logprobs(load_hf(path).eval(), batch)
        plain = hf_logprobs(with_rope(load_hf(path), {"rope_type": "default"}), batch)
        no_factor = hf_logprobs(with_rope(load_hf(path), dict(YARN, attention_factor=1.0)), batch)
    print(f"YaRN moves HF's log-probs by {(yarn - plain).abs().max():.2e}, its attention factor by "
          f"{(yarn - no_factor).abs().max():.2e}")
    assert (yarn - plain).abs().max().item() > 1e-2
    assert (yarn - no_factor).abs().max().item() > 1e-2


def test_yarn_matches_hf(ray_cluster, tiny_model_dir):
    """Log-probs within 1e-5 of HF's and one train step (two Adam steps) at TP=2 with sequence parallelism."""
    path = yarn_qwen3(tiny_model_dir)
    with megatron_policy(None, path, "tp2_sp", logprob_batch_size=4) as policy:
        assert_logprobs_match_hf(policy, path, make_batch(5, seed=16, t=YARN_LONG))
        check_train_parity(policy, path, make_batch(8, seed=17, t=YARN_LONG))


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_dtensor_scaling_matches_hf(ray_cluster, tiny_model_dir, rope):
    """DTensor at TP=2: the inv_freq (and YaRN's attention factor) of the model built on the meta device
    (backends/dtensor/loading.py recomputes the rotary buffers) give HF's log-probs on rows past the original
    positions."""
    path, t = (scaled_llama(tiny_model_dir, LLAMA3), LONG) if rope == "llama3" else (yarn_qwen3(tiny_model_dir),
                                                                                        YARN_LONG)
    with Policy(policy_config(path, **{"dtensor_cfg.tensor_parallel_size": 2}), CLUSTER, path) as policy:
        assert_logprobs_match_hf(policy, path, make_batch(5, seed=18, t=t))
