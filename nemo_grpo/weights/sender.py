"""`WeightSender`: the policy workers' side of every way weights leave the policy, written once.

A back end supplies two things: `_export_specs()` (HF name, full shape, dtype of every tensor of the HF
state_dict, the same on all ranks) and `_export_tensors(names)` (a collective: full CPU tensors, meaningful
on rank 0), and may override `_write_bucket` (each rank writes its own shards into the shared region). Four
consumers are built on them here:
- `plan_weight_export` / `export_weight_bucket`: buckets to the driver through Ray's object store (tests,
  tools);
- `open_weight_region` / `attach_weight_region` / `write_weight_bucket`: the whole plan, in the engine's dtype,
  written into a region of host shared memory that a colocated engine loads from in place (colocated refit);
- `open_weight_transfer` / `join_weight_transfer` / `send_weights`: the same region, each bucket broadcast from
  rank 0 over a transfer group of its own to separate engine workers once written (non-colocated refit; the
  receiving end is weights/receiver.py);
- `save_pretrained`: a Hugging Face directory.
The mixin expects the worker's `rank`, `device`, `model_path`, `tied_aliases` and `_hf_config()`, and a call to
`_init_weight_sender()` in its constructor.
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
from nemo_grpo.weights.transfer import plan_buckets

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


class WeightSender:
    tied_aliases: frozenset = frozenset()  # state_dict names aliasing an earlier one (HF drops them when saving)
    _export_plan: list[list[str]]  # the buckets of plan_weight_export (names)
    _transfers: dict[str, dict[str, Any]]  # open weight transfers, by name

    def _init_weight_sender(self) -> None:
        self._export_plan, self._transfers = [], {}

    def _export_sizes(self) -> list[tuple[str, int]]:
        return [(s.name, s.nbytes) for s in self._export_specs()]

    def _trained_names(self, names: list[str]) -> set[str]:
        """The HF tensors a train step can change (all; LoRA: the engine's layers under adapters): later
        refits send only these."""
        return set(names)

    # ------------------------------------------------------------------------------------------ object store
    def plan_weight_export(self, bucket_size_mb: float) -> int:
        """Collective-free: group the HF state_dict into buckets of ~bucket_size_mb; returns the bucket count."""
        self._export_plan = plan_buckets(self._export_sizes(), bucket_size_mb * 1024 * 1024)
        return len(self._export_plan)

    def export_weight_bucket(self, index: int) -> Optional[dict[str, torch.Tensor]]:
        """Collective on all ranks: bucket `index` of the current plan as full CPU tensors (rank 0; None elsewhere)."""
        tensors = self._export_tensors(self._export_plan[index])
        return tensors if self.rank == 0 else None

    # ------------------------------------------------------------------------------------------ HF directory
    def save_pretrained(self, path: str, shard_size_mb: float = 2048.0) -> None:
        """Collective: a Hugging Face directory (weights as safetensors shards, config and tokenizer files copied)."""
        sizes = [(n, b) for n, b in self._export_sizes() if n not in self.tied_aliases]
        plan = plan_buckets(sizes, shard_size_mb * 1024 * 1024)
        files = ["model.safetensors"] if len(plan) == 1 else \
            [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            for name in os.listdir(self.model_path):  # config, tokenizer, generation config, chat template
                src = os.path.join(self.model_path, name)
                if os.path.isfile(src) and not name.endswith(WEIGHT_SUFFIXES):
                    shutil.copy2(src, os.path.join(path, name))
            self._hf_config().save_pretrained(path)  # the config of the model actually built (head, labels)
        weight_map = {}
        for names, fname in zip(plan, files):
            tensors = self._export_tensors(names)
            if self.rank == 0:
                save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, fname),
                          metadata={"format": "pt"})
                weight_map.update({k: fname for k in tensors})
        if self.rank == 0 and len(files) > 1:
            total = sum(b for _, b in sizes)
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    # ------------------------------------------------------------------------------------------ weight regions
    def open_weight_region(self, name: str, bucket_size_mb: float, dtype: Optional[str]) -> Optional[dict[str, Any]]:
        """Collective-free, on every rank: plan transfer `name`: the HF state_dict (tied aliases included, as
        in the export: vLLM's layerwise reload expects a tied lm_head.weight too) in buckets of ~bucket_size_mb,
        floating-point tensors in `dtype` (the engine's; None: as the policy holds them). Rank 0 creates the
        shared region that holds the whole plan and returns {"host", "path", "plan", "trained_from"} (plan: lists
        of TensorSpec; buckets from index trained_from on hold what a train step can change, those before it
        what it cannot: refits after the first send only the former); None on other ranks."""
        specs, sizes, limit = {s.name: s for s in self._export_specs()}, self._export_sizes(), bucket_size_mb * 2**20
        trained = self._trained_names([n for n, _ in sizes])
        frozen = plan_buckets([(n, b) for n, b in sizes if n not in trained], limit)
        names = frozen + plan_buckets([(n, b) for n, b in sizes if n in trained], limit)
        plan = wt.cast_plan([[specs[n] for n in bucket] for bucket in names], getattr(torch, dtype) if dtype else None)
        transfer: dict[str, Any] = {"plan": plan, "region": None, "views": None, "group": None}
        self._transfers[name] = transfer
        if self.rank != 0:
            return None
        transfer["region"] = wt.SharedRegion.create(wt.region_nbytes(plan))
        return {"host": ray.util.get_node_ip_address(), "path": transfer["region"].path, "plan": plan,
                "trained_from": len(frozen)}

    def attach_weight_region(self, name: str, host: str, path: str) -> bool:
        """Collective: the ranks on rank 0's node (`host`) map the region; when all of them could (returned),
        each rank may write its own shards in place (`_write_bucket`), else rank 0 writes the gathered tensors."""
        transfer = self._transfers[name]
        plan = transfer["plan"]
        if self.rank != 0 and ray.util.get_node_ip_address() == host:
            transfer["region"] = wt.SharedRegion(path, wt.region_nbytes(plan))
        region = transfer["region"]
        if region is not None:
            transfer["buffers"] = wt.bucket_buffers(region.tensor, plan)
            transfer["views"] = wt.bucket_views(transfer["buffers"], plan)
        everyone = torch.tensor([float(region is not None)], device=self.device)  # (NCCL: on the device)
        torch.distributed.all_reduce(everyone, op=torch.distributed.ReduceOp.MIN)  # also: every rank has mapped
        transfer["in_place"] = bool(everyone.item())
        if self.rank == 0:
            region.unlink()  # every process that needs it has mapped it (the engine attached before)
        return transfer["in_place"]

    def write_weight_bucket(self, name: str, index: int) -> int:
        """Collective: bucket `index` of transfer `name`, full tensors in the transfer's dtype, into the shared
        region; returns its bytes (rank 0; 0 elsewhere)."""
        transfer = self._transfers[name]
        bucket = transfer["plan"][index]
        views = transfer["views"][index] if transfer["views"] is not None else None
        with torch.no_grad():
            self._write_bucket(bucket, views, transfer["in_place"])
        return sum(s.nbytes for s in bucket) if self.rank == 0 else 0

    def _write_bucket(self, bucket: list[wt.TensorSpec], views: Optional[dict[str, torch.Tensor]],
                      in_place: bool) -> None:
        """Collective: the bucket's full tensors into `views` (name -> full-shape view of the region). This
        default gathers them on rank 0 (`_export_tensors`), which copies (and casts) them in; a back end whose
        ranks can each write their own shards overrides it for `in_place`."""
        tensors = self._export_tensors([s.name for s in bucket])
        if self.rank == 0:
            wt.fill(views, tensors, bucket)

    def close_weight_transfer(self, name: str) -> None:
        """Forget transfer `name`: its region's memory goes with the last mapping, its group with its members."""
        self._transfers.pop(name, None)

    # ------------------------------------------------------------------------------------------ transfer group
    def open_weight_transfer(self, name: str, bucket_size_mb: float, dtype: Optional[str],
                             timeout_s: float) -> Optional[dict[str, Any]]:
        """Collective-free: open_weight_region, and rank 0 also opens the transfer group's store on a free
        port: {"host", "path", "plan", "port", "device"} on rank 0, None elsewhere."""
        info = self.open_weight_region(name, bucket_size_mb, dtype)
        if info is None:
            return None
        transfer = self._transfers[name]
        transfer["timeout_s"] = timeout_s
        transfer["store"], port = wt.open_store(info["host"], timeout_s)
        return {**info, "port": port, "device": self.device.type}

    def join_weight_transfer(self, name: str, world_size: int, backend: str) -> None:
        """Collective: attach the region; rank 0 joins transfer `name`'s group as its rank 0 (returns once every
        receiver has joined)."""
        transfer = self._transfers[name]
        where = [(ray.util.get_node_ip_address(), transfer["region"].path) if self.rank == 0 else None]
        torch.distributed.broadcast_object_list(where, src=0)
        self.attach_weight_region(name, *where[0])
        if self.rank == 0:
            transfer["device"] = self.device if backend == "nccl" else None  # NCCL sends from the device
            transfer["group"] = wt.join_group("", 0, 0, world_size, backend, transfer["timeout_s"],
                                              store=transfer["store"])

    def send_weights(self, name: str, first: int = 0) -> Optional[dict[str, float]]:
        """Collective on all ranks: every bucket of transfer `name` from index `first` on is written into the
        region and rank 0 broadcasts it, one flat buffer per dtype, while the next bucket is written. Rank 0
        returns {"bytes", "buckets", "seconds"}; None elsewhere."""
        transfer = self._transfers.get(name)
        if transfer is None:
            raise RuntimeError(f"send_weights: no weight transfer '{name}' (call open_weight_transfer first)")
        start, sent = time.perf_counter(), 0
        in_flight: tuple = ([], [])  # (works, buffers) of the broadcast under way: its buffers live until done
        for index in range(first, len(transfer["plan"])):
            sent += self.write_weight_bucket(name, index)
            if self.rank == 0:
                flats = transfer["buffers"][index]
                if transfer["device"] is not None:
                    flats = [f.to(transfer["device"]) for f in flats]
                wt.wait(in_flight[0])
                in_flight = (wt.broadcast_async(transfer["group"], flats), flats)
        wt.wait(in_flight[0])
        if self.rank != 0:
            return None
        return {"bytes": float(sent), "buckets": float(len(transfer["plan"]) - first),
                "seconds": time.perf_counter() - start}
