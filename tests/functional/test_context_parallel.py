"""Context parallelism (backends/context_parallel.py) on both back ends against single-process Hugging Face.

Rows of up to 2,000 tokens on a tiny Qwen3 (GQA, q/k norms): log-probs within 1e-5 of HF and one optimizer step
within 1e-4 (policy_checks), per layout:
- Megatron CP=2; CP=2 x TP=2 + SP on packed rows; CP=2 x PP=2 with recompute; CP=2 x DP=2 with the distributed
  optimizer; CP=2 with LoRA (against peft);
- DTensor CP=2, and CP=2 on packed rows;
- a reward model's scores (the scalar head at each sequence's last token, wherever its CP rank) on Megatron CP=2.
Contiguous halves would agree with HF just as well, so every layout also asserts that each rank attended with
its load-balanced pair of chunks (r, 2·cp-1-r).
"""

import pytest
from lora_checks import check_lora_step, lora_policy_config
from policy_checks import (CLUSTER, assert_logprobs_match_hf, assert_scores_match_hf, check_on_policy_step,
                           check_train_parity, make_batch, policy_config)

from nemo_grpo.backends import context_parallel
from nemo_grpo.config import ClusterConfig

FOUR = ClusterConfig(gpus_per_node=4, num_nodes=1, num_threads_per_worker=1)
CP2 = {"megatron_cfg.context_parallel_size": 2}
PACKED = {"sequence_packing.enabled": True, "sequence_packing.train_mb_tokens": 4096,
          "sequence_packing.logprob_mb_tokens": 4096}
MEGATRON = {
    "cp2": (CLUSTER, CP2),
    "cp2_tp2_sp_packed": (FOUR, {**CP2, "megatron_cfg.tensor_model_parallel_size": 2,
                                 "megatron_cfg.sequence_parallel": True, **PACKED}),
    "cp2_pp2_recompute": (FOUR, {**CP2, "megatron_cfg.pipeline_model_parallel_size": 2,
                                 "megatron_cfg.activation_checkpointing": True}),
    "cp2_dp2_zero": (FOUR, {**CP2, "megatron_cfg.use_distributed_optimizer": True}),
}
DTENSOR = {"cp2": {"dtensor_cfg.context_parallel_size": 2},
           "cp2_packed": {"dtensor_cfg.context_parallel_size": 2, **PACKED}}


def qwen3(tiny_model_dir) -> str:
    return tiny_model_dir("qwen3", num_key_value_heads=2, max_position_embeddings=4096)


def attended_chunks(policy) -> list[set[str]]:
    """Per rank: the chunk pairs its CP attention ran with so far ("chunks 0,3" = chunks 0 and 3 of 4)."""
    return [set(names) for names in policy.group.run_all(
        "__ray_call__", lambda worker: [k for k in context_parallel.CALLS if k.startswith("chunks")])]


def check_layout(policy, path: str, cp_rank_of) -> None:
    """Log-probs of long rows, one train call, and the chunks each rank attended with."""
    assert_logprobs_match_hf(policy, path, make_batch(3, seed=0, t=2000))
    check_train_parity(policy, path, make_batch(4, seed=1, t=1001))  # odd: the row is padded to 2 x cp (x tp)
    for rank, chunks in enumerate(attended_chunks(policy)):
        r = cp_rank_of(rank)
        assert chunks == {f"chunks {r},{3 - r}"}, (rank, chunks)


@pytest.mark.parametrize("layout", list(MEGATRON))
def test_megatron_context_parallel_matches_hf(ray_cluster, policy_pool, tiny_model_dir, layout):
    path = qwen3(tiny_model_dir)
    cluster, overrides = MEGATRON[layout]
    cfg = policy_config(path, backend="megatron", **overrides)
    tp = cfg.megatron_cfg.tensor_model_parallel_size
    with policy_pool.policy(cfg, cluster, path) as policy:
        check_layout(policy, path, lambda rank: (rank // tp) % 2)


@pytest.mark.parametrize("layout", list(DTENSOR))
def test_dtensor_context_parallel_matches_hf(ray_cluster, policy_pool, tiny_model_dir, layout):
    path = qwen3(tiny_model_dir)
    with policy_pool.policy(policy_config(path, **DTENSOR[layout]), CLUSTER, path) as policy:
        check_layout(policy, path, lambda rank: rank % 2)


def test_megatron_context_parallel_lora_matches_peft(ray_cluster, policy_pool, tiny_model_dir):
    path = qwen3(tiny_model_dir)
    cfg = lora_policy_config(path, backend="megatron", **CP2)
    with policy_pool.policy(cfg, CLUSTER, path, init_reference=True) as policy:
        check_lora_step(policy, path, make_batch(8, seed=2, t=801))  # two steps: B moves, then A


@pytest.mark.parametrize("backend", ["dtensor", "megatron"])
def test_on_policy_step_equals_the_separate_logprob_pass(ray_cluster, policy_pool, tiny_model_dir, backend):
    """The exactly on-policy step (policy_checks.check_on_policy_step) where the training forward's log-probs are
    gathered over the CP group: DTensor CP=2 on packed rows, Megatron CP=2 with LoRA (the policies above)."""
    path = qwen3(tiny_model_dir)
    if backend == "dtensor":
        cfg, kwargs = policy_config(path, **DTENSOR["cp2_packed"]), {}
    else:
        cfg, kwargs = lora_policy_config(path, backend="megatron", **CP2), {"init_reference": True}
    with policy_pool.policy(cfg, CLUSTER, path, **kwargs) as policy:
        check_on_policy_step(policy, policy_pool.reset, make_batch(4, seed=6, t=301))


def test_megatron_context_parallel_scores_match_hf(ray_cluster, policy_pool, tiny_model_dir):
    path = tiny_model_dir("qwen3", scalar_head=True, num_key_value_heads=2, max_position_embeddings=4096)
    cfg = policy_config(path, backend="megatron", **CP2)
    with policy_pool.policy(cfg, CLUSTER, path, scalar_head=True) as policy:
        assert_scores_match_hf(policy, path, make_batch(5, seed=3, t=601))
