"""Context parallelism on both back ends against a single-process Hugging Face model."""

import time

import pytest
import torch
from policy_checks import CLUSTER, assert_logprobs_match_hf, check_train_parity, make_batch, policy_config

from nemo_grpo.backends import context_parallel
from nemo_grpo.policy import Policy


def chunk_pairs(policy):
    return policy.group.run_all("__ray_call__", lambda w: sorted(k for k in context_parallel.CALLS if k.startswith("chunks")))


@pytest.mark.parametrize("t", [1000, 2000])
def test_megatron_cp2_logprobs(ray_cluster, tiny_model_dir, t):
    path = tiny_model_dir("qwen3", num_key_value_heads=2)
    cfg = policy_config(path, backend="megatron", **{"megatron_cfg.context_parallel_size": 2})
    with Policy(cfg, CLUSTER, path) as policy:
        t0 = time.time()
        assert_logprobs_match_hf(policy, path, make_batch(3, seed=0, t=t))
        t1 = time.time()
        check_train_parity(policy, path, make_batch(4, seed=1, t=t - 1))
        print("TIMES", t, t1 - t0, time.time() - t1, chunk_pairs(policy))


def test_dtensor_cp2(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen3", num_key_value_heads=2)
    cfg = policy_config(path, **{"dtensor_cfg.context_parallel_size": 2})
    with Policy(cfg, CLUSTER, path) as policy:
        assert_logprobs_match_hf(policy, path, make_batch(3, seed=0, t=1000))
        check_train_parity(policy, path, make_batch(4, seed=1, t=999))
        print("DT", chunk_pairs(policy))
