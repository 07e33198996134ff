"""The policy's side of a colocated refit: every bucket written into the shared region, cast to the engine's
dtype, equals the gathered export, on layouts where each rank writes its own shards in place (DTensor: FSDP
shards over dp, 2-D dp x tp shards, norms replicated over tp) and where rank 0 writes the gathered tensors
(Megatron TP=2)."""

import pytest
import torch
from weight_io import export_weights

from nemo_grpo.config import ClusterConfig, PolicyConfig
from nemo_grpo.policy import Policy
from nemo_grpo.weights import transfer as wt
from nemo_grpo.weights.refit import Senders
from nemo_grpo.weights.sender import WeightSender

LAYOUTS = {"dtensor_dp2": ("dtensor", 2, {}),
           "dtensor_dp2_tp2": ("dtensor", 4, {"dtensor_cfg.tensor_parallel_size": 2}),
           "megatron_tp2": ("megatron", 2, {"megatron_cfg.tensor_model_parallel_size": 2})}


def set_key(cfg, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        cfg = getattr(cfg, p)
    setattr(cfg, leaf, value)


@pytest.mark.parametrize("dtype", ["bfloat16", None])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_region_buckets_equal_the_export(ray_cluster, tiny_model_dir, layout, dtype):
    backend, ranks, overrides = LAYOUTS[layout]
    if dtype is None and layout != "dtensor_dp2":
        pytest.skip("one layout suffices for the uncast plan")
    path = tiny_model_dir("llama", seed=5)  # 55 vocabulary rows: FSDP's shards of the embedding are uneven
    cfg = PolicyConfig(model_name=path, backend=backend, precision="float32")
    for key, value in overrides.items():
        set_key(cfg, key, value)
    cluster = ClusterConfig(gpus_per_node=ranks, num_nodes=1, num_threads_per_worker=1)
    with Policy(cfg, cluster, path) as policy:
        expected = {k: v for bucket in export_weights(policy, 0.05) for k, v in bucket.items()}
        senders = Senders(policy.group.actors)
        info = senders.run(WeightSender.open_region, "region-test", 0.05, dtype)[0]
        region = wt.SharedRegion(info["path"], wt.region_nbytes(info["plan"]))  # mapped here before the policy removes the file
        regions = {info["host"]: info["path"]}
        assert senders.run(WeightSender.attach_region, "region-test", regions)[0]  # every rank mapped it
        written = [senders.run(WeightSender.write_bucket, "region-test", i)[0] for i in range(len(info["plan"]))]
        assert len(info["plan"]) > 3 and sum(written) == sum(s.nbytes for b in info["plan"] for s in b)
        seen = {}
        for bucket, flats in zip(info["plan"], wt.bucket_buffers(region.tensor, info["plan"])):
            seen.update(wt.unpack(flats, bucket))
        assert list(seen) == list(expected)
        for name, tensor in expected.items():
            want = tensor.to(getattr(torch, dtype)) if dtype else tensor
            assert seen[name].dtype == want.dtype and torch.equal(seen[name], want), name
