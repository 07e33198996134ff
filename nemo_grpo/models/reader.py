"""Read the tensors of a Hugging Face directory's safetensors files lazily, whole or one slice at a time.

    get = hf_tensor_reader("/models/qwen3")
    get("model.embed_tokens.weight")                           # [V, H] fp32
    get.read_slice("model.embed_tokens.weight", (slice(0, 8), slice(0, 64)))   # [8, 64]: only those bytes read
    get.read_experts("model.layers.0.mlp.experts.down_proj", range(2, 4))        # [2, H, F]

Shared by the Megatron back end (mcore/weights.py) and the DTensor back end's sharded load (dtensor/loading.py).
MoE: a fused expert name (models/experts.py) that the checkpoint stores per expert is stacked from them.
`get.reads` counts what was read: `numel` (elements in all) and `largest` (elements of the largest single read).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Callable, Optional

import torch
from safetensors import safe_open

from nemo_grpo.models.experts import FUSED, PER_EXPERT, read_fused_experts


def _locations(model_dir: str) -> dict[str, str]:
    """tensor name -> the safetensors file that holds it (from the index, else from every file's header)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(model_dir, v) for k, v in json.load(f)["weight_map"].items()}
    where = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            where.update({k: path for k in f.keys()})
    return where


def hf_tensor_reader(model_dir: str) -> Callable[[str], torch.Tensor]:
    """name -> fp32 tensor from the safetensors files of `model_dir` (one open handle per file), with
    `read_slice(name, region)` (a tuple of slices, one per dim) and `read_experts(name, experts)` attached."""
    where = _locations(model_dir)
    if not where:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    handles: dict[str, object] = {}
    reads = {"numel": 0, "largest": 0}

    def handle(name: str):
        if name not in where:
            raise KeyError(f"tensor '{name}' is not in the checkpoint {model_dir}")
        if where[name] not in handles:
            handles[where[name]] = safe_open(where[name], "pt")
        return handles[where[name]]

    def counted(t: torch.Tensor) -> torch.Tensor:
        reads["numel"] += t.numel()
        reads["largest"] = max(reads["largest"], t.numel())
        return t.float()

    def get(name: str) -> torch.Tensor:
        if name not in where and FUSED.match(name):
            return read_experts(name, None)
        return counted(handle(name).get_tensor(name))

    def read_slice(name: str, region: tuple) -> torch.Tensor:
        """[n0, n1, ...] for region (slice(o0, o0 + n0), ...): only that slice is read from the file."""
        if name not in where and FUSED.match(name):  # experts one by one: the region's experts, then the rest
            return read_experts(name, range(region[0].start, region[0].stop))[(slice(None),) + tuple(region[1:])]
        return counted(handle(name).get_slice(name)[tuple(region)])

    def read_experts(name: str, experts: Optional[range]) -> torch.Tensor:
        if name in where:
            full = get(name)
            return full if experts is None else full[experts.start:experts.stop]
        if experts is None:
            prefix = FUSED.match(name)["prefix"]
            experts = range(sum(1 for k in where if PER_EXPERT.match(k) and k.startswith(prefix + ".")
                                and k.endswith(".down_proj.weight")))
        return read_fused_experts(name, experts, get)

    get.read_slice, get.read_experts, get.reads = read_slice, read_experts, reads
    return get
