"""Refit, the driver's side: the policy's weights into the generation engine, in place, in one of NeMo RL's two
modes. The policy workers' side is `weights/sender.py` (WeightSender), the engine workers' `weights/receiver.py`
(WeightReceiver), the wire `weights/transfer.py`.

colocated (`policy.generation.colocated.enabled=true`): one region of host shared memory holds the whole
  plan (HF-named full tensors in the engine's dtype); the policy ranks write their shards into it in place
  (DTensor; Megatron gathers to rank 0, which writes), the engine's workers map it once and load each bucket
  from it in place (`begin_refit` / `load_region_bucket` / `finish_refit`) while the next one is written.
non-colocated (`enabled=false`): the engine is a separate group of actors. Policy rank 0 and the engine's
  workers form a collective group of their own (gloo on CPU, NCCL when every member is on CUDA; see
  nemo_grpo/weights/transfer.py), set up at the first refit: policy rank 0 plans the buckets (in the
  engine's dtype) and opens the group's store, every engine worker gets the plan (names, shapes, dtypes) once
  and joins as rank 1..n. Each refit then: the policy ranks write a bucket into the policy node's shared
  region (as in the colocated mode), rank 0 broadcasts it from there as one flat buffer per dtype while the
  next one is written, each engine worker receives into buffers of the planned layout and loads the bucket
  through its bucket-loading path (`begin_refit` / `load_bucket` / `finish_refit`).
In both modes the driver only orchestrates: no tensor passes through it.

    refitter = make_refitter(policy, engine, cfg.policy.generation)
    stats = refitter.refit()  # {"seconds", "bytes", "buckets"} (+ "send_seconds": policy rank 0's part)
"""

from __future__ import annotations

import time
import uuid
from typing import Optional

import ray

from nemo_grpo.errors import ConfigError

TRANSFER_TIMEOUT_S = 600.0  # joining the transfer group, and each broadcast, fail after this long
DEAD_ACTOR_GRACE_S = 30.0  # after a failed refit, how long Ray may take to report a receiver's death


class SharedMemoryRefitter:
    """Colocated mode: the policy ranks write the weights, in the engine's dtype, into a region of host shared
    memory that the engine's workers have mapped, bucket by bucket; each worker loads bucket i from there in
    place while the policy writes bucket i + 1. The driver passes only the writes' ObjectRefs."""

    def __init__(self, policy, engine, bucket_size_mb: float):
        self.policy, self.engine, self.bucket_size_mb = policy, engine, bucket_size_mb
        self.name = f"refit-{uuid.uuid4().hex[:12]}"
        self.workers: Optional[list] = None  # the engine's actors, once the region is set up
        self.plan: list = []
        self.first = 0  # the first bucket a refit sends: 0, then (LoRA) the first of what training changes

    def setup(self) -> None:
        """Plan in the engine's dtype, create the region, map it on the engine's workers, then on the policy."""
        workers = self.engine.workers()
        info = self.policy.open_weight_region(self.name, self.bucket_size_mb, engine_dtype(workers))
        hosts = ray.get([w.node_ip.remote() for w in workers])
        if any(h != info["host"] for h in hosts):
            raise RuntimeError(f"colocated refit: the engine's workers run on {sorted(set(hosts))}, policy rank 0 on "
                               f"{info['host']}; colocated generation shares the policy's node (or set "
                               "policy.generation.colocated.enabled=false)")
        plan = ray.put(info["plan"])
        ray.get([w.attach_weight_region.remote(info["path"], plan) for w in workers])
        self.policy.attach_weight_region(self.name, info["host"], info["path"])
        self.workers, self.plan, self.trained_from = workers, info["plan"], info["trained_from"]

    def refit(self) -> dict[str, float]:
        if self.workers is None:
            self.setup()
        start = time.perf_counter()
        opened = [w.begin_refit.remote() for w in self.workers]
        writes, loads = [], []
        for index in range(self.first, len(self.plan)):
            written = self.policy.write_weight_bucket_async(self.name, index)
            writes.append(written[0])
            loads += [w.load_region_bucket.remote(index, *written) for w in self.workers]
        try:
            ray.get(opened + loads)
        finally:
            ray.get([w.finish_refit.remote() for w in self.workers])  # always closed, so the engine can generate
        self.first = self.trained_from
        return {"bytes": float(sum(ray.get(writes))), "buckets": float(len(writes)),
                "seconds": time.perf_counter() - start}

    def close(self) -> None:
        """Unmap the region everywhere (a later refit sets it up again)."""
        close_transfer(self)


def close_transfer(refitter) -> None:
    """Forget a refitter's transfer on the policy and the engine's workers, if it was set up."""
    if refitter.workers is not None:
        refitter.policy.close_weight_transfer(refitter.name)
        ray.get([w.close_weight_transfer.remote() for w in refitter.workers])
        refitter.workers, refitter.first = None, 0


def engine_dtype(workers: list) -> str:
    """The dtype every engine worker holds its weights in (they must agree)."""
    dtypes = set(ray.get([w.weight_dtype.remote() for w in workers]))
    if len(dtypes) != 1:
        raise RuntimeError(f"refit: the engine's workers hold weights in different dtypes {sorted(dtypes)}")
    return dtypes.pop()


class CollectiveRefitter:
    """Non-colocated mode: policy rank 0 broadcasts to the engine's workers over a group of their own.

    The group is named (`self.name`), so one policy can feed several engines, each over its own group.
    """

    def __init__(self, policy, engine, bucket_size_mb: float, timeout_s: float = TRANSFER_TIMEOUT_S):
        self.policy, self.engine, self.bucket_size_mb, self.timeout_s = policy, engine, bucket_size_mb, timeout_s
        self.name = f"refit-{uuid.uuid4().hex[:12]}"
        self.workers: Optional[list] = None  # the engine's actors, once the group is set up
        self.backend: Optional[str] = None
        self.first = 0  # as SharedMemoryRefitter's

    def setup(self) -> None:
        """Plan on the policy, check the names on the engine, then everyone joins the group (once)."""
        workers = self.engine.workers()
        info = self.policy.open_weight_transfer(self.name, self.bucket_size_mb, engine_dtype(workers),
                                                self.timeout_s)
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
        self.workers, self.backend, self.trained_from = workers, backend, info["trained_from"]

    def refit(self) -> dict[str, float]:
        if self.workers is None:
            self.setup()
        start = time.perf_counter()
        sends = self.policy.send_weights_async(self.name, self.first)
        receives = [w.receive_weights.remote(self.first) for w in self.workers]
        pending = sends + receives
        try:
            while pending:  # a failed member (a dead engine actor) raises at once, not after the others time out
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
        except ray.exceptions.RayTaskError:
            _raise_if_a_receiver_died(receives, DEAD_ACTOR_GRACE_S)
            raise
        sent = ray.get(sends[0])  # policy rank 0's {"bytes", "buckets", "seconds"}
        self.first = self.trained_from
        return {"bytes": sent["bytes"], "buckets": sent["buckets"], "seconds": time.perf_counter() - start,
                "send_seconds": sent["seconds"]}

    def close(self) -> None:
        """Leave the group and drop its buffers everywhere (a later refit sets it up again, with a new name)."""
        close_transfer(self)
        self.name = f"refit-{uuid.uuid4().hex[:12]}"


def _raise_if_a_receiver_died(receives: list, grace_s: float) -> None:
    """A sender's collective fails (gloo: connection reset) as soon as a receiving engine actor dies, often
    before Ray reports the death: wait up to grace_s for the receivers' results and raise a RayActorError
    among them, so the caller sees the dead engine rather than the sender's symptom."""
    done, _ = ray.wait(receives, num_returns=len(receives), timeout=grace_s)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayTaskError:  # the receiver's own collective error: the same symptom
            continue


def check_generation_resources(gen_cfg, on_gpus: bool) -> None:
    """Non-colocated generation on a GPU cluster needs devices of its own, named in the config."""
    res = gen_cfg.colocated.resources
    if on_gpus and (res.gpus_per_node is None or res.num_nodes is None):
        raise ConfigError("config key 'policy.generation.colocated.resources.gpus_per_node': non-colocated "
                          "generation (policy.generation.colocated.enabled=false) on GPUs needs devices of its "
                          "own: set policy.generation.colocated.resources.gpus_per_node and .num_nodes")


def make_refitter(policy, engine, gen_cfg, *, timeout_s: float = TRANSFER_TIMEOUT_S):
    """The refitter of policy.generation.colocated.enabled: SharedMemoryRefitter | CollectiveRefitter."""
    if gen_cfg.colocated.enabled:
        return SharedMemoryRefitter(policy, engine, gen_cfg.refit_bucket_size_mb)
    check_generation_resources(gen_cfg, ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0)
    return CollectiveRefitter(policy, engine, gen_cfg.refit_bucket_size_mb, timeout_s)
