"""Spare workers (nemo_grpo/distributed/spare_workers.py), which the whole session's policies share
(tests/conftest.py recycles PolicyActors, a class that knows nothing of it): a shut-down policy's worker
processes are torn down and kept, and the next policy of the same back end and size restarts them in place, as
another layout, model or back-end option, with results as a fresh process's. The rest of the suite runs on restarted workers too; this shows that the restart happens and that
nothing of the previous policy survives it (its process groups, Megatron's model-parallel state, its kernel
counts).
"""

import os

import pytest
from policy_checks import CLUSTER, assert_logprobs_match_hf, check_train_parity, make_batch, policy_config

from nemo_grpo.backends import varlen
from nemo_grpo.distributed import spare_workers
from nemo_grpo.policy import Policy


def worker_pids(policy) -> list[int]:
    return policy.group.run_all("__ray_call__", lambda worker: os.getpid())


def segment_calls(policy) -> list[int]:
    return policy.group.run_all("__ray_call__", lambda worker: varlen.CALLS["sdpa_segments"])


@pytest.mark.parametrize("backend,first,second", [
    ("megatron", {"megatron_cfg.tensor_model_parallel_size": 2, "megatron_cfg.sequence_parallel": True},
     {"megatron_cfg.pipeline_model_parallel_size": 2}),
    ("dtensor", {"dtensor_cfg.tensor_parallel_size": 2}, {}),
])
def test_a_restarted_worker_is_a_fresh_one(ray_cluster, tiny_model_dir, backend, first, second):
    """Policy 1 (a TP layout, packed rows: the per-segment kernel runs) is shut down; policy 2 (PP=2 / DP=2, another
    model) gets the same two processes, agrees with HF in log-probs and one step, and counts no kernel call of
    policy 1's."""
    spares = spare_workers.installed()
    assert spares is not None  # tests/conftest.py installs them for the session
    qwen2, llama = tiny_model_dir("qwen2"), tiny_model_dir("llama", num_key_value_heads=2)
    packed = {"sequence_packing.enabled": True, "sequence_packing.train_mb_tokens": 64,
              "sequence_packing.logprob_mb_tokens": 64, "sequence_packing.sequence_length_round": 4}
    with Policy(policy_config(qwen2, backend=backend, **first, **packed), CLUSTER, qwen2) as policy:
        pids = worker_pids(policy)
        assert_logprobs_match_hf(policy, qwen2, make_batch(5, seed=3))
        assert all(n > 0 for n in segment_calls(policy))
    restarts = spares.restarts
    with Policy(policy_config(llama, backend=backend, **second), CLUSTER, llama) as policy:
        assert spares.restarts == restarts + 1 and sorted(worker_pids(policy)) == sorted(pids)
        assert segment_calls(policy) == [0, 0]
        assert_logprobs_match_hf(policy, llama, make_batch(5, seed=4))
        check_train_parity(policy, llama, make_batch(4, seed=5))


def test_a_reservation_that_waits_evicts_spares(ray_cluster):
    """Kept spares hold their bundles; a new group that cannot be placed beside them kills the oldest spares
    until it can (as on one GPU: a kept DTensor policy holds the GPU that the next Megatron policy needs), and
    waits for nothing once the spares are gone."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from nemo_grpo.distributed.worker_group import _wait_evicting_spares

    free_cpus = int(ray.available_resources()["CPU"])
    hog = placement_group([{"CPU": 1.0}] * free_cpus, strategy="PACK")  # every free CPU, as a spare group's
    assert ray.wait([hog.ready()], timeout=30)[0]
    spares = spare_workers.SpareWorkers(max_workers=8)
    spares.keep(("hog",), spare_workers.SpareGroup(actors=[], placement_group=hog))
    previous = spare_workers.install(spares)
    wanted = placement_group([{"CPU": 1.0}], strategy="PACK")
    try:
        assert _wait_evicting_spares(wanted)
        assert (spares.groups, spares.evictions) == ([], 1)
    finally:
        spare_workers.install(previous)
        spares.clear()
        remove_placement_group(wanted)
