"""Sequence packing (policy.sequence_packing) through the Policy front on both back ends: each DP rank's rows packed
into bins by first-fit-decreasing, each bin one row attended per sequence (backends/varlen.py) with per-sequence
position ids. Log-probs and one train call equal the single-process Hugging Face model run on the padded rows (so
the padded path too) and, within 1e-5, the dense block-diagonal mask's (sequence_packing.attention=mask); scores
those of Hugging Face's sequence classifier, at every layout."""

import pytest
from policy_checks import (CLUSTER, PACKING, assert_logprobs_match_hf, assert_scores_match_hf, check_train_parity,
                           check_varlen_equals_dense_mask, make_batch, policy_config)

from nemo_grpo.backends.batching import first_fit_decreasing
from nemo_grpo.policy import Policy

LAYOUTS = {"dtensor_dp2": ("dtensor", {}),
           "dtensor_tp2_recompute": ("dtensor", {"dtensor_cfg.tensor_parallel_size": 2,
                                                "dtensor_cfg.activation_checkpointing": True}),
           "megatron_tp2_sp": ("megatron", {"megatron_cfg.tensor_model_parallel_size": 2,
                                            "megatron_cfg.sequence_parallel": True}),
           "megatron_pp2_recompute": ("megatron", {"megatron_cfg.pipeline_model_parallel_size": 2,
                                                   "megatron_cfg.activation_checkpointing": True}),
           "megatron_dp2": ("megatron", {})}
SEED = 19  # lengths 12 3 5 5 | 7 8 6 7


def test_the_bins_mix_sizes():
    """Bins of the test batch: under DP=2, a rank's 2 rows of a step share one bin of 20 tokens; with one DP rank
    the 4 rows of step 1 fill a bin of three sequences and one of one; in get_logprobs 4 rows fit a bin of 40."""
    lengths = make_batch(8, seed=SEED, t=12)["input_lengths"].tolist()
    assert first_fit_decreasing(lengths[:2], 20) == [[0, 1]]
    assert first_fit_decreasing(lengths[:4], 20) == [[0, 2, 1], [3]]
    assert first_fit_decreasing(lengths[4:], 40) == [[1, 0, 3, 2]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_rows_match_hf(ray_cluster, tiny_model_dir, layout, tmp_path):
    path = tiny_model_dir("llama")
    backend, overrides = LAYOUTS[layout]
    batch = make_batch(8, seed=SEED, t=12)
    with Policy(policy_config(path, backend=backend, **overrides, **PACKING), CLUSTER, path) as packed:
        assert_logprobs_match_hf(packed, path, batch)
        metrics = check_train_parity(packed, path, batch)  # 2 optimizer steps of 4 rows (2 per DP rank)
        check_varlen_equals_dense_mask(packed, batch, str(tmp_path / "start"))
    # packed rows per step (rank 0's, mean of the 2 steps), budget 20. DP=2: step 1 [12 3] | [5 5], step 2 [7 8]
    # | [6 7]: 1 each. One DP rank (TP=2, PP=2): step 1 [12 5 3] [5], step 2 [8 7] [6 7]: 2.
    assert metrics["micro_batches"] == (1.0 if "dp2" in layout else 2.0)


@pytest.mark.parametrize("backend", ["dtensor", "megatron"])
def test_scores_of_a_reward_model(ray_cluster, tiny_model_dir, backend):
    path = tiny_model_dir("qwen2", scalar_head=True)
    batch = make_batch(8, seed=SEED, t=12)
    with Policy(policy_config(path, backend, **PACKING), CLUSTER, path, scalar_head=True) as packed:
        assert_scores_match_hf(packed, path, batch)
