"""The clipping rule, written once (backends/optimizer.py), on both back ends: a step whose gradient norm is not
finite is skipped and counted; the weights and the optimizer stay as they were, and the next finite step runs."""

import sys

import pytest
import ray
import torch

from nemo_grpo.config import ClusterConfig, PolicyConfig
from nemo_grpo.policy import Policy

from policy_checks import TokenPGLoss, make_batch
from weight_io import export_weights

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def full_state(policy: Policy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for bucket in export_weights(policy, 1024.0) for k, v in bucket.items()}


@pytest.mark.parametrize("backend", ["dtensor", "megatron"])
def test_non_finite_gradient_skips_the_step(ray_cluster, tiny_model_dir, backend):
    cfg = PolicyConfig(backend=backend, precision="float32", train_global_batch_size=4, train_micro_batch_size=2,
                       max_grad_norm=1.0)
    batch = make_batch(4, seed=3)
    poisoned = dict(batch, advantages=batch["advantages"].clone())
    poisoned["advantages"][0, 3] = float("nan")  # one token's advantage: the loss and every gradient are nan
    with Policy(cfg, ClusterConfig(gpus_per_node=1), tiny_model_dir("qwen2")) as policy:
        before = full_state(policy)
        skipped = policy.train(poisoned, TokenPGLoss())
        after_skip = full_state(policy)
        stepped = policy.train(batch, TokenPGLoss())
        after_step = full_state(policy)
    assert skipped["skipped_steps"] == 1.0 and skipped["grad_norm"] != skipped["grad_norm"]  # nan
    assert all(torch.equal(before[k], after_skip[k]) for k in before)
    assert stepped["skipped_steps"] == 0.0 and 0 < stepped["grad_norm"] < float("inf")
    assert any(not torch.equal(before[k], after_step[k]) for k in before)
    assert all(torch.isfinite(v).all() for v in after_step.values())  # no nan moment survived in Adam
