"""The wire of a refit: bucket plans, and weights over a collective group of their own, from the trainer
(rank 0) to generation workers (1..n).

The group is built directly from a `TCPStore` and a `ProcessGroupGloo` / `ProcessGroupNCCL` (what vLLM's
`stateless_init_torch_distributed_process_group` does), so it is independent of any default process group: the
policy's FSDP group and an engine's own groups are untouched, and a process may belong to several such groups.
The trainer opens the store on a free port (`open_store`); every member then calls `join_group`.

A transfer plan is a list of buckets, each a list of `TensorSpec`s that both sides know before the first
transfer. A bucket travels as one flat buffer per dtype (dtypes in order of first appearance in the bucket,
tensors concatenated in plan order): one broadcast per dtype instead of one per tensor.

    plan = [[TensorSpec("w", (4, 8), torch.float32), ...], ...]
    sender:   flats = empty_buffers(bucket, device); fill(unpack(flats, bucket), tensors, bucket)
              broadcast(group, flats)                                   # rank 0
    receiver: flats = empty_buffers(bucket, device); broadcast(group, flats); views = unpack(flats, bucket)

Both ends keep one bucket in flight (`broadcast_async`): the sender gathers bucket i+1 while bucket i
travels, the receiver receives bucket i+1 while it loads bucket i.

A weight region holds a whole plan in one byte buffer, bucket after bucket, each dtype group 64-byte aligned
(`region_layout`, `bucket_buffers`): in host shared memory (`SharedRegion`, a file under /dev/shm that every
process of the node maps), the policy ranks write their shards into it in place and the colocated engine loads
from it in place; nothing is serialized.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import uuid
from dataclasses import dataclass, replace
from typing import Optional

import torch

from nemo_grpo.distributed.interfaces import bind_interface

STORE_PREFIX = "nemo_grpo/weight_transfer"
ALIGN = 64  # bytes: every dtype group of a region starts at a multiple


@dataclass(frozen=True)
class TensorSpec:
    """Name, full shape and dtype of one Hugging-Face-named weight."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_nbytes(plan: list[list[TensorSpec]]) -> int:
    return sum(s.nbytes for bucket in plan for s in bucket)


def cast_plan(plan: list[list[TensorSpec]], dtype: Optional[torch.dtype]) -> list[list[TensorSpec]]:
    """The plan with its floating-point tensors in `dtype` (the engine's): weights are cast before they travel."""
    if dtype is None:
        return plan
    return [[replace(s, dtype=dtype) if s.dtype.is_floating_point else s for s in bucket] for bucket in plan]


def plan_buckets(sizes: list[tuple[str, int]], bucket_bytes: float) -> list[list[str]]:
    """Group (name, nbytes) in order into buckets of at most bucket_bytes (always >= 1 tensor per bucket)."""
    buckets, current, used = [], [], 0
    for name, nbytes in sizes:
        if current and used + nbytes > bucket_bytes:
            buckets.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        buckets.append(current)
    return buckets


# ---------------------------------------------------------------------------------------------- the group
def open_store(host: str, timeout_s: float) -> tuple[torch.distributed.TCPStore, int]:
    """The rendezvous store of a new group, served by this process (its rank 0) on a free port of this node,
    `host` being the node's address the other members connect to: (store, port)."""
    store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
    return store, store.port


def join_group(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
               store: Optional[torch.distributed.TCPStore] = None):
    """Join the group whose store serves at host:port (rank 0 passes the store it opened). Blocks until all
    world_size members have joined. backend: "gloo" (CPU tensors) | "nccl" (CUDA tensors on the current device).
    Returns the backend object (`broadcast([tensor], opts)`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    bind_interface(backend, master_addr=host)  # the interface of this node's Ray address: engines on other nodes
    if store is None:
        store = torch.distributed.TCPStore(host, port, is_master=False, timeout=timeout)
    prefixed = torch.distributed.PrefixStore(STORE_PREFIX, store)
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"weight transfer backend '{backend}' is unknown; known: gloo, nccl")


def broadcast_async(group, flats: list[torch.Tensor], root: int = 0) -> list:
    """Queue a broadcast of every buffer from `root` (in place on the others); returns the works to wait on.
    The buffers must stay alive and untouched until then."""
    opts = torch.distributed.BroadcastOptions()
    opts.rootRank = root
    return [group.broadcast([flat], opts) for flat in flats]


def wait(works: list) -> None:
    for work in works:
        work.wait()


def broadcast(group, flats: list[torch.Tensor], root: int = 0) -> None:
    """broadcast_async, then wait."""
    wait(broadcast_async(group, flats, root))


# ---------------------------------------------------------------------------------------------- buffers
def dtype_groups(bucket: list[TensorSpec]) -> list[tuple[torch.dtype, list[TensorSpec]]]:
    """The bucket's specs by dtype, dtypes in order of first appearance, specs in plan order."""
    groups: dict[torch.dtype, list[TensorSpec]] = {}
    for spec in bucket:
        groups.setdefault(spec.dtype, []).append(spec)
    return list(groups.items())


def fill(views: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], bucket: list[TensorSpec]) -> None:
    """Sender: copy each of the bucket's tensors into its view (unpack() of the bucket's buffers), cast to the
    plan's dtype; a tensor of another shape, or a non-floating tensor of another dtype, is an error naming it."""
    for s in bucket:
        t = tensors[s.name]
        castable = t.dtype == s.dtype or (t.dtype.is_floating_point and s.dtype.is_floating_point)
        if tuple(t.shape) != s.shape or not castable:
            raise ValueError(f"weight transfer: '{s.name}' is {tuple(t.shape)} {t.dtype}, the plan says "
                             f"{s.shape} {s.dtype}")
        views[s.name].copy_(t)


def empty_buffers(bucket: list[TensorSpec], device: torch.device) -> list[torch.Tensor]:
    """Uninitialised flat buffers of the bucket's layout (one per dtype, in dtype_groups order)."""
    return [torch.empty(sum(s.numel for s in specs), dtype=dtype, device=device)
            for dtype, specs in dtype_groups(bucket)]


def unpack(flats: list[torch.Tensor], bucket: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """name -> view of the flat buffers with the spec's shape (no copy), in plan order."""
    views = {}
    for flat, (_, specs) in zip(flats, dtype_groups(bucket)):
        offset = 0
        for s in specs:
            views[s.name] = flat[offset : offset + s.numel].view(s.shape)
            offset += s.numel
    return {s.name: views[s.name] for s in bucket}


# ---------------------------------------------------------------------------------------------- regions
def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def region_layout(plan: list[list[TensorSpec]]) -> tuple[list[list[int]], int]:
    """(byte offset of every dtype group of every bucket, in dtype_groups order; the region's size in bytes)."""
    offsets, at = [], 0
    for bucket in plan:
        starts = []
        for _, specs in dtype_groups(bucket):
            starts.append(at)
            at = _aligned(at + sum(s.nbytes for s in specs))
        offsets.append(starts)
    return offsets, max(at, ALIGN)


def bucket_spans(plan: list[list[TensorSpec]]) -> list[tuple[int, int]]:
    """Per bucket, the [start, stop) bytes of a region that hold it (its dtype groups, alignment included)."""
    offsets, total = region_layout(plan)
    starts = [group[0] for group in offsets]
    return list(zip(starts, starts[1:] + [total]))


def region_nbytes(plan: list[list[TensorSpec]]) -> int:
    """Bytes of a region that holds `plan`."""
    return region_layout(plan)[1]


def bucket_views(buffers: list[list[torch.Tensor]], plan: list[list[TensorSpec]]) -> list[dict[str, torch.Tensor]]:
    """Per bucket, name -> full-shape view of its buffers (bucket_buffers' or empty_buffers')."""
    return [unpack(flats, bucket) for flats, bucket in zip(buffers, plan)]


def bucket_buffers(region: torch.Tensor, plan: list[list[TensorSpec]]) -> list[list[torch.Tensor]]:
    """Per bucket, its flat buffers (one per dtype, as empty_buffers lays them out) as views of the uint8
    `region`."""
    offsets, _ = region_layout(plan)
    out = []
    for bucket, starts in zip(plan, offsets):
        flats = []
        for start, (dtype, specs) in zip(starts, dtype_groups(bucket)):
            nbytes = sum(s.nbytes for s in specs)
            flats.append(region[start : start + nbytes].view(dtype))
        out.append(flats)
    return out


class SharedRegion:
    """A byte buffer in host shared memory that every process of a node can map (torch.from_file on a file
    under /dev/shm). The creator names the file; the others attach by path. `unlink()` once every process
    has mapped it: the memory lives until the last mapping goes, and nothing is left behind after a crash."""

    def __init__(self, path: str, nbytes: int):
        self.path, self.nbytes = path, nbytes
        self.tensor = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # [nbytes]

    @classmethod
    def create(cls, nbytes: int, prefix: str = "nemo_grpo-weights") -> "SharedRegion":
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return cls(os.path.join(folder, f"{prefix}-{uuid.uuid4().hex[:12]}"), nbytes)

    def unlink(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
