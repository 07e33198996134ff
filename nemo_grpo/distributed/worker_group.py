"""A generic SPMD group of Ray actors: one actor per device, together one `torch.distributed` world.

Used by the Policy front (any back end) and meant for generation engines and the Megatron back end too.
The group reserves one placement-group bundle per rank (`{"CPU": 1}` on a CPU cluster, `{"GPU": 1, "CPU": 1}`
where Ray has GPUs), asks the node of bundle 0 for a free port, and starts `worker_cls` in every bundle with
the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so the
worker's constructor joins the process group with `init_torch_distributed()`, as under torchrun.

    group = WorkerGroup(MyWorker, cluster_cfg, name="policy", kwargs={...})
    group.run_all("method", arg)              # same call on every rank -> list of results, by rank
    group.run_each("method", [(a0,), (a1,)])   # per-rank arguments -> list of ObjectRefs
    group.shutdown()                           # kills the actors, frees the bundles; safe twice

Where spare workers are installed (spare_workers.py: the test suite) and recycle `worker_cls`, shutdown tears the
actors down and keeps them, and the next group of the same worker class (and kind), size and environment restarts
them in place.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import uuid
from typing import Any, Optional, Sequence

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_grpo.distributed import spare_workers
from nemo_grpo.distributed.cluster import WORKER_ENV
from nemo_grpo.distributed.interfaces import bind_interface
from nemo_grpo.distributed.spare_workers import kill_actors

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
TEARDOWN_TIMEOUT_S = 60.0
SPARE_EVICTION_WAIT_S = 2.0  # a reservation not ready this soon frees the oldest spare workers' bundles


STORE_PORTS = range(20000, 32768)  # below Linux's ephemeral range (32768-60999), where outgoing connections bind


def _node_address_and_free_port() -> tuple[str, int]:
    """(IP of this node, a TCP port free on it right now): run in bundle 0, i.e. on rank 0's node. The port is
    drawn below the ephemeral range: a port the OS hands out (bind to 0) may be taken by any outgoing connection
    before rank 0's store binds it (seen: EADDRINUSE when many process groups come and go)."""
    for port in random.sample(STORE_PORTS, 64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return ray.util.get_node_ip_address(), port
    raise RuntimeError(f"no free TCP port in {STORE_PORTS.start}-{STORE_PORTS.stop - 1} on this node after 64 tries")


def _wait_evicting_spares(pg) -> bool:
    """Wait for placement group `pg`; True once it is ready, False after PLACEMENT_TIMEOUT_S. Spare workers
    (spare_workers.py) keep their bundles: while `pg` waits and spares are kept, the least recently kept group is
    killed every SPARE_EVICTION_WAIT_S (on one GPU a kept policy of one back end would hold the GPU the other
    back end's policy needs)."""
    spares = spare_workers.installed()
    while spares is not None and spares.groups:
        if ray.wait([pg.ready()], timeout=SPARE_EVICTION_WAIT_S)[0]:
            return True
        spares.evict_oldest()
    return bool(ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)[0])


def pin_threads() -> int:
    """Pin torch's intra-op threads to $OMP_NUM_THREADS (set per actor by WorkerGroup); returns the count."""
    n = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(n)
    return n


def init_torch_distributed(timeout_s: float = 1800.0) -> torch.device:
    """In a WorkerGroup actor (or under torchrun): pin threads, join the default process group, return the device.

    NCCL when CUDA is available (Ray exposes one GPU per actor: cuda:0), else gloo on the CPU. Idempotent.
    The groups bind the network interface that holds this node's Ray address (interfaces.bind_interface: sets
    GLOO_SOCKET_IFNAME, and NCCL_SOCKET_IFNAME for NCCL); either variable, when set in the worker's
    environment, wins.
    """
    pin_threads()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        bind_interface(backend)
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=timeout_s))
    return device


class WorkerGroup:
    """`world_size` Ray actors of `worker_cls`, one per bundle of a placement group, ranks 0..world_size-1.

    cluster: ClusterConfig (gpus_per_node x num_nodes ranks; num_threads_per_worker torch threads each).
    use_gpus: reserve a GPU per rank; None = when the Ray cluster has GPU resources.
    env_vars: extra environment for every actor (on top of WORKER_ENV and the torchrun variables).
    placement_group: a ready Ray placement group to start in (e.g. from resource_plan.reserve): rank r in its
        bundle r; the group keeps it at shutdown (its owner removes it). None = reserve a group of its own.
    """

    def __init__(self, worker_cls: type, cluster, *, name: str = "workers", args: Sequence[Any] = (),
                 kwargs: Optional[dict[str, Any]] = None, use_gpus: Optional[bool] = None,
                 env_vars: Optional[dict[str, str]] = None, placement_group=None):
        self.name = name
        self.world_size = cluster.gpus_per_node * cluster.num_nodes
        self.local_world_size = cluster.gpus_per_node
        if use_gpus is None and placement_group is not None:
            use_gpus = bool(placement_group.bundle_specs[0].get("GPU", 0))
        self.use_gpus = bool(ray.cluster_resources().get("GPU", 0)) if use_gpus is None else use_gpus
        self.actors: list = []
        self._pg = None
        self._owns_pg = placement_group is None
        if placement_group is not None and placement_group.bundle_count < self.world_size:
            raise ValueError(f"{self.name}: the placement group has {placement_group.bundle_count} bundles for "
                             f"{self.world_size} ranks (cluster.gpus_per_node x cluster.num_nodes)")
        env = {**WORKER_ENV, **(env_vars or {}), "OMP_NUM_THREADS": str(cluster.num_threads_per_worker),
               "MKL_NUM_THREADS": str(cluster.num_threads_per_worker)}
        # spare_workers.py: a torn-down group of this kind, if installed and one waits, is restarted in place
        spares = spare_workers.installed() if self._owns_pg else None
        self._spare_key = spares.key(worker_cls, kwargs or {}, self.world_size, self.local_world_size,
                                     self.use_gpus, tuple(sorted(env.items()))) if spares is not None else None
        self._teardown = spares.recycle[worker_cls].teardown if self._spare_key is not None else None
        spare = spares.take(self._spare_key) if self._spare_key is not None else None
        if spare:
            self._pg = spare.placement_group
        else:
            self._pg = self._reserve_bundles() if placement_group is None else placement_group
        master_addr, master_port = self._master_address()
        rank_envs = [self._rank_env(env, rank, master_addr, master_port) for rank in range(self.world_size)]
        if spare:
            self.actors = spare.actors
            starts = [a.__ray_call__.remote(spare_workers.restart, e, args, kwargs or {})
                      for a, e in zip(self.actors, rank_envs)]
        else:
            self.actors = [self._start_actor(worker_cls, rank, rank_envs[rank], args, kwargs or {})
                           for rank in range(self.world_size)]
            starts = [a.__ray_ready__.remote() for a in self.actors]
        try:  # constructors run in parallel (they rendezvous in init_process_group); wait for all of them
            ray.get(starts)
        except Exception:
            self._spare_key = None  # half-built workers are not kept
            self.shutdown()
            raise

    # ------------------------------------------------------------------------------------------ start-up
    def _reserve_bundles(self):
        bundle = {"CPU": 1.0, "GPU": 1.0} if self.use_gpus else {"CPU": 1.0}
        # names must be unique in the cluster; id(self) is not: a spare group outlives the object that named it
        pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK",
                             name=f"{self.name}-pg-{uuid.uuid4().hex[:12]}")
        if not _wait_evicting_spares(pg):
            remove_placement_group(pg)
            raise RuntimeError(
                f"{self.name}: could not reserve {self.world_size} bundles of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:.0f}s; Ray has {ray.available_resources()} available of "
                f"{ray.cluster_resources()} (cluster.gpus_per_node x cluster.num_nodes = {self.world_size})")
        return pg

    def _strategy(self, bundle_index: int):
        return PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=bundle_index,
                                                placement_group_capture_child_tasks=True)

    def _master_address(self) -> tuple[str, int]:
        """Rank 0's node picks the port; loopback when the Ray cluster is this one node."""
        probe = ray.remote(_node_address_and_free_port).options(num_cpus=0, scheduling_strategy=self._strategy(0))
        ip, port = ray.get(probe.remote())
        single_node = sum(1 for n in ray.nodes() if n.get("Alive")) == 1
        return ("127.0.0.1" if single_node else ip), port

    def _rank_env(self, env: dict[str, str], rank: int, master_addr: str, master_port: int) -> dict[str, str]:
        return {**env, "RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(rank % self.local_world_size), "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}

    def _start_actor(self, worker_cls, rank, rank_env, args, kwargs):
        options = dict(num_cpus=1, num_gpus=1 if self.use_gpus else 0, scheduling_strategy=self._strategy(rank),
                       runtime_env={"env_vars": rank_env}, max_restarts=0)
        return ray.remote(worker_cls).options(**options).remote(*args, **kwargs)

    # ------------------------------------------------------------------------------------------ calls
    def run_all_async(self, method: str, *args, **kwargs) -> list:
        """Call `method(*args, **kwargs)` on every rank; ObjectRefs by rank (large args: pass ray.put refs)."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def run_all(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every rank and wait: results by rank."""
        return ray.get(self.run_all_async(method, *args, **kwargs))

    def run_each(self, method: str, args_per_rank: Sequence[Sequence[Any]], **kwargs) -> list:
        """Call `method(*args_per_rank[r], **kwargs)` on rank r; ObjectRefs by rank."""
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{self.name}: {len(args_per_rank)} argument tuples for {self.world_size} ranks")
        return [getattr(a, method).remote(*rank_args, **kwargs) for a, rank_args in zip(self.actors, args_per_rank)]

    def shutdown(self) -> None:
        """Kill the actors and free the bundles (with spare workers installed: tear the actors down and keep them,
        bundles and all, for the next group of this kind); safe to call twice."""
        spares = spare_workers.installed()
        if spares is not None and self._spare_key is not None and self.actors:
            try:
                ray.get([a.__ray_call__.remote(spare_workers.teardown, self._teardown) for a in self.actors],
                        timeout=TEARDOWN_TIMEOUT_S)
                spares.keep(self._spare_key, spare_workers.SpareGroup(self.actors, self._pg))
                self.actors, self._pg = [], None
                return
            except Exception as e:  # a dead or stuck rank: kill the group
                log.debug("%s: teardown failed, killing the workers: %s", self.name, e)
        kill_actors(self.actors, self._pg if self._owns_pg else None, self.name)
        self.actors, self._pg = [], None
