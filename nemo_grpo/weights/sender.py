"""`WeightSender`: the policy workers' side of every way weights leave the policy, written once.

A back end supplies two things: `_export_specs()` (HF name, full shape, dtype of every tensor of the HF
state_dict, the same on all ranks) and `_export_tensors(names)` (a collective: full CPU tensors, meaningful
on rank 0). Three consumers are built on them here:
- `plan_weight_export` / `export_weight_bucket`: buckets through Ray's object store (colocated refit);
- `open_weight_transfer` / `join_weight_transfer` / `send_weights`: buckets broadcast from rank 0 over a
  transfer group of its own to separate engine workers (non-colocated refit; the receiving end is
  weights/receiver.py);
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

import torch

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
        from safetensors.torch import save_file

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

    # ------------------------------------------------------------------------------------------ transfer group
    def open_weight_transfer(self, name: str, bucket_size_mb: float, timeout_s: float) -> Optional[dict[str, Any]]:
        """Collective-free, on every rank: plan transfer `name`: the HF state_dict in buckets of ~bucket_size_mb,
        tied aliases included, as in the export (vLLM's layerwise reload expects a tied lm_head.weight too).
        Rank 0 also opens the transfer group's store on a free port and returns {"host", "port", "plan",
        "device"}, the plan as lists of TensorSpec (what the receivers allocate); None on other ranks."""
        import ray

        specs = {s.name: s for s in self._export_specs()}
        plan = [[specs[n] for n in names]
                for names in plan_buckets(self._export_sizes(), bucket_size_mb * 1024 * 1024)]
        transfer: dict[str, Any] = {"plan": plan, "group": None, "timeout_s": timeout_s}
        self._transfers[name] = transfer
        if self.rank != 0:
            return None
        host = ray.util.get_node_ip_address()
        transfer["store"], port = wt.open_store(host, timeout_s)
        return {"host": host, "port": port, "plan": plan, "device": self.device.type}

    def join_weight_transfer(self, name: str, world_size: int, backend: str) -> None:
        """Rank 0 joins transfer `name` as its rank 0 (returns once every receiver has joined); no-op elsewhere."""
        transfer = self._transfers[name]
        if self.rank == 0:
            transfer["device"] = self.device if backend == "nccl" else torch.device("cpu")
            transfer["group"] = wt.join_group("", 0, 0, world_size, backend, transfer["timeout_s"],
                                              store=transfer["store"])

    def send_weights(self, name: str) -> Optional[dict[str, float]]:
        """Collective on all ranks: every bucket of transfer `name` is gathered to full tensors (as the export
        does) and rank 0 broadcasts it, one flat buffer per dtype. Rank 0 returns {"bytes", "buckets",
        "seconds"}; None elsewhere."""
        transfer = self._transfers.get(name)
        if transfer is None:
            raise RuntimeError(f"send_weights: no weight transfer '{name}' (call open_weight_transfer first)")
        start, sent = time.perf_counter(), 0
        in_flight: list = []  # bucket i's broadcast proceeds while bucket i + 1 is gathered
        for bucket in transfer["plan"]:
            tensors = self._export_tensors([s.name for s in bucket])
            if self.rank == 0:
                flats = wt.pack(tensors, bucket, transfer["device"])
                wt.wait(in_flight)
                in_flight = wt.broadcast_async(transfer["group"], flats)
                sent += sum(f.numel() * f.element_size() for f in flats)
        wt.wait(in_flight)
        if self.rank != 0:
            return None
        return {"bytes": float(sent), "buckets": float(len(transfer["plan"])), "seconds": time.perf_counter() - start}
