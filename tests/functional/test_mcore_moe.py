"""Qwen3-MoE (8 experts, top-2, renormalised top-k weights; every layer sparse) on the Megatron back end: its
MoELayer (TopKRouter, SequentialMLP experts, alltoall token dispatch over gloo) against the single-process
Hugging Face model, in one process, at DP=2 (experts replicated), at expert parallelism 2 (dp 2 x ep 2: each
rank holds 4 of the 8 experts, tokens exchanged all-to-all) and at dp 4 x ep 2 (each expert on two ranks, its
gradient summed over the expert-data-parallel group). One optimizer step per policy: routing is
discontinuous, so after a step the layouts' float differences may flip a near-tied top-k choice (see
test_dtensor_policy.py::test_qwen3_moe_matches_hf).
"""

import sys

import pytest
import ray
from policy_checks import (assert_logprobs_match_hf, check_checkpoint_resumes, check_train_parity, export_state,
                           load_hf, make_batch, max_diff, policy_config)
from test_mcore_policy import FOUR, megatron_policy

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # local_experts runs in the workers
# every policy of the module trains with both router losses (backends/router.py; HF's load-balancing loss)
ROUTER = {"megatron_cfg.moe_router_load_balancing_type": "aux_loss", "megatron_cfg.moe_aux_loss_coeff": 0.1,
          "megatron_cfg.moe_z_loss_coeff": 0.01}
EP2 = {"megatron_cfg.expert_model_parallel_size": 2, **ROUTER}


@pytest.mark.parametrize("layout,extra", [("tp1", ROUTER), ("dp2", ROUTER), ("dp2", EP2)], ids=["tp1", "dp2", "ep2"])
def test_moe_matches_hf(policy_pool, tiny_model_dir, layout, extra):
    """The export is the checkpoint bit for bit (the experts gathered from their EP ranks into HF's fused
    tensors), log-probs within 1e-5 of HF's, and one step's weights within 1e-4 of a single-process HF step with
    the same pre-clip norm (each expert's gradient counted once), whose loss has the router losses (HF's
    load-balancing loss, the z-loss); the step's moe/aux_loss, moe/z_loss and moe/load_imbalance are HF's."""
    path = tiny_model_dir("qwen3_moe")
    with megatron_policy(policy_pool, path, layout, **extra) as policy:
        ep = extra.get("megatron_cfg.expert_model_parallel_size", 1)
        assert policy.group.run_all("__ray_call__", local_experts) == [8 // ep] * policy.group.world_size
        assert max_diff(export_state(policy), load_hf(path).state_dict()) == 0.0
        assert_logprobs_match_hf(policy, path, make_batch(5, seed=7))
        check_train_parity(policy, path, make_batch(4, seed=1))


def local_experts(worker) -> int:
    """The experts a worker holds of its first layer."""
    return sum(1 for n in worker.params if n.startswith("decoder.layers.0.mlp.experts.") and n.endswith("fc1.weight"))


def test_ep2_checkpoint_resumes_in_one_process(policy_pool, tiny_model_dir, tmp_path):
    """A checkpoint saved at dp 2 x ep 2 (experts and their Adam moments gathered over the EP group) loads in one
    process with every expert and takes the same next step."""
    path = tiny_model_dir("qwen3_moe")
    with megatron_policy(policy_pool, path, "dp2", **EP2) as policy:
        check_checkpoint_resumes(policy, lambda: megatron_policy(policy_pool, path, "tp1", **ROUTER),
                                 make_batch(4, seed=3), str(tmp_path / "ckpt"))


def test_ep2_dp4_sums_expert_gradients_over_expert_data_parallel(policy_pool, tiny_model_dir):
    """dp 4 x ep 2 on 4 ranks: each expert lives on two ranks (expert-data-parallel group of 2), whose gradients
    are summed over that group, the shared weights' over all 4; the single-process step and norm."""
    path = tiny_model_dir("qwen3_moe")
    cfg = policy_config(path, backend="megatron", **EP2)
    with policy_pool.policy(cfg, FOUR, path) as policy:
        assert policy.group.run_all("__ray_call__", local_experts) == [4] * 4
        check_train_parity(policy, path, make_batch(4, seed=2))  # one row per rank, one step
