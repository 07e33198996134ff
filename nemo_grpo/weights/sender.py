"""`WeightSender`: a policy rank's side of every way weights leave the policy, written once over a WeightSource.

The back end's worker holds `weight_sender = WeightSender(self)`; it asks its source (weights/protocols.py)
only for specs, the trained subset, gathered tensors and bucket writes. Three consumers are built on them:
- `open_region` / `attach_region` / `write_bucket`: the whole plan, in the engine's dtype, written into a
  region of host shared memory that a colocated engine loads from in place (colocated refit);
- `open_transfer` / `join_transfer` / `send`: the same region, each bucket broadcast from rank 0 over a
  transfer group of its own to separate engine workers once written (non-colocated refit; the receiving end
  is weights/receiver.py);
- `save_pretrained`: a Hugging Face directory.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any, Optional

import ray
import torch
from safetensors.torch import save_file

from nemo_grpo.weights import transfer as wt
from nemo_grpo.weights.protocols import WeightSource
from nemo_grpo.weights.transfer import TensorSpec, plan_buckets

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def write_gathered(source: WeightSource, bucket: list[TensorSpec], views: Optional[dict[str, torch.Tensor]]) -> None:
    """Collective: the bucket's tensors gathered on rank 0, which copies (and casts) them into `views`: a
    source's `write_weight_bucket` when its ranks cannot write their own shards."""
    tensors = source.gather_weights([s.name for s in bucket])
    if source.rank == 0:
        wt.fill(views, tensors, bucket)


class WeightSender:
    """The sending end on one policy rank: open transfers by name (plan, region, group) over `source`."""

    def __init__(self, source: WeightSource):
        self.source = source
        self.transfers: dict[str, dict[str, Any]] = {}  # open weight transfers, by name

    def _sizes(self) -> list[tuple[str, int]]:
        return [(s.name, s.nbytes) for s in self.source.weight_specs()]

    def specs(self) -> list[TensorSpec]:
        """The source's HF tensors (name, full shape, dtype), in order."""
        return self.source.weight_specs()

    def gather(self, names: list[str]) -> Optional[dict[str, torch.Tensor]]:
        """Collective: full CPU tensors for `names` (rank 0; None elsewhere)."""
        tensors = self.source.gather_weights(names)
        return tensors if self.source.rank == 0 else None

    # ------------------------------------------------------------------------------------------ HF directory
    def save_pretrained(self, path: str, model_path: str, hf_config, shard_size_mb: float = 2048.0) -> None:
        """Collective: a Hugging Face directory (weights as safetensors shards, `hf_config` saved, the other
        config and tokenizer files of `model_path` copied)."""
        rank0 = self.source.rank == 0
        sizes = [(n, b) for n, b in self._sizes() if n not in self.source.tied_aliases]
        plan = plan_buckets(sizes, shard_size_mb * 1024 * 1024)
        files = ["model.safetensors"] if len(plan) == 1 else \
            [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        if rank0:
            os.makedirs(path, exist_ok=True)
            for name in os.listdir(model_path):  # config, tokenizer, generation config, chat template
                src = os.path.join(model_path, name)
                if os.path.isfile(src) and not name.endswith(WEIGHT_SUFFIXES):
                    shutil.copy2(src, os.path.join(path, name))
            hf_config.save_pretrained(path)  # the config of the model actually built (head, labels)
        weight_map = {}
        for names, fname in zip(plan, files):
            tensors = self.source.gather_weights(names)
            if rank0:
                save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, fname),
                          metadata={"format": "pt"})
                weight_map.update({k: fname for k in tensors})
        if rank0 and len(files) > 1:
            total = sum(b for _, b in sizes)
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    # ------------------------------------------------------------------------------------------ weight regions
    def open_region(self, name: str, bucket_size_mb: float, dtype: Optional[str],
                    adapters: bool = False) -> Optional[dict[str, Any]]:
        """Collective-free, on every rank: plan transfer `name`: the HF state_dict (tied aliases included, as
        in the export: vLLM's layerwise reload expects a tied lm_head.weight too) in buckets of ~bucket_size_mb,
        floating-point tensors in `dtype` (the engine's; None: as the policy holds them). Rank 0 creates the
        shared region that holds the whole plan and returns {"host", "path", "plan", "trained_from"} (plan: lists
        of TensorSpec; buckets from index trained_from on hold what a train step can change, those before it
        what it cannot: refits after the first send only the former); None on other ranks.
        adapters: plan the LoRA adapters (the source's adapter_specs, peft's keys) instead; a train step changes
        all of them, so every refit sends the whole plan (trained_from 0)."""
        specs = self.source.adapter_specs() if adapters else self.specs()
        by_name, limit = {s.name: s for s in specs}, bucket_size_mb * 2**20
        sizes = [(s.name, s.nbytes) for s in specs]
        trained = set(by_name) if adapters else self.source.trained_weight_names([n for n, _ in sizes])
        frozen = plan_buckets([(n, b) for n, b in sizes if n not in trained], limit)
        names = frozen + plan_buckets([(n, b) for n, b in sizes if n in trained], limit)
        plan = wt.cast_plan([[by_name[n] for n in bucket] for bucket in names],
                            getattr(torch, dtype) if dtype else None)
        transfer: dict[str, Any] = {"plan": plan, "region": None, "views": None, "group": None, "leaders": None,
                                    "adapters": adapters, "gathered": None}
        self.transfers[name] = transfer
        if self.source.rank != 0:
            return None
        transfer["region"] = wt.SharedRegion.create(wt.region_nbytes(plan))
        return {"host": ray.util.get_node_ip_address(), "path": transfer["region"].path, "plan": plan,
                "trained_from": len(frozen)}

    def node_ip(self) -> str:
        """The address of this rank's node (a region is shared within one node)."""
        return ray.util.get_node_ip_address()

    def create_region(self, name: str) -> str:
        """A region of transfer `name`'s plan in this node's shared memory, created by this rank (the first
        policy rank of a node whose engine replicas need one, other than rank 0's); returns its path."""
        transfer = self.transfers[name]
        transfer["region"] = wt.SharedRegion.create(wt.region_nbytes(transfer["plan"]))
        return transfer["region"].path

    def attach_region(self, name: str, regions: dict[str, str], leaders: Optional[list[int]] = None) -> bool:
        """Collective: each rank maps its node's region (`regions`: node address -> path), if its node has one.
        One region that every rank mapped: each rank may write its own shards in place (returned). Else rank 0
        writes the gathered tensors into its node's region and, with regions on several nodes, broadcasts each
        bucket's bytes to `leaders` (the ranks that created the other nodes' regions), which receive them into
        theirs: every node's engine replicas read their own node's memory."""
        transfer = self.transfers[name]
        plan, created = transfer["plan"], transfer["region"] is not None  # (rank 0, and the leaders)
        host = ray.util.get_node_ip_address()
        if not created and host in regions:
            transfer["region"] = wt.SharedRegion(regions[host], wt.region_nbytes(plan))
        region = transfer["region"]
        if region is not None:
            transfer["buffers"] = wt.bucket_buffers(region.tensor, plan)
            transfer["views"] = wt.bucket_views(transfer["buffers"], plan)
            transfer["spans"] = wt.bucket_spans(plan)
        everyone = torch.tensor([float(region is not None)], device=self.source.device)  # (NCCL: on the device)
        torch.distributed.all_reduce(everyone, op=torch.distributed.ReduceOp.MIN)  # also: every rank has mapped
        transfer["in_place"] = bool(everyone.item()) and len(regions) == 1
        transfer["leaders"] = None
        if len(regions) > 1:  # (new_group is collective over every rank, members or not)
            group = torch.distributed.new_group([0, *(leaders or [])], backend="gloo")
            transfer["leaders"] = group if created else None
        if created:
            region.unlink()  # every process of the node that needs it has mapped it (the engine attached before)
        return transfer["in_place"]

    def write_bucket(self, name: str, index: int) -> int:
        """Collective: bucket `index` of transfer `name`, full tensors in the transfer's dtype, into the shared
        region (regions on several nodes: rank 0's, then its bytes broadcast into the others); returns its
        bytes (rank 0; 0 elsewhere)."""
        transfer = self.transfers[name]
        bucket = transfer["plan"][index]
        views = transfer["views"][index] if transfer["views"] is not None else None
        with torch.no_grad():
            if transfer["adapters"]:
                self._write_adapters(transfer, index, views)
            else:
                self.source.write_weight_bucket(bucket, views, transfer["in_place"])
        if transfer["leaders"] is not None:
            start, stop = transfer["spans"][index]
            torch.distributed.broadcast(transfer["region"].tensor[start:stop], src=0, group=transfer["leaders"])
        return sum(s.nbytes for s in bucket) if self.source.rank == 0 else 0

    def _write_adapters(self, transfer: dict[str, Any], index: int, views: Optional[dict[str, torch.Tensor]]) -> None:
        """Collective: bucket `index` of an adapter plan, rank 0 copying from the adapters gathered once per refit
        (at its first bucket; a refit of adapters sends every bucket, in order)."""
        if index == 0 or transfer["gathered"] is None:
            transfer["gathered"] = self.source.adapter_state()
        if self.source.rank == 0:
            wt.fill(views, transfer["gathered"], transfer["plan"][index])
        if index == len(transfer["plan"]) - 1:
            transfer["gathered"] = None

    def close(self, name: str) -> None:
        """Forget transfer `name`: its region's memory goes with the last mapping, its groups with their members."""
        transfer = self.transfers.pop(name, None)
        if transfer is not None and transfer["leaders"] is not None:
            torch.distributed.destroy_process_group(transfer["leaders"])

    # ------------------------------------------------------------------------------------------ transfer group
    def open_transfer(self, name: str, bucket_size_mb: float, dtype: Optional[str], timeout_s: float,
                      adapters: bool = False) -> Optional[dict[str, Any]]:
        """Collective-free: open_region, and rank 0 also opens the transfer group's store on a free port:
        {"host", "path", "plan", "trained_from", "port", "device"} on rank 0, None elsewhere."""
        info = self.open_region(name, bucket_size_mb, dtype, adapters)
        if info is None:
            return None
        transfer = self.transfers[name]
        transfer["timeout_s"] = timeout_s
        transfer["store"], port = wt.open_store(info["host"], timeout_s)
        return {**info, "port": port, "device": self.source.device.type}

    def join_transfer(self, name: str, world_size: int, backend: str) -> None:
        """Collective: attach the region; rank 0 joins transfer `name`'s group as its rank 0 (returns once every
        receiver has joined)."""
        transfer, rank0 = self.transfers[name], self.source.rank == 0
        where = [(ray.util.get_node_ip_address(), transfer["region"].path) if rank0 else None]
        torch.distributed.broadcast_object_list(where, src=0)
        self.attach_region(name, {where[0][0]: where[0][1]})
        if rank0:
            transfer["device"] = self.source.device if backend == "nccl" else None  # NCCL sends from the device
            transfer["group"] = wt.join_group("", 0, 0, world_size, backend, transfer["timeout_s"],
                                              store=transfer["store"])

    def send(self, name: str, first: int = 0) -> Optional[dict[str, float]]:
        """Collective on all ranks: every bucket of transfer `name` from index `first` on is written into the
        region and rank 0 broadcasts it, one flat buffer per dtype, while the next bucket is written. Rank 0
        returns {"bytes", "buckets", "seconds"}; None elsewhere."""
        transfer = self.transfers.get(name)
        if transfer is None:
            raise RuntimeError(f"send: no weight transfer '{name}' (call open_transfer first)")
        start, sent, rank0 = time.perf_counter(), 0, self.source.rank == 0
        in_flight: tuple = ([], [])  # (works, buffers) of the broadcast under way: its buffers live until done
        for index in range(first, len(transfer["plan"])):
            sent += self.write_bucket(name, index)
            if rank0:
                flats = transfer["buffers"][index]
                if transfer["device"] is not None:
                    flats = [f.to(transfer["device"]) for f in flats]
                wt.wait(in_flight[0])
                in_flight = (wt.broadcast_async(transfer["group"], flats), flats)
        wt.wait(in_flight[0])
        if not rank0:
            return None
        return {"bytes": float(sent), "buckets": float(len(transfer["plan"]) - first),
                "seconds": time.perf_counter() - start}
