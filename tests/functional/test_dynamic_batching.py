"""Dynamic batching (policy.dynamic_batching) through the Policy front on both back ends: rows sorted by length
and cut under a token budget, the same number of micro-batches on every data-parallel rank. Log-probs, scores
and a train call match the single-process Hugging Face reference, as the fixed-size path does (its own parity
tests): one policy per layout, no fixed-size twin started beside it."""

import pytest
from policy_checks import (CLUSTER, assert_logprobs_match_hf, assert_scores_match_hf, check_train_parity, make_batch,
                           policy_config)

from nemo_grpo.backends.batching import token_budget_groups
from nemo_grpo.policy import Policy

BUDGET = {"dynamic_batching.enabled": True, "dynamic_batching.train_mb_tokens": 16,
          "dynamic_batching.logprob_mb_tokens": 36, "dynamic_batching.sequence_length_round": 4}
LAYOUTS = {"dtensor_dp2": ("dtensor", {}), "dtensor_tp2": ("dtensor", {"dtensor_cfg.tensor_parallel_size": 2}),
           "megatron_tp2_sp": ("megatron", {"megatron_cfg.tensor_model_parallel_size": 2,
                                            "megatron_cfg.sequence_parallel": True}),
           "megatron_dp2": ("megatron", {})}


SEED = 19  # lengths 12 3 5 5 | 7 8 6 7


def test_the_plan_mixes_micro_batch_sizes_and_needs_equalizing():
    """The test batch exercises both: DP rank 0's rows form micro-batches of 3 rows and 1 row, rank 1's a single
    one of 4 rows, which is split in two so that both ranks run 2 forwards."""
    lengths = make_batch(8, seed=SEED, t=12)["input_lengths"].tolist()
    budget = BUDGET["dynamic_batching.logprob_mb_tokens"]
    assert token_budget_groups(lengths[:4], budget, 4) == [[0, 2, 3], [1]]
    assert token_budget_groups(lengths[4:], budget, 4) == [[1, 0, 3, 2]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_results_as_fixed_micro_batches(ray_cluster, tiny_model_dir, layout):
    path = tiny_model_dir("qwen2")
    backend, overrides = LAYOUTS[layout]
    batch = make_batch(8, seed=SEED, t=12)
    with Policy(policy_config(path, backend=backend, train_micro_batch_size=2, **overrides, **BUDGET), CLUSTER,
                path) as dynamic:
        assert_logprobs_match_hf(dynamic, path, batch)
        metrics = check_train_parity(dynamic, path, batch)  # 2 optimizer steps of 4 rows (2 per DP rank)
    # micro-batches per step (rank 0's, mean of the 2 steps), where train_micro_batch_size=2 makes 1 (DP=2) or 2
    # (TP=2: one DP rank holds the 4 rows). Budget 16, lengths rounded to 4. DP=2: step 1 rank 0 [12] [3], rank 1
    # [5 5] split to match; step 2 [7 8] and [6 7]: 1.5. TP=2: step 1 [12] [5 5] [3], step 2 [7 8] [6 7]: 2.5.
    assert metrics["micro_batches"] == (1.5 if "dp2" in layout else 2.5)


def test_scores_of_a_reward_model(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen2", scalar_head=True)
    batch = make_batch(8, seed=SEED, t=12)
    with Policy(policy_config(path, "megatron", **BUDGET), CLUSTER, path, scalar_head=True) as dynamic:
        assert_scores_match_hf(dynamic, path, batch)
