"""FSDP2 + tensor parallelism for Hugging Face decoder models (Llama, Qwen2, Qwen3), and DTensor-aware grad helpers.

Layout: a 2-D device mesh (dp, tp), tp innermost (rank = dp_rank * tp + tp_rank). Under context parallelism the
mesh's dp axis is dp x cp (cp inner): CP ranks hold the same weights, so FSDP shards over them too and sums their
gradients (backends/context_parallel.py).
- TP (`parallelize_module` over the tp axis): q/k/v/gate/up ColwiseParallel (output features split), o/down
  RowwiseParallel (input features split, output all-reduced). Attention then runs on the local heads.
  The embedding, the final norm and lm_head / the score head stay replicated over tp: every TP rank computes
  the full-vocabulary logits (simple, exact; a vocab-parallel lm_head is future work).
- FSDP2 (`fully_shard` over the dp axis) on every decoder layer, then on the root, always, also when dp == 1
  (then it only turns the remaining parameters into DTensors, so every parameter is one kind of tensor).
- Gradient reduction over dp is a SUM (divide factor 1): the loss contract already normalizes by global counts.
- LoRA (peft's layers, dtensor/lora.py): the base weight is split as above; a column-parallel layer's B is
  split on its outputs too (A replicated), a row-parallel layer's A on its inputs (B replicated), so the
  adapter's output matches the base output's local piece.
- Mixture-of-Experts (Qwen3-MoE): the experts and the router stay replicated over tp; under bf16 the router
  is an FSDP unit of its own in fp32 (its input cast up), so routing is computed in fp32 as on Megatron.
- Qwen3's q_norm / k_norm (per-head RMSNorm weights, replicated over tp) see only the local heads under TP:
  their gradients are partial sums and are all-reduced over the tp group after backward.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from nemo_grpo.models.experts import moe_routers
from nemo_grpo.models.spec import check_divisible

COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")
LOCAL_HEAD_NORMS = ("q_norm", "k_norm")  # Qwen3: RMSNorm over head_dim applied per (local) head


def build_mesh(device_type: str, dp: int, tp: int) -> DeviceMesh:
    """The (dp, tp) mesh over all ranks, tp innermost."""
    return init_device_mesh(device_type, (dp, tp), mesh_dim_names=("dp", "tp"))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of an HF model (causal LM or sequence classifier): base_model.layers."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers at base_model.layers; the dtensor back end "
                         "supports Llama / Qwen2 / Qwen3-style models")
    return layers


def tp_plan(model: nn.Module) -> dict:
    """module name -> ParallelStyle for the projections of every decoder layer."""
    plan = {}
    prefix = model.base_model_prefix
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            style = ColwiseParallel if leaf in COLWISE else RowwiseParallel if leaf in ROWWISE else None
            if style is None:
                continue
            path = f"{prefix}.layers.{i}.{name}"
            if hasattr(module, "base_layer"):  # peft's LoRA layer: B split like a column, A like a row weight
                plan[f"{path}.base_layer"] = style()
                adapter = "lora_B" if style is ColwiseParallel else "lora_A"
                plan.update({f"{path}.{adapter}.{k}": style() for k in getattr(module, adapter)})
            else:
                plan[path] = style()
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    check_divisible(model.config, tp_mesh.size(), 1, "policy.dtensor_cfg.tensor_parallel_size")
    parallelize_module(model, tp_mesh, tp_plan(model))


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: Optional[torch.dtype] = None) -> None:
    """fully_shard every decoder layer, then the root; fp32 master weights, params cast to param_dtype in compute.

    Parameters are resharded after every forward (also the root's), so in-place writes to the sharded
    parameters (reference swaps, checkpoint loads) are always seen by the next forward.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if param_dtype is not None:  # MoE routers compute in fp32 (their inputs cast up), as Megatron's router dtype
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for router in moe_routers(model):
            fully_shard(router, mesh=dp_mesh, mp_policy=fp32, reshard_after_forward=True)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    for module in model.modules():  # gradients are summed over dp, not averaged (losses use global counts)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def local_head_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient is partial under TP (Qwen3 q_norm / k_norm weights)."""
    return [p for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] in LOCAL_HEAD_NORMS]


def all_reduce_grads(params: Iterable[nn.Parameter], group) -> None:
    """Sum the local gradient shards of `params` over `group` (in place)."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(local(p.grad), group=group)


def _reduction_groups(t: torch.Tensor) -> tuple:
    """Process groups over which the local pieces of `t` must be summed (its sharded / partial mesh dims)."""
    if not isinstance(t, DTensor):
        return ()
    mesh = t.device_mesh
    return tuple(mesh.get_group(i) for i, pl in enumerate(t.placements) if pl.is_shard() or pl.is_partial())


@torch.no_grad()
def grad_norm(grads: list[torch.Tensor]) -> float:
    """Global L2 norm of gradients (DTensor on any mesh, or plain); the same on every rank.

    Local squared sums are grouped by the process groups they must be summed over: one all-reduce per group.
    """
    sums: dict[tuple, torch.Tensor] = {}
    for g in grads:
        key = _reduction_groups(g)
        sq = local(g).detach().float().pow(2).sum()
        sums[key] = sums[key] + sq if key in sums else sq
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")
    for groups, sq in sums.items():  # same keys in the same order on every rank (same model structure)
        for group in groups:
            dist.all_reduce(sq, group=group)
        total = total + sq.to(total.device)
    return float(total.sqrt())


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a plain tensor as it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's piece of `t`, the region of the global tensor it holds: one slice per dim); a plain tensor
    is all of itself. Under FSDP2 a rank's region may be empty (more ranks than rows)."""
    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """Collective for DTensors: the whole tensor (plain tensors are returned as they are)."""
    return t.full_tensor() if isinstance(t, DTensor) else t
