"""Refit: the policy's weights into the generation engine, in place, in one of NeMo RL's two modes.

colocated (`policy.generation.colocated.enabled=true`): `engine.update_weights(policy.export_weights(mb))`;
  buckets of HF-named full tensors travel through Ray's object store.
non-colocated (`enabled=false`): the engine is a separate group of actors. Policy rank 0 and the engine's
  workers form a collective group of their own (gloo on CPU, NCCL when every member is on CUDA; see
  nemo_grpo/distributed/weight_transfer.py), set up at the first refit: policy rank 0 plans the buckets and
  opens the group's store, every engine worker gets the plan (names, shapes, dtypes) once and joins as rank
  1..n. Each refit then: the policy ranks gather a bucket's full tensors collectively (as the export does),
  rank 0 broadcasts it as one flat buffer per dtype, each engine worker receives into buffers of the planned
  layout and loads the bucket in place through its bucket-loading path (`begin_refit` / `load_bucket` /
  `finish_refit`). The driver only orchestrates: no tensor passes through it.

    refitter = make_refitter(policy, engine, cfg.policy.generation)
    stats = refitter.refit()  # {"seconds", "bytes", "buckets"} (+ "send_seconds": policy rank 0's part)

The engine-worker side of the non-colocated mode is `WeightReceiver`, a mixin of both engines' worker actors.
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Optional

import torch

from nemo_grpo.distributed import weight_transfer as wt
from nemo_grpo.distributed.weight_transfer import TensorSpec

TRANSFER_TIMEOUT_S = 600.0  # joining the transfer group, and each broadcast, fail after this long


# ---------------------------------------------------------------------------------------------- driver side
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
    from nemo_grpo.config import ConfigError

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


# ---------------------------------------------------------------------------------------------- engine side
class WeightReceiver:
    """Mixin of an engine's worker actor: the receiving end of a CollectiveRefitter.

    The engine worker supplies `load_bucket(bucket)` (HF-named full tensors, loaded in place), and where it
    needs them `begin_refit()` / `finish_refit()` around a refit's buckets, `_weight_names()` (the names it
    accepts; None = not known) and `_weight_device()` (where its model lives).
    """

    _receiver: Optional[dict] = None

    def begin_refit(self) -> None:
        """Before a refit's first bucket."""

    def finish_refit(self) -> int:
        """After its last bucket (also after a failed one)."""
        return 0

    def load_bucket(self, bucket: dict[str, torch.Tensor]) -> int:
        raise NotImplementedError(f"{type(self).__name__} does not load weight buckets")

    def _weight_names(self) -> Optional[set[str]]:
        return None

    def _weight_device(self) -> torch.device:
        return torch.device("cpu")

    def weight_transfer_device(self) -> str:
        """"cuda" | "cpu": where received weights end up (NCCL is used only when every member says cuda)."""
        return self._weight_device().type

    def check_weight_names(self, names: list[str]) -> None:
        known = self._weight_names()
        unknown = sorted(n for n in names if n not in known) if known is not None else []
        if unknown:
            raise KeyError(f"refit: the engine's model has no parameter(s) {unknown[:5]}")

    def join_weight_transfer(self, host: str, port: int, rank: int, world_size: int, backend: str,
                             plan: list[list[TensorSpec]], timeout_s: float) -> None:
        """Join the transfer group as `rank`; `plan` is the layout of every refit's buckets, in order."""
        self.check_weight_names([s.name for bucket in plan for s in bucket])
        device = self._weight_device() if backend == "nccl" else torch.device("cpu")
        group = wt.join_group(host, port, rank, world_size, backend, timeout_s)
        self._receiver = {"group": group, "plan": plan, "device": device}

    def _receive_async(self, index: int) -> tuple[list, list[torch.Tensor]]:
        bucket = self._receiver["plan"][index]
        flats = wt.empty_buffers(bucket, self._receiver["device"])
        return wt.broadcast_async(self._receiver["group"], flats), flats

    def receive_weights(self) -> int:
        """One refit: receive every bucket of the plan and load it; returns the number of tensors loaded.

        Buffers are fresh per bucket: a loader may keep views of a bucket until a later one completes a
        layer (vLLM's layerwise reload). After a failed load the remaining buckets are still received (and
        dropped), so the sender is not left waiting; the error is raised at the end.
        """
        if self._receiver is None:
            raise RuntimeError("receive_weights: not in a weight-transfer group (join_weight_transfer first)")
        plan = self._receiver["plan"]
        error: Optional[BaseException] = None
        loaded = 0
        try:
            self.begin_refit()
        except Exception as e:
            error = e
        try:
            incoming = self._receive_async(0) if plan else None
            for index, bucket in enumerate(plan):
                works, flats = incoming
                wt.wait(works)
                if index + 1 < len(plan):  # bucket i + 1 arrives while bucket i is loaded
                    incoming = self._receive_async(index + 1)
                if error is None:
                    try:
                        loaded += self.load_bucket(wt.unpack(flats, bucket))
                    except Exception as e:  # keep the protocol in step; report after the last bucket
                        error = e
        finally:
            self.finish_refit()
        if error is not None:
            raise error
        return loaded
