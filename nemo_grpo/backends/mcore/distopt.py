"""Megatron-Core's distributed optimizer for the Megatron back end (policy.megatron_cfg.use_distributed_optimizer).

`DistributedDataParallel` puts the gradients in contiguous buffers and reduce-scatters them over the data-parallel
group, bucket by bucket while the backward still runs (`distributed_data_parallel_config.overlap_grad_reduce`);
`DistributedOptimizer` keeps the fp32 main weights and the optimizer state of this DP rank's shard of each buffer
only, steps them, and all-gathers the updated weights. The worker keeps its own step sequence around it
(backends/actor.py: one clipping rule, a non-finite norm skips the step), so only Megatron's pieces are used:
`finish_grad_sync`, `prepare_grads`, `get_grad_norm`, the inner torch optimizer, the main-to-model copy and
`start_param_sync`. Per-parameter views of the sharded state (`ShardedState`) keep checkpoints layout-free.

Mixture-of-Experts under expert parallelism: DDP keeps the experts (`allreduce=False`) in buffers of their own,
reduce-scattered over the expert-data-parallel group, and `get_megatron_optimizer` chains a dense and an expert
DistributedOptimizer (the latter sharding over that group); both step through one torch optimizer here. Under
TP the experts are whole on every TP rank (expert TP 1, model.mark_replicated_experts marks them so).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def megatron_optimizer_config(opt_cfg, precision_bf16: bool, params_dtype: torch.dtype):
    """policy.optimizer (adamw | sgd) -> megatron OptimizerConfig; clipping stays the worker's (clip_grad 0)."""
    common = dict(lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay, use_distributed_optimizer=True, clip_grad=0.0,
                  bf16=precision_bf16, params_dtype=params_dtype)
    if opt_cfg.name == "adamw":
        return OptimizerConfig(optimizer="adam", adam_beta1=opt_cfg.betas[0], adam_beta2=opt_cfg.betas[1],
                               adam_eps=opt_cfg.eps, **common)
    if opt_cfg.name == "sgd":
        return OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, **common)
    raise ValueError(f"policy.optimizer.name '{opt_cfg.name}' is unknown; known: adamw, sgd")


class MegatronDistributedOptimizer:
    """DDP around this rank's GPTModel chunk plus Megatron's DistributedOptimizer over it.

    `inner` is the torch optimizer that steps the fp32 main shards (the worker's scheduler drives its lr)."""

    def __init__(self, model: nn.Module, config, ddp_cfg, opt_cfg, bf16: bool):
        self.ddp = DistributedDataParallel(
            config=config, module=model,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=ddp_cfg.grad_reduce_in_fp32, overlap_grad_reduce=ddp_cfg.overlap_grad_reduce,
                use_distributed_optimizer=True))
        config.no_sync_func = self.ddp.no_sync  # the schedules reduce only after a step's last micro-batch
        # config_overrides={}: weight decay on every parameter, as torch's AdamW over all of them
        chained = get_megatron_optimizer(megatron_optimizer_config(opt_cfg, bf16, config.params_dtype),
                                         [self.ddp], config_overrides={})
        self.chained = chained
        # the dense DistributedOptimizer (DP group); under expert parallelism the experts' (expert-DP group) too
        self.optimizers = list(getattr(chained, "chained_optimizers", [chained]))
        for opt in self.optimizers:  # Megatron gives every optimizer the attention TP group: under TP with expert
            if any(g.get("is_expert_parallel") for g in opt.optimizer.param_groups):  # TP 1 its norm would
                opt.tp_group = ps.get_expert_tensor_parallel_group()  # skip the experts on TP ranks > 0
        self.inner: torch.optim.Optimizer = _joined([opt.optimizer for opt in self.optimizers])

    @property
    def buffers(self) -> list:
        """DDP's parameter-and-gradient buffers: the dense ones (DP group), then the experts' (expert-DP group)."""
        return self.ddp.buffers + self.ddp.expert_parallel_buffers

    def start_step(self) -> None:
        """Before a step's first backward: zero the gradient buffers."""
        self.ddp.zero_grad_buffer()

    def reduce_gradients(self, before: Callable[[], None]) -> None:
        """After the last backward: `before()` (reductions over TP / the tied embedding's stages on the unreduced
        main_grads), then the data-parallel reduce-scatter, then this shard's gradients into the main shards."""
        if not self.ddp.ddp_config.overlap_grad_reduce:
            before()
            self.ddp.finish_grad_sync()
        else:  # the reduce-scatter is under way since the backward: TP sums are shard-local-safe after it
            self.ddp.finish_grad_sync()
            before()
        self.chained.prepare_grads()

    def grad_norm(self) -> float:
        """Megatron's global norm: each optimizer's shard of main gradients (the experts' too), summed over all
        ranks of the optimizer instance; TP duplicates and the tied copy counted once, so each expert once."""
        return float(self.chained.get_grad_norm())

    def local_grads(self) -> list[torch.Tensor]:
        return [p.grad for group in self.inner.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def after_step(self) -> None:
        """The stepped main shards into the model's parameters, then their all-gather over DP."""
        for opt in self.optimizers:
            opt._copy_main_params_to_model_params()
        self.ddp.start_param_sync()  # the dense and the expert buffers, each over its own group


def _joined(inners: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """One torch optimizer with one param group over the main shards of `inners` (each a group per optimizer,
    with the same hyperparameters: config_overrides={}), so the worker's step and scheduler drive them all and the
    scheduler's state has one lr per run whatever the layout (checkpoints resume with or without the experts'
    optimizer); one optimizer with one group is itself. A copy of the first whose group is assigned, as
    DistributedOptimizer assigns its shards (views of the buffers, which torch's add_param_group refuses)."""
    groups = [group for inner in inners for group in inner.param_groups]
    if len(groups) == 1:
        return inners[0]
    settings = [{k: v for k, v in g.items() if k not in ("params", "is_expert_parallel")} for g in groups]
    if any(s != settings[0] for s in settings):
        raise ValueError(f"the distributed optimizer's param groups differ beyond their parameters: {settings}")
    joined = copy.copy(inners[0])
    joined.param_groups = [{**settings[0], "params": [p for g in groups for p in g["params"]]}]
    joined.state = defaultdict(dict)
    return joined


class ShardedState:
    """Per model parameter: the slice of its flattened elements this rank's DistributedOptimizer owns, the fp32
    main shard and the optimizer state of that slice. Full (TP-local, EP-local) tensors are rebuilt by summing the
    zero-padded slices over the group that shards them (DP; the experts': expert-DP), and a full tensor is
    loaded by each rank taking its slice."""

    def __init__(self, dist_opt: MegatronDistributedOptimizer, params: dict[str, nn.Parameter]):
        self.inner, self.params = dist_opt.inner, params
        group_of = {p: buffer.data_parallel_group for buffer in dist_opt.buffers for p in buffer.params}
        self.groups = {name: group_of[p] for name, p in params.items()}  # name -> the group sharding it
        self.ranges: dict[str, tuple[int, int]] = {}
        self.mains: dict[str, torch.Tensor] = {}
        for opt in dist_opt.optimizers:
            main_of = {}  # model parameter -> the inner optimizer's fp32 main shard (fp32 parameters: a view of it)
            for models, mains in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                  (opt.model_fp32_groups, opt.shard_fp32_groups)):
                for model_group, main_group in zip(models, mains):
                    main_of.update(zip(model_group, main_group))
            for name, p in params.items():
                if p in main_of:
                    r = opt._get_model_param_range_map(p)["param"]
                    self.ranges[name], self.mains[name] = (r.start, r.end), main_of[p]

    def full(self, local_of: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Collective over DP and expert-DP: name -> the full TP-local fp32 tensor of local_of(main shard) (None
        where this rank holds nothing of it)."""
        out = {}
        for name, p in self.params.items():
            flat = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if name in self.ranges:
                part = local_of(self.mains[name])
                if part is not None:
                    start, end = self.ranges[name]
                    flat[start:end] = part.reshape(-1)
            out[name] = flat.view(p.shape)
        for group in dict.fromkeys(self.groups.values()):  # the dense group, then the experts' (same order on all)
            names = [n for n in out if self.groups[n] is group]
            joined = _flatten_dense_tensors([out[n] for n in names])
            dist.all_reduce(joined, group=group)
            out.update(zip(names, _unflatten_dense_tensors(joined, [out[n] for n in names])))
        return out

    def main_weights(self) -> dict[str, torch.Tensor]:
        return self.full(lambda main: main.detach())

    def moments(self, key: str) -> dict[str, torch.Tensor]:
        return self.full(lambda main: self.inner.state.get(main, {}).get(key))

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]],
             scalars: dict) -> None:
        """Full TP-local tensors by name -> this rank's main shards and optimizer state."""
        self.inner.state.clear()
        for name, (start, end) in self.ranges.items():
            main = self.mains[name]
            main.copy_(weights[name].reshape(-1)[start:end].to(main.device, main.dtype))
            if moments:
                state = self.inner.state[main]
                state.update({k: by_name[name].reshape(-1)[start:end].to(main.device).clone()
                              for k, by_name in moments.items()})
                state.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})
