"""A Mixture-of-Experts layer's expert weights in their two HF layouts.

transformers 5 holds each MoE layer's experts fused (what a policy exports): `mlp.experts.gate_up_proj`
[E, 2F, H] (each expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, F]. Checkpoints, and
the loaders that read them (vLLM's), name each expert's own tensors: `mlp.experts.{e}.gate_proj.weight` [F, H],
`.up_proj.weight` [F, H] and `.down_proj.weight` [H, F].
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

FUSED = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
PER_EXPERT = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.\d+\.(gate|up|down)_proj\.weight$")


def fused_expert_names(checkpoint_names: Iterable[str]) -> set[str]:
    """The fused names (`...mlp.experts.gate_up_proj`, `...down_proj`) of the layers whose experts a
    checkpoint names one by one."""
    prefixes = {m["prefix"] for n in checkpoint_names if (m := PER_EXPERT.match(n))}
    return {f"{p}.{kind}" for p in prefixes for kind in ("gate_up_proj", "down_proj")}


def unfuse_experts(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every fused expert tensor split into its experts' checkpoint tensors (views,
    no copy); any other pair passes as it is."""
    for name, tensor in tensors:
        m = FUSED.match(name)
        if m is None:
            yield name, tensor
        elif m["kind"] == "down_proj":  # [E, H, F]
            yield from ((f"{m['prefix']}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0]))
        else:  # gate_up_proj [E, 2F, H]
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                yield f"{m['prefix']}.{e}.gate_proj.weight", gate[e]
                yield f"{m['prefix']}.{e}.up_proj.weight", up[e]


def read_fused_experts(name: str, experts: range, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The fused tensor `name` (`...mlp.experts.gate_up_proj` / `down_proj`) restricted to `experts`, read from a
    checkpoint that names each expert's tensors (`get`: checkpoint name -> tensor): [len(experts), 2F, H] with
    each expert's gate rows then its up rows, or [len(experts), H, F]."""
    m = FUSED.match(name)
    if m["kind"] == "down_proj":
        return torch.stack([get(f"{m['prefix']}.{e}.down_proj.weight") for e in experts])
    return torch.stack([torch.cat([get(f"{m['prefix']}.{e}.{x}_proj.weight") for x in ("gate", "up")])
                        for e in experts])


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The Mixture-of-Experts routers of an HF model in layer order (`mlp.gate`, e.g. Qwen3MoeTopKRouter: its output
    is (logits [N, E], top-k weights [N, k], top-k expert ids [N, k]) of the layer's flattened positions); [] for a
    dense model."""
    return [m for n, m in model.named_modules() if n.endswith(".mlp.gate") and type(m).__name__.endswith("Router")]
