"""Refit, the driver's side: the policy's weights into the generation engine, in place, in one of NeMo RL's two
modes. The policy workers' side is `weights/sender.py` (WeightSender over the back end's WeightSource), the
engine workers' `weights/receiver.py` (WeightReceiver over the engine's WeightSink), the wire
`weights/transfer.py`. A `Refitter` drives both ends through two handles, `Senders` (the policy's worker group)
and `Receivers` (the engine's workers), and owns a refit end to end: the engine's `prepare_for_refit`, the
set-up at the first refit, the buckets.

colocated (`policy.generation.colocated.enabled=true`): a region of host shared memory on each node that runs
  engine replicas holds the whole plan (HF-named full tensors in the engine's dtype). One node: the policy
  ranks write their shards into it in place (DTensor; Megatron gathers to rank 0, which writes). Several:
  rank 0 writes the gathered tensors into its node's region and broadcasts each bucket's bytes to the first
  policy rank of every other such node, which receives them into its node's region. The engine's workers map
  their node's region once and load each bucket from it in place (`begin_refit` / `load_region_bucket` /
  `finish_refit`) while the next one is written: each node's replicas read only their own node's memory.
non-colocated (`enabled=false`): the engine is a separate group of actors. Policy rank 0 and the engine's
  workers form a collective group of their own (gloo on CPU, NCCL when every member is on CUDA; see
  nemo_grpo/weights/transfer.py), set up at the first refit: policy rank 0 plans the buckets (in the
  engine's dtype) and opens the group's store, every engine worker gets the plan (names, shapes, dtypes) once
  and joins as rank 1..n. Each refit then: the policy ranks write a bucket into the policy node's shared
  region (as in the colocated mode), rank 0 broadcasts it from there as one flat buffer per dtype while the
  next one is written, each engine worker receives into buffers of the planned layout and loads the bucket
  through its bucket-loading path (`begin_refit` / `load_bucket` / `finish_refit`).
In both modes the driver only orchestrates: no tensor passes through it.
LoRA adapter refits (an engine started with LoRA: policy.lora.refit=adapters): the plan is the adapters (peft's
  keys, A [r, in] and B [out, r] per targeted linear, in the engine's dtype) instead of the HF state_dict, moved
  by the same machinery in either mode; the engine installs them as its LoRA adapter at finish_refit, and its
  base weights, loaded from the model directory at its start, never move.

    refitter = make_refitter(policy, engine, cfg.policy.generation)
    stats = refitter.refit()  # {"seconds", "bytes", "buckets"} (+ "nodes": regions written, colocated;
                              #  "send_seconds": policy rank 0's part, non-colocated)
"""

from __future__ import annotations

import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Optional, Protocol

import ray

from nemo_grpo.errors import ConfigError
from nemo_grpo.weights.receiver import WeightReceiver
from nemo_grpo.weights.sender import WeightSender

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 600.0  # joining the transfer group, and each broadcast, fail after this long
DEAD_ACTOR_GRACE_S = 30.0  # after a failed refit, how long Ray may take to report a receiver's death


class SenderHost(Protocol):
    """A policy rank's actor: a WeightSource holding its sending end."""

    weight_sender: WeightSender


class ReceiverHost(Protocol):
    """An engine worker's actor: a WeightSink holding its receiving end."""

    weight_receiver: WeightReceiver


def _on_sender(host: SenderHost, method: Callable, *args):
    return method(host.weight_sender, *args)


def _on_receiver(host: ReceiverHost, method: Callable, *args):
    return method(host.weight_receiver, *args)


class Senders:
    """The driver's handle to a policy's ranks (the actors of its WorkerGroup, each a SenderHost): runs a
    WeightSender method on every rank, e.g. `senders.run(WeightSender.open_region, name, 64.0, None)`."""

    def __init__(self, actors: list):
        self.actors = list(actors)

    def run_async(self, method: Callable, *args) -> list:
        """ObjectRefs of `method(rank's weight_sender, *args)` on every rank, by rank."""
        return [a.__ray_call__.remote(_on_sender, method, *args) for a in self.actors]

    def run(self, method: Callable, *args) -> list:
        return ray.get(self.run_async(method, *args))


class Receivers:
    """The driver's handle to an engine's workers (each a ReceiverHost and a WeightSink): runs a WeightReceiver
    method on every worker (`run`), or a WeightSink method by its declared name (`sink.*.remote()`)."""

    def __init__(self, actors: list):
        self.actors = list(actors)

    def run_async(self, method: Callable, *args) -> list:
        return [a.__ray_call__.remote(_on_receiver, method, *args) for a in self.actors]

    def run_each_async(self, method: Callable, args_per_worker: list[tuple]) -> list:
        """ObjectRefs of `method(worker's weight_receiver, *args_per_worker[i])` on worker i."""
        return [a.__ray_call__.remote(_on_receiver, method, *args) for a, args in zip(self.actors, args_per_worker)]

    def run(self, method: Callable, *args) -> list:
        return ray.get(self.run_async(method, *args))

    def prepare(self) -> None:
        """Every worker's WeightSink.prepare_for_refit (e.g. a sleeping vLLM takes its weights' memory back)."""
        ray.get([a.prepare_for_refit.remote() for a in self.actors])

    def dtype(self) -> str:
        """The dtype every worker holds its weights in (they must agree)."""
        return self._agreed(WeightReceiver.weight_dtype, "hold weights in different dtypes")

    def takes_adapters(self) -> bool:
        """Whether the workers take LoRA adapter refits (they must agree): the plan is then the adapters."""
        return self._agreed(WeightReceiver.takes_adapters, "disagree on LoRA adapter refits")

    def _agreed(self, method: Callable, disagreement: str):
        values = set(self.run(method))
        if len(values) != 1:
            raise RuntimeError(f"refit: the engine's workers {disagreement}: {sorted(values)}")
        return values.pop()


class Refitter(ABC):
    """One transfer from the policy (`senders`) into the engine (`receivers`), end to end: each refit prepares
    the engine, sets the transfer up the first time (`_setup`: the plan in the engine's dtype), then moves
    every bucket from `first` on (`_transfer`); after the first, only the buckets a train step changes."""

    def __init__(self, senders: Senders, receivers: Receivers, bucket_size_mb: float):
        self.senders, self.receivers, self.bucket_size_mb = senders, receivers, bucket_size_mb
        self.name = f"refit-{uuid.uuid4().hex[:12]}"
        self.ready = False  # set up (plan, region, group) and not closed since
        self.plan: list = []  # buckets of TensorSpecs, frozen ones first
        self.trained_from = 0  # the first bucket a train step can change
        self.first = 0  # the first bucket a refit sends: 0, then (LoRA) trained_from
        self.adapters = False  # the plan is the LoRA adapters (the engine takes adapter refits)

    def refit(self) -> dict[str, float]:
        """{"seconds", "bytes", "buckets"} (+ "send_seconds": policy rank 0's part, collective mode)."""
        self.receivers.prepare()
        if not self.ready:
            self._setup()
            self.ready = True
        start = time.perf_counter()
        stats = self._transfer(self.first)
        self.first = self.trained_from
        return {**stats, "seconds": time.perf_counter() - start}

    def close(self) -> None:
        """Forget the transfer on the policy and the engine's workers (a later refit sets it up again)."""
        if self.ready:
            self.senders.run(WeightSender.close, self.name)
            self.receivers.run(WeightReceiver.close)
            self.ready, self.first = False, 0
        self.name = f"refit-{uuid.uuid4().hex[:12]}"

    def _adopt(self, info: dict) -> None:
        self.plan, self.trained_from = info["plan"], info["trained_from"]
        if self.adapters:
            log.info("refit: LoRA adapters only, %d tensors, %.2f MB a refit (the engine keeps its base weights)",
                     sum(map(len, self.plan)), sum(s.nbytes for bucket in self.plan for s in bucket) / 1e6)

    @abstractmethod
    def _setup(self) -> None:
        """Plan the transfer on the policy and make both ends ready for it; `_adopt` its plan."""

    @abstractmethod
    def _transfer(self, first: int) -> dict[str, float]:
        """Move buckets `first`.. into the engine: {"bytes", "buckets"} (and what else the mode measures)."""


class SharedMemoryRefitter(Refitter):
    """Colocated mode: the policy ranks write the weights, in the engine's dtype, into a region of host shared
    memory that the engine's workers have mapped, bucket by bucket; each worker loads bucket i from there in
    place while the policy writes bucket i + 1. The driver passes only the writes' ObjectRefs."""

    regions = 0  # nodes with a region (set up at the first refit)

    def _setup(self) -> None:
        """Plan in the engine's dtype; a region on every node that runs engine replicas (rank 0's node: rank 0
        creates it; another: the node's first policy rank); map them on the engine's workers, then the policy."""
        self.adapters = self.receivers.takes_adapters()
        info = self.senders.run(WeightSender.open_region, self.name, self.bucket_size_mb, self.receivers.dtype(),
                                self.adapters)[0]
        rank_hosts = self.senders.run(WeightSender.node_ip)
        worker_hosts = self.receivers.run(WeightReceiver.node_ip)
        regions, leaders = {info["host"]: info["path"]}, []
        for host in dict.fromkeys(worker_hosts):
            if host in regions:
                continue
            if host not in rank_hosts:
                raise RuntimeError(f"colocated refit: an engine replica runs on {host}, where no policy rank runs "
                                   f"(policy ranks on {sorted(set(rank_hosts))}); colocated generation shares the "
                                   "policy's nodes (or set policy.generation.colocated.enabled=false)")
            leaders.append(rank_hosts.index(host))
            regions[host] = ray.get(self.senders.actors[leaders[-1]].__ray_call__.remote(
                _on_sender, WeightSender.create_region, self.name))
        plan = ray.put(info["plan"])
        ray.get(self.receivers.run_each_async(WeightReceiver.attach_region,
                                              [(regions[host], plan) for host in worker_hosts]))
        self.senders.run(WeightSender.attach_region, self.name, regions, leaders)
        self.regions = len(regions)
        if len(regions) > 1:
            writers = ", ".join(f"{host} (policy rank {rank})" for host, rank in zip(regions, [0, *leaders]))
            log.info("colocated refit: a weight region in the shared memory of each of %d nodes: %s", len(regions),
                     writers)
        self._adopt(info)

    def _transfer(self, first: int) -> dict[str, float]:
        workers = self.receivers.actors
        opened = [w.begin_refit.remote() for w in workers]
        writes, loads = [], []
        for index in range(first, len(self.plan)):
            written = self.senders.run_async(WeightSender.write_bucket, self.name, index)
            writes.append(written[0])
            loads += self.receivers.run_async(WeightReceiver.load_region_bucket, index, *written)
        try:
            ray.get(opened + loads)
        finally:
            ray.get([w.finish_refit.remote() for w in workers])  # always closed, so the engine can generate
        return {"bytes": float(sum(ray.get(writes))), "buckets": float(len(writes)), "nodes": float(self.regions)}


class CollectiveRefitter(Refitter):
    """Non-colocated mode: policy rank 0 broadcasts to the engine's workers over a group of their own.

    The group is named (`self.name`), so one policy can feed several engines, each over its own group.
    """

    def __init__(self, senders: Senders, receivers: Receivers, bucket_size_mb: float,
                 timeout_s: float = TRANSFER_TIMEOUT_S):
        super().__init__(senders, receivers, bucket_size_mb)
        self.timeout_s = timeout_s
        self.backend: Optional[str] = None

    def _setup(self) -> None:
        """Plan on the policy, check the names on the engine, then everyone joins the group (once)."""
        self.adapters = self.receivers.takes_adapters()
        info = self.senders.run(WeightSender.open_transfer, self.name, self.bucket_size_mb, self.receivers.dtype(),
                                self.timeout_s, self.adapters)[0]
        devices = self.receivers.run(WeightReceiver.transfer_device)
        backend = "nccl" if info["device"] == "cuda" and all(d == "cuda" for d in devices) else "gloo"
        names = [s.name for bucket in info["plan"] for s in bucket]
        self.receivers.run(WeightReceiver.check_names, names)  # fail before anyone blocks in a join
        world = 1 + len(self.receivers.actors)
        plan = ray.put(info["plan"])
        joins = self.senders.run_async(WeightSender.join_transfer, self.name, world, backend)
        joins += self.receivers.run_each_async(WeightReceiver.join_transfer, [
            (info["host"], info["port"], rank, world, backend, plan, self.timeout_s)
            for rank in range(1, world)])
        ray.get(joins)
        self.backend = backend
        self._adopt(info)

    def _transfer(self, first: int) -> dict[str, float]:
        sends = self.senders.run_async(WeightSender.send, self.name, first)
        receives = self.receivers.run_async(WeightReceiver.receive, first)
        pending = sends + receives
        try:
            while pending:  # a failed member (a dead engine actor) raises at once, not after the others time out
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
        except ray.exceptions.RayTaskError:
            _raise_if_a_receiver_died(receives, DEAD_ACTOR_GRACE_S)
            raise
        sent = ray.get(sends[0])  # policy rank 0's {"bytes", "buckets", "seconds"}
        return {"bytes": sent["bytes"], "buckets": sent["buckets"], "send_seconds": sent["seconds"]}


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


def make_refitter(policy, engine, gen_cfg, *, timeout_s: float = TRANSFER_TIMEOUT_S) -> Refitter:
    """The refitter of policy.generation.colocated.enabled (SharedMemoryRefitter | CollectiveRefitter) from
    `policy.group` (its WorkerGroup) to `engine.workers()`."""
    senders, receivers = Senders(policy.group.actors), Receivers(engine.workers())
    if gen_cfg.colocated.enabled:
        return SharedMemoryRefitter(senders, receivers, gen_cfg.refit_bucket_size_mb)
    check_generation_resources(gen_cfg, ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0)
    return CollectiveRefitter(senders, receivers, gen_cfg.refit_bucket_size_mb, timeout_s)
