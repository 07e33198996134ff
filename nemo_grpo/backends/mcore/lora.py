"""LoRA on Megatron-Core's tensor-parallel linears (policy.lora, backend megatron): peft's model, TP-aware.

Each targeted HF projection gets its own adapter pair, as peft's (so TP and PP do not change the model):
  linear_qkv  (column-parallel)  q_proj, k_proj, v_proj    A [r, h] replicated over TP, B [out/tp, r] this rank's rows
  linear_fc1  (column-parallel)  gate_proj, up_proj        likewise
  linear_proj (row-parallel)     o_proj                    A [r, in/tp] this rank's columns, B [out, r] replicated
  linear_fc2  (row-parallel)     down_proj                 likewise
`LoraLinear` wraps the Megatron linear (`base_layer`, frozen): y = base(x) + scale * B A dropout(x), the fused
linears' B rows placed in the base's local output layout (weights.fuse_qkv's per-KV-group interleave; fc1's
[gate_local; up_local]). Communication is r-wide: column-parallel u = A x is the identity whose backward sums over
TP (with sequence parallelism: all-gathered over the sequence); row-parallel u = A_local x_local is summed over TP
(reduce-scattered over the sequence). Under sequence parallelism column A and row B see only this rank's tokens:
their gradients are partial over TP and carry Megatron's `sequence_parallel` tag, which the worker's TP sum of
replicated-but-partial gradients handles; split adapters carry Megatron's TP attributes (norm, gathers).
Export merges W + scale * B A on the local shard; adapters travel as full tensors under peft's keys (`entries`,
split kinds of weights.py), so checkpoints and the PEFT directory do not depend on the layout.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel as tpl
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from nemo_grpo.backends.mcore import weights
from nemo_grpo.backends.mcore.weights import Entry
from nemo_grpo.models import lora
from nemo_grpo.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Part:
    """One HF projection of a (fused) Megatron linear: its leaf name and its rows of the local output."""
    leaf: str
    rows: int


class LoraLinear(nn.Module):
    """A Megatron Column/RowParallelLinear (`base_layer`, frozen) plus one adapter per targeted HF projection:
    lora_A[leaf] [r, in(/tp)], lora_B[leaf] [out_leaf(/tp), r]. x [s(/tp), b, in(/tp)] -> (base output +
    scale * adapters' output, [s(/tp), b, out(/tp)]; the base's bias), as Megatron's linears return."""

    def __init__(self, base_layer: nn.Module, parts: list[Part], targets: list[str], place: Callable,
                 row_parallel: bool, rank: int, scale: float, dropout: float, sequence_parallel: bool):
        super().__init__()
        self.base_layer, self.parts, self.targets, self.place = base_layer, parts, targets, place
        self.row_parallel, self.rank, self.scale, self.dropout = row_parallel, rank, scale, dropout
        self.sequence_parallel, self.enabled = sequence_parallel, True
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()

    def enable_adapters(self, enabled: bool) -> None:
        self.enabled = enabled

    def forward(self, x: torch.Tensor, *args, **kwargs):
        out, bias = self.base_layer(x, *args, **kwargs)
        if not self.enabled:
            return out, bias
        u = torch.cat([self._dropout(x) @ self.lora_A[leaf].t() for leaf in self.targets], dim=-1)  # [.., n*r]
        return out + self.scale * (self._communicate(u) @ self.fused_b(self.lora_B).t()), bias

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """peft's dropout on the adapter's input, a mask per adapter; where TP ranks hold different elements of x
        (row-parallel, or sequence-parallel) from Megatron's per-TP-rank RNG, else the same mask on every rank."""
        if not (self.training and self.dropout):
            return x
        if self.row_parallel or self.sequence_parallel:
            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout)
        return F.dropout(x, self.dropout)

    def _communicate(self, u: torch.Tensor) -> torch.Tensor:
        """u [s(/tp), b, n*r] -> what B multiplies. Column-parallel: replicated (its backward sums the partial
        gradients over TP; SP: all-gathered over the sequence); row-parallel: partial, summed over TP (SP:
        reduce-scattered over the sequence)."""
        if self.row_parallel:
            return (tpl.reduce_scatter_to_sequence_parallel_region(u) if self.sequence_parallel
                    else tpl.reduce_from_tensor_model_parallel_region(u))
        return (tpl.gather_from_sequence_parallel_region(u) if self.sequence_parallel
                else tpl.copy_to_tensor_model_parallel_region(u))

    def fused_b(self, lora_b: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The adapters' B in the base's local output layout, [out(/tp), n*r]: B of the i-th target in column
        block i, zero rows for the projections that have no adapter."""
        n, r = len(self.targets), self.rank
        ref = lora_b[self.targets[0]]
        blocks = []
        for p in self.parts:
            if p.leaf in self.targets:
                i = self.targets.index(p.leaf)
                blocks.append(F.pad(lora_b[p.leaf], (i * r, (n - 1 - i) * r)))  # [rows, n*r]
            else:
                blocks.append(ref.new_zeros(p.rows, n * r))
        return self.place(blocks)

    def merged(self, weight: torch.Tensor, lora_a: Mapping[str, torch.Tensor],
               lora_b: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The local base shard [out(/tp), in(/tp)] + scale * fused B @ stacked A, in fp32."""
        a = torch.cat([lora_a[leaf] for leaf in self.targets])  # [n*r, in(/tp)]
        return lora.merged(weight.float(), a, self.fused_b(lora_b), self.scale)


def _leaf(e: Entry) -> str:
    return e.hf.rsplit(".", 2)[-2]  # model.layers.0.self_attn.q_proj.weight -> q_proj


def _linears(s: ModelSpec, pp: int) -> dict[tuple[int, str], list[Entry]]:
    """(stage, stage-local Megatron linear, e.g. decoder.layers.0.self_attention.linear_qkv) -> the HF projection
    weights it holds, in its fused order."""
    out: dict[tuple[int, str], list[Entry]] = {}
    for e in weights.entries(s, pp):
        if e.hf.endswith(".weight") and _leaf(e) in lora.LINEAR_LAYERS:
            out.setdefault((e.stage, e.mcore.removesuffix(".weight")), []).append(e)
    return out


def adapter_entries(s: ModelSpec, pp: int, targets: list[str], rank: int) -> dict[str, Entry]:
    """peft key -> the adapter as an Entry (every stage): full HF shape (A [r, in], B [out, r]), stage-local
    parameter `<linear>.lora_A.<leaf>` and split kind (column-parallel: A copy, B rows; row-parallel: A col,
    B copy)."""
    out = {}
    for (stage, linear), es in _linears(s, pp).items():
        for e in es:
            if _leaf(e) not in targets:
                continue
            row = e.kind == "col"  # split along the input dim: o_proj, down_proj
            module = e.hf.removesuffix(".weight")
            for which, shape, kind in (("lora_A", (rank, e.shape[1]), "col" if row else "copy"),
                                       ("lora_B", (e.shape[0], rank), "copy" if row else "rows")):
                key = lora.peft_key(module, which)
                out[key] = Entry(key, shape, stage, f"{linear}.{which}.{_leaf(e)}", kind)
    return out


def parameters_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's parameters under Megatron's names: a LoraLinear's base weight is `<linear>.weight`."""
    return {n.replace(".base_layer.", "."): p for n, p in model.named_parameters()}


class MegatronLora:
    """The adapters of this rank's model chunk: built on the targeted linears (the rest frozen), their fp32
    initial values, the merge of exported weights and the peft-keyed table (`entries`, every stage)."""

    def __init__(self, model: nn.Module, s: ModelSpec, lora_cfg, config, tp: int, tp_rank: int, pp: int,
                 pp_rank: int, seed: int):
        self.spec, self.tp, self.tp_rank, self.pp_rank = s, tp, tp_rank, pp_rank
        targets = lora.target_modules(lora_cfg)
        self.entries = adapter_entries(s, pp, targets, lora_cfg.rank)
        self.initial: dict[str, torch.Tensor] = {}  # this stage's adapters by parameter name, fp32
        self.layers: dict[str, LoraLinear] = {}  # stage-local linear name -> its wrapper
        local_qkv = dataclasses.replace(s, heads=s.heads // tp, kv_heads=s.kv_heads // tp)
        for (stage, linear), es in _linears(s, pp).items():
            chosen = [_leaf(e) for e in es if _leaf(e) in targets]
            if stage != pp_rank or not chosen:
                continue
            row = es[0].kind == "col"
            parts = [Part(_leaf(e), e.shape[0] // (1 if row else tp)) for e in es]
            place = (lambda blocks: weights.fuse_qkv(*blocks, local_qkv)) if es[0].kind == "q" else torch.cat
            parent, _, child = linear.rpartition(".")
            wrapper = LoraLinear(model.get_submodule(linear), parts, chosen, place, row, lora_cfg.rank,
                                 lora.scale(lora_cfg), lora_cfg.dropout, config.sequence_parallel)
            setattr(model.get_submodule(parent), child, wrapper)
            self.layers[linear] = wrapper
            for e in es:
                if _leaf(e) in chosen:
                    self._add(wrapper, e, seed, config)
        lora.freeze_base(model)
        if model.pre_process and config.recompute_granularity is not None:
            # full recompute checkpoints each layer: its input must need a gradient for the adapters to get one
            model.embedding.register_forward_hook(lambda module, args, out: out.requires_grad_(True))

    def _add(self, wrapper: LoraLinear, e: Entry, seed: int, config) -> None:
        """lora_A / lora_B of HF projection e on `wrapper`: this rank's shards in the model's dtype and device,
        with Megatron's TP attributes; the one partial over TP under SP tagged `sequence_parallel`."""
        leaf, module = _leaf(e), e.hf.removesuffix(".weight")
        base = wrapper.base_layer.weight
        for which in ("lora_A", "lora_B"):
            entry = self.entries[lora.peft_key(module, which)]
            full = lora.initial_a(module, entry.shape, seed) if which == "lora_A" else torch.zeros(entry.shape)
            local = weights.shard(entry.kind, [full], self.spec, self.tp, self.tp_rank).contiguous()
            p = nn.Parameter(local.to(base.device, base.dtype))
            getattr(wrapper, which)[leaf] = p
            if entry.kind in weights.SPLIT_DIM:
                set_tensor_model_parallel_attributes(p, True, weights.SPLIT_DIM[entry.kind], 1)
            elif config.sequence_parallel:  # column A, row B: only this rank's tokens
                p.sequence_parallel = True
            self.initial[entry.mcore] = local

    def shard(self, get: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full adapters by peft key (`get`) -> this rank's shards by parameter name."""
        return {e.mcore: weights.shard(e.kind, [get(e.hf)], self.spec, self.tp, self.tp_rank).contiguous()
                for e in self.entries.values() if e.stage == self.pp_rank}

    def merged(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Local fp32 tensors by parameter name -> the same with each wrapped base weight merged (W + s B A)."""
        out = dict(local)
        for linear, layer in self.layers.items():
            a = {leaf: local[f"{linear}.lora_A.{leaf}"] for leaf in layer.targets}
            b = {leaf: local[f"{linear}.lora_B.{leaf}"] for leaf in layer.targets}
            out[f"{linear}.weight"] = layer.merged(local[f"{linear}.weight"], a, b)
        return out
