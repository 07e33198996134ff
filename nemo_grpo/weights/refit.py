"""Refit, the driver's side: the policy's weights into the generation engine, in place, in one of NeMo RL's two
modes. The policy workers' side is `weights/sender.py` (WeightSender), the engine workers' `weights/receiver.py`
(WeightReceiver), the wire `weights/transfer.py`.

colocated (`policy.generation.colocated.enabled=true`): `engine.update_weights(policy.export_weights(mb))`;
  buckets of HF-named full tensors travel through Ray's object store.
non-colocated (`enabled=false`): the engine is a separate group of actors. Policy rank 0 and the engine's
  workers form a collective group of their own (gloo on CPU, NCCL when every member is on CUDA; see
  nemo_grpo/weights/transfer.py), set up at the first refit: policy rank 0 plans the buckets and
  opens the group's store, every engine worker gets the plan (names, shapes, dtypes) once and joins as rank
  1..n. Each refit then: the policy ranks gather a bucket's full tensors collectively (as the export does),
  rank 0 broadcasts it as one flat buffer per dtype, each engine worker receives into buffers of the planned
  layout and loads the bucket in place through its bucket-loading path (`begin_refit` / `load_bucket` /
  `finish_refit`). The driver only orchestrates: no tensor passes through it.

    refitter = make_refitter(policy, engine, cfg.policy.generation)
    stats = refitter.refit()  # {"seconds", "bytes", "buckets"} (+ "send_seconds": policy rank 0's part)
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Optional

import torch

from nemo_grpo.errors import ConfigError

TRANSFER_TIMEOUT_S = 600.0  # joining the transfer group, and each broadcast, fail after this long


class ObjectStoreRefitter:
    """Colocated mode: the policy's export buckets, through Ray's object store, into engine.update_weights."""

    def __init__(self, policy, engine, bucket_size_mb: float):
        self.policy, self.engine, self.bucket_size_mb = policy, engine, bucket_size_mb

    def refit(self) -> dict[str, float]:
        stats = {"bytes": 0.0, "buckets": 0.0}

        def counted(buckets: Iterator[dict[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
            for bucket in buckets:
                stats["bytes"] += sum(t.numel() * t.element_size() for t in bucket.values())
                stats["buckets"] += 1
                yield bucket

        start = time.perf_counter()
        self.engine.update_weights(counted(self.policy.export_weights(self.bucket_size_mb)))
        return {**stats, "seconds": time.perf_counter() - start}


class CollectiveRefitter:
    """Non-colocated mode: policy rank 0 broadcasts to the engine's workers over a group of their own.

    The group is named (`self.name`), so one policy can feed several engines, each over its own group.
    """

    def __init__(self, policy, engine, bucket_size_mb: float, timeout_s: float = TRANSFER_TIMEOUT_S):
        self.policy, self.engine, self.bucket_size_mb, self.timeout_s = policy, engine, bucket_size_mb, timeout_s
        self.name = f"refit-{uuid.uuid4().hex[:12]}"
        self.workers: Optional[list] = None  # the engine's actors, once the group is set up
        self.backend: Optional[str] = None

    def setup(self) -> None:
        """Plan on the policy, check the names on the engine, then everyone joins the group (once)."""
        import ray

        workers = self.engine.workers()
        info = self.policy.open_weight_transfer(self.name, self.bucket_size_mb, self.timeout_s)
        devices = ray.get([w.weight_transfer_device.remote() for w in workers])
        backend = "nccl" if info["device"] == "cuda" and all(d == "cuda" for d in devices) else "gloo"
        names = [s.name for bucket in info["plan"] for s in bucket]
        ray.get([w.check_weight_names.remote(names) for w in workers])  # fail before anyone blocks in a join
        world = 1 + len(workers)
        plan = ray.put(info["plan"])
        joins = self.policy.join_weight_transfer_async(self.name, world, backend)
        joins += [w.join_weight_transfer.remote(info["host"], info["port"], rank, world, backend, plan,
                                                self.timeout_s) for rank, w in enumerate(workers, start=1)]
        ray.get(joins)
        self.workers, self.backend = workers, backend

    def refit(self) -> dict[str, float]:
        import ray

        if self.workers is None:
            self.setup()
        start = time.perf_counter()
        sends = self.policy.send_weights_async(self.name)
        receives = [w.receive_weights.remote() for w in self.workers]
        sent = ray.get(sends + receives)[0]  # policy rank 0's {"bytes", "buckets", "seconds"}
        return {"bytes": sent["bytes"], "buckets": sent["buckets"], "seconds": time.perf_counter() - start,
                "send_seconds": sent["seconds"]}


def check_generation_resources(gen_cfg, on_gpus: bool) -> None:
    """Non-colocated generation on a GPU cluster needs devices of its own, named in the config."""
    res = gen_cfg.colocated.resources
    if on_gpus and (res.gpus_per_node is None or res.num_nodes is None):
        raise ConfigError("config key 'policy.generation.colocated.resources.gpus_per_node': non-colocated "
                          "generation (policy.generation.colocated.enabled=false) on GPUs needs devices of its "
                          "own: set policy.generation.colocated.resources.gpus_per_node and .num_nodes")


def make_refitter(policy, engine, gen_cfg, *, timeout_s: float = TRANSFER_TIMEOUT_S):
    """The refitter of policy.generation.colocated.enabled: ObjectStoreRefitter | CollectiveRefitter."""
    if gen_cfg.colocated.enabled:
        return ObjectStoreRefitter(policy, engine, gen_cfg.refit_bucket_size_mb)
    import ray

    check_generation_resources(gen_cfg, ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0)
    return CollectiveRefitter(policy, engine, gen_cfg.refit_bucket_size_mb, timeout_s)
