"""`MegatronEngine`: Megatron-Core `GPTModel` under tensor, pipeline and data parallelism.

The back end's PolicyEngine (backends/engine.py):
- build: megatron parallel_state (tp, pp; dp = world / (tp * pp); rank order tp-dp-pp), a GPTModel chunk per
  pipeline stage loaded from the HF directory (weights.py maps the names, model.py builds it);
- forward and forward_backward: Megatron's `get_forward_backward_func` schedule (1F1B under PP, plain loop
  otherwise), also for forward-only log-probs / scores. The schedule's loss closure on the last stage computes
  vocab-parallel log-probs from the local logits [b, t, V/tp] (the full-vocabulary logits are never gathered)
  and calls the actor's micro-batch loss; `calculate_per_token_loss` keeps the contribution undivided;
- gradients: TP all-reduce of replicated-but-partial grads (Qwen3 q/k norms, sequence-parallel norms), the
  tied-embedding grad sum between first and last stage, then a data-parallel SUM (losses use global counts);
- the clipped norm counts every element once (TP duplicates and the last stage's tied copy skipped);
- Mixture-of-Experts (Qwen3-MoE; under TP with sequence parallelism, each expert whole on every TP rank:
  expert TP 1): Megatron's MoELayer (TopKRouter, SequentialMLP experts, alltoall token dispatch);
  expert_model_parallel_size splits each layer's experts over ep of the tp x dp ranks (each loads its own);
  expert gradients are summed over the expert-data-parallel group, counted once per expert in the norm, and
  all-gathered over the expert-parallel group for export; the
  router's load-balancing / z-loss and routing metrics are backends/router.py's (HF's definition), from the
  router logits model.record_router_logits captures, not Megatron's own aux-loss machinery; under PP each
  stage adds its layers' terms to its output (RouterLosses.add_stage, exchanging assignments with the others);
- export: TP shards all-gathered on the owning stage, mapped to full HF tensors, sent to rank 0;
- checkpoints: torch.distributed.checkpoint of HF-named full tensors (weights and optimizer moments), so a
  checkpoint loads at any TP / PP / DP layout;
- LoRA (policy.lora): adapters on the targeted linears, the base frozen (lora.py); only trainable parameters
  have main copies, gradients and optimizer state; export merges them, checkpoints hold the adapters only.
Optimizer: a torch optimizer over the "main" parameters: the local shards themselves in fp32; in bf16, fp32
master copies with fp32 gradient accumulation. use_distributed_optimizer: Megatron-Core's DistributedDataParallel
(gradient buffers reduce-scattered over DP, overlapping the backward) and DistributedOptimizer (fp32 main weights
and optimizer state of this DP rank's shard only; the experts' over the expert-DP group), distopt.py; the step
sequence stays the actor's.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from transformers import AutoConfig

from nemo_grpo.backends.engine import EngineSetup, MicroBatchLoss, PolicyEngine, move_parameters, on_device
from nemo_grpo.backends.mcore import model as mmodel
from nemo_grpo.backends.mcore import shim, weights
from nemo_grpo.backends.mcore.attention import context_params, segment_params
from nemo_grpo.backends.mcore.distopt import MegatronDistributedOptimizer, ShardedState
from nemo_grpo.backends.mcore.lora import MegatronLora, parameters_by_name
from nemo_grpo.backends.model_inputs import ModelInputs, natural_width
from nemo_grpo.backends.optimizer import build_optimizer
from nemo_grpo.backends.router import RouterLosses, StageExchange
from nemo_grpo.models.reader import hf_tensor_reader
from nemo_grpo.models.spec import CAUSAL_LM, SEQ_CLS, model_spec
from nemo_grpo.weights.sender import write_gathered
from nemo_grpo.weights.transfer import TensorSpec

REPLICATED_PARTIAL = ("q_layernorm", "k_layernorm")  # per-head norms: under TP each rank sees its heads only


class MegatronEngine(PolicyEngine):
    """One rank: the GPTModel chunk of its pipeline stage, sharded over its TP group."""

    def __init__(self, setup: EngineSetup):
        super().__init__(setup)
        self._build_model()
        self.optimizer = self._build_optimizer()

    # ------------------------------------------------------------------------------------------ build
    def _build_model(self) -> None:
        m = self.cfg.megatron_cfg
        tp, pp, ep = self.parallel_layout.tp, self.parallel_layout.pp, m.expert_model_parallel_size
        shim.apply()
        shim.moe_router_without_transformer_engine()
        if m.sequence_parallel and tp > 1:
            shim.allow_sequence_parallel_norm()
        with shim.device_context():
            if not ps.model_parallel_is_initialized():
                ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
            self.hf_config = self._hf_config_of(AutoConfig.from_pretrained(self.model_path))
            self.spec = model_spec(self.hf_config, tp, pp, self.scalar_head,
                                           transformer_engine=m.layer_spec == "transformer_engine")
            dtype = torch.bfloat16 if self.cfg.precision == "bfloat16" else torch.float32
            self.mconfig = mmodel.transformer_config(self.spec, m, dtype)
            model = mmodel.build_gpt(self.spec, self.mconfig, m.attention_backend, m.moe_grouped_gemm).to(self.device)
        self.tp_size, self.pp_size = tp, pp
        self.data_parallel_group = ps.get_data_parallel_group()
        # sequence parallelism splits each CP rank's columns over tp; the unfused attention takes packed rows
        # through the dense mask only
        self.width_factor = tp if self.mconfig.sequence_parallel else 1
        self.dense_mask_only = m.attention_backend != "sdpa"
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        # the data this rank takes (its CP peers take the same rows); Megatron's data-parallel group is dp x cp
        # (it is built with cp 1: the CP ranks are replicas of the weights whose gradients are summed)
        self.dp_rank, self.dp_size = self.parallel_layout.rank_coords(self.rank)["dp"], self.parallel_layout.dp
        self.replica_rank = ps.get_data_parallel_rank()  # this rank's index among the replicas of its shard
        self.ep_size, self.ep_rank = ep, ps.get_expert_model_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.is_last_stage = self.pp_rank == pp - 1
        self.output_rank = self.is_last_stage and self.tp_rank == 0 and self.context.rank == 0
        local = weights.to_megatron(hf_tensor_reader(self.model_path), self.spec, tp, self.tp_rank, pp,
                                    self.pp_rank, ep, self.ep_rank)
        mmodel.load_local(model, local)
        mmodel.mark_tensor_parallel(model, weights.tp_split_dims(self.spec, pp, self.pp_rank))
        mmodel.mark_replicated_experts(model, tp)
        self.adapters = None  # policy.lora: MegatronLora, the adapters on the targeted linears (base frozen)
        if self.cfg.lora.enabled:
            self.adapters = MegatronLora(model, self.spec, self.cfg.lora, self.mconfig, tp, self.tp_rank, pp,
                                         self.pp_rank, self.seed)
            local.update(self.adapters.initial)
        self.model = model
        if self.spec.experts:
            stages = StageExchange(_pipeline_gloo_group()) if pp > 1 else None
            self.router = RouterLosses(m, self.spec.experts_per_token, stages)
            stage_layers = self.spec.num_layers // pp  # every layer sparse (model_spec), split evenly
            self.moe_layers = slice(self.pp_rank * stage_layers, (self.pp_rank + 1) * stage_layers)
            mmodel.record_router_logits(model, self.router.recorder, self.mconfig.sequence_parallel)
        self.replay_routes = bool(self.spec.experts) and m.moe_router_replay != "none"
        self.rope_positions = mmodel.RotaryPositions(model)
        self.params = parameters_by_name(model)
        self.dist_opt = None  # MegatronDistributedOptimizer with use_distributed_optimizer (_make_optimizer)
        self._initial_shards = local  # fp32, for the distributed optimizer's main weights; dropped once made
        trainable = {n: p for n, p in self.params.items() if p.requires_grad}
        self.main = trainable if m.use_distributed_optimizer else self._main_params(local, trainable)
        self.entries = {e.hf: e for e in weights.entries(self.spec, pp)}
        self.tied_aliases = weights.tied_aliases(self.spec)

    def close(self) -> None:
        """Megatron-Core's model-parallel state (its groups, the global buffers), which is per process, and the
        router's pipeline group."""
        ps.destroy_model_parallel()
        if self.router is not None and self.router.stages is not None:
            dist.destroy_process_group(self.router.stages.group)

    def _main_params(self, local: dict[str, torch.Tensor], trainable: dict[str, torch.nn.Parameter]
                     ) -> dict[str, torch.nn.Parameter]:
        """The tensors the optimizer steps, by Megatron name: the trainable parameters themselves in fp32; in
        bf16, fp32 master copies made from the checkpoint's fp32 tensors, whose .grad accumulates each
        backward's bf16 gradient in fp32 (the bf16 .grad is dropped right after: Megatron's main_grad scheme)."""
        if self.mconfig.params_dtype == torch.float32:
            return trainable
        main = {n: torch.nn.Parameter(local[n].to(self.device, torch.float32)) for n in trainable}
        for n, p in trainable.items():
            p.register_post_accumulate_grad_hook(partial(_accumulate_into, main[n]))
        return main

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """Over the main parameters; use_distributed_optimizer: Megatron's, whose inner torch optimizer steps this
        DP rank's fp32 main shards (set from the checkpoint's fp32 tensors, not from bf16 parameters)."""
        local, self._initial_shards = self._initial_shards, None
        m = self.cfg.megatron_cfg
        if not m.use_distributed_optimizer:
            return build_optimizer(list(self.main.values()), self.cfg.optimizer)
        with shim.device_context():
            self.dist_opt = MegatronDistributedOptimizer(self.model, self.mconfig, m.distributed_data_parallel_config,
                                                         self.cfg.optimizer, self.cfg.precision == "bfloat16")
        self.sharded = ShardedState(self.dist_opt, self.main)
        self.sharded.load(local, {}, {})
        return self.dist_opt.inner

    @torch.no_grad()
    def optimizer_step(self) -> None:
        """The step; in bf16 the updated fp32 masters then rounded into the model's parameters (the distributed
        optimizer: its main shards, then the all-gather of the parameters over DP)."""
        self.optimizer.step()
        if self.dist_opt is not None:
            with shim.device_context():
                self.dist_opt.after_step()
        elif self.mconfig.params_dtype != torch.float32:
            for n, main in self.main.items():
                self.params[n].copy_(main)

    def move(self, device: torch.device) -> None:
        """Offload / onload on GPUs. The distributed optimizer's parameters and gradients live in DDP's buffers,
        which move as buffers (the parameters, and the fp32 main shards of fp32 parameters, stay views into
        them); the fp32 main shards of bf16 parameters and frozen parameters (LoRA's base) are tensors of
        their own."""
        if self.dist_opt is None:
            return move_parameters(self.model, self.optimizer, device)
        for buffer in self.dist_opt.buffers:
            buffer.offload_to_cpu() if device.type == "cpu" else buffer.reload_from_cpu()
        for p in self.params.values():
            if not p.requires_grad:
                p.data = p.data.to(device)
        for opt in self.dist_opt.optimizers:
            for group in opt.shard_fp32_from_float16_groups:
                for main in group:
                    main.data = main.data.to(device)

    def _hf_config_of(self, hf_config):
        """The HF config of the model actually built (architecture name matching the head, num_labels=1)."""
        family = model_spec(hf_config, scalar_head=self.scalar_head).family
        table = SEQ_CLS if self.scalar_head else CAUSAL_LM
        hf_config.architectures = [next(a for a, f in table.items() if f == family)]
        if self.scalar_head:
            hf_config.num_labels = 1
        return hf_config

    # ------------------------------------------------------------------------------------------ forward
    def _run_schedule(self, micro_batches: list[tuple[dict[str, Any], ModelInputs]],
                      on_output: Callable[[dict, ModelInputs, torch.Tensor], Any], forward_only: bool) -> None:
        """Megatron's schedule over (micro-batch, its model inputs) pairs on device, all inputs of one shape
        [r, s]. on_output(mb, inputs, output) runs on the last stage with the model output ([r, s, V/tp] logits
        or [r, s, 1] scores) and returns the scalar to backpropagate when training (else None). Packed rows pass
        their segments (attention per segment) or block-diagonal mask (True = masked, Megatron's convention) and
        per-sequence RoPE positions; under context parallelism each rank's share of the positions, their true
        RoPE positions and the CP shard (attention.context_params)."""
        def step(data_iterator, model):
            mb, inputs = next(data_iterator)
            ids = inputs.input_ids  # [r, s]
            own_positions = inputs.packed or inputs.context is not None
            pos = inputs.position_ids if own_positions else torch.arange(ids.shape[1], device=ids.device)[None]
            mask = ~inputs.attention_mask if inputs.attention_mask is not None and inputs.packed else None
            # this stage's MoE layers' recorded routes [r, t, L_stage, k], for replay or the stage's agreement
            staged = self.router is not None and self.router.stages is not None and not forward_only
            routes = inputs.from_rows(mb["routed_experts"][:, :, self.moe_layers], -1) \
                if "routed_experts" in mb and (self.replay_routes or staged) else None
            replay = routes is not None and self.replay_routes
            if self.router is not None:
                self.router.recorder.start()
            if replay:  # a training forward routes as recorded (policy.megatron_cfg.moe_router_replay)
                mmodel.replay_routes(routes, self.mconfig.sequence_parallel)
            with self.rope_positions.use(inputs.position_ids if own_positions else None):
                output = model(ids, pos.expand_as(ids), attention_mask=mask,
                               packed_seq_params=_attention_params(inputs))
            if replay:
                mmodel.stop_replay()
            if staged:
                output = self.router.add_stage(output, inputs.token_mask, routes)
            return output, partial(closure, mb, inputs)

        def closure(mb, inputs, output):
            loss = on_output(mb, inputs, output)
            if loss is None:
                loss = torch.zeros((), device=output.device)
            return loss, torch.ones((), dtype=torch.int), {}

        r, s = micro_batches[0][1].input_ids.shape
        with shim.device_context():
            get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(micro_batches), model=[self.model],
                num_microbatches=len(micro_batches), seq_length=s, micro_batch_size=r, forward_only=forward_only)

    def _token_logprobs(self, logits: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """Local logits [r, s, V_pad/tp] -> log-probs [r, t] (inputs.logprobs_from_next: gathered over CP, 0 in
        column 0 and where inputs.token_mask is 0).

        Vocab-parallel: `vocab_parallel_cross_entropy` reduces max / sum-exp over the TP group and overwrites
        its input, so it gets a fresh tensor (the temperature division); padded vocabulary columns are -inf."""
        scaled = logits.float() / self.cfg.generation.temperature  # [r, s, V_pad/tp], a new tensor
        if self.spec.padded_vocab > self.spec.vocab:
            width = scaled.shape[-1]
            col = torch.arange(width, device=scaled.device) + self.tp_rank * width
            scaled = scaled.masked_fill(col >= self.spec.vocab, float("-inf"))
        lp = -tensor_parallel.vocab_parallel_cross_entropy(scaled, inputs.next_tokens)  # [r, s]
        return inputs.logprobs_from_next(lp)

    def _last_stage_output(self, inputs: ModelInputs, fn, empty: torch.Tensor) -> torch.Tensor:
        """Forward-only over one micro-batch's inputs (every stage runs it); fn(output) on the last stage,
        `empty` (zeros of the result's shape) elsewhere."""
        box = {}
        self._run_schedule([({}, inputs)], lambda mb, inp, out: box.__setitem__("out", fn(out)), forward_only=True)
        return box.get("out", empty)

    def _head_output(self, out: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
        """The last stage's model output (logits [r, s, V_pad/tp], or scores [r, s, 1] with a scalar head) ->
        log-probs [r, t], or the scores at each sequence's last token [b]."""
        return inputs.last_tokens(out)[:, 0] if self.scalar_head else self._token_logprobs(out, inputs)

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """-> log-probs [r, t] at generation.temperature, or scores [b] (zeros off the output ranks' stage)."""
        empty = torch.zeros((inputs.seq_len if self.scalar_head else inputs.token_mask).shape, device=self.device)
        return self._last_stage_output(inputs, lambda out: self._head_output(out, inputs), empty)

    def forward_backward(self, micro_batches: list[dict[str, Any]], loss: MicroBatchLoss) -> None:
        """The schedule over this rank's micro-batches, all at the width of the widest (the longest row, or the
        fullest packed row); the last stage's loss closure calls `loss`."""
        micro_batches = [on_device(mb, self.device) for mb in micro_batches]
        if self.dist_opt is not None:
            self.dist_opt.start_step()
        sizes = {int(mb["input_ids"].shape[0]) for mb in micro_batches}
        packed = self.cfg.sequence_packing.enabled
        if len(sizes) > 1 and self.pp_size > 1 and not packed:
            raise ValueError(f"pipeline parallelism needs equal micro-batches; got sizes {sorted(sizes)} "
                             "(policy.train_micro_batch_size must divide the per-rank batch)")
        width = max(natural_width(mb, packed, self.width_multiple()) for mb in micro_batches)
        self._run_schedule([(mb, self.model_inputs(mb, width)) for mb in micro_batches],
                           lambda mb, inputs, out: loss(mb, inputs, self._head_output(out, inputs)),
                           forward_only=False)

    # ------------------------------------------------------------------------------------------ gradients
    def reduce_gradients(self) -> float:
        self._finish_gradients()
        return self._grad_norm()

    def _grads(self, names) -> list[torch.Tensor]:
        """The gradient tensors of `names` as the step reduces them: DDP's main_grad views, or the main .grad."""
        if self.dist_opt is not None:
            return [self.params[n].main_grad for n in names]
        out = []
        for n in names:
            p = self.main[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def _finish_gradients(self) -> None:
        """TP sum of partial grads of replicated params, tied-embedding sum over PP, then the DP sum (the
        distributed optimizer: DDP's reduce-scatter, then this shard's gradients into the main shards)."""
        if self.dist_opt is not None:
            with shim.device_context():
                return self.dist_opt.reduce_gradients(before=self._model_parallel_grad_sums)
        self._model_parallel_grad_sums()
        experts = [n for n in self.main if _is_expert(self.params[n])]
        if ps.get_data_parallel_world_size() > 1:
            _all_reduce_flat(self._grads([n for n in self.main if n not in experts]), ps.get_data_parallel_group())
        if experts and ps.get_expert_data_parallel_world_size() > 1:  # an expert's replicas: other EP groups' ranks
            _all_reduce_flat(self._grads(experts), ps.get_expert_data_parallel_group())

    def _model_parallel_grad_sums(self) -> None:
        """TP sum of the partial gradients of replicated parameters; the tied embedding's sum over its stages
        (trainable parameters only)."""
        if self.tp_size > 1:
            names = [n for n in self.main if any(k in n for k in REPLICATED_PARTIAL)
                     or getattr(self.params[n], "sequence_parallel", False)]
            _all_reduce_flat(self._grads(names), ps.get_tensor_model_parallel_group())
        shared = "embedding.word_embeddings.weight" if self.pp_rank == 0 else "output_layer.weight"
        if self.spec.tied and self.pp_size > 1 and self.pp_rank in (0, self.pp_size - 1) and shared in self.main:
            dist.all_reduce(self._grads([shared])[0], group=ps.get_embedding_group())

    def _grad_norm(self) -> float:
        """Global L2 norm over the model-parallel group (DP ranks hold the same summed grads), each element
        counted once: TP-replicated parameters only on TP rank 0, the last stage's tied embedding copy not; the
        experts' squares (whole on every TP rank: expert TP 1) summed over the expert-model-parallel ranks (each
        holds its own experts) instead."""
        if self.dist_opt is not None:
            with shim.device_context():
                return self.dist_opt.grad_norm()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        expert_sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for n, main in self.main.items():
            p = self.params[n]
            duplicate = getattr(p, "shared", False) or (self.tp_rank > 0 and not _is_expert(p)
                                                        and not getattr(p, "tensor_model_parallel", False))
            grad = main.grad
            if grad is None or duplicate:
                continue
            if _is_expert(p):
                expert_sq = expert_sq + grad.detach().float().pow(2).sum()
            else:
                sq = sq + grad.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        if self.spec.experts:
            dist.all_reduce(expert_sq, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        return float((sq + expert_sq).sqrt())

    def local_grads(self) -> list[torch.Tensor]:
        if self.dist_opt is not None:
            return self.dist_opt.local_grads()
        return [p.grad for p in self.main.values() if p.grad is not None]

    # ------------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def local_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params.items()}

    def weight_specs(self) -> list[TensorSpec]:
        return [TensorSpec(e.hf, tuple(e.shape), torch.float32) for e in self.entries.values()]

    def write_weight_bucket(self, bucket: list[TensorSpec], views: Optional[dict[str, torch.Tensor]],
                            in_place: bool) -> None:
        """Gathered on rank 0, which writes (a rank's local shards are not HF slices)."""
        write_gathered(self, bucket, views)

    def _gather_hf(self, names: list[str], local: dict[str, torch.Tensor],
                   table: Optional[dict[str, weights.Entry]] = None) -> dict[str, torch.Tensor]:
        """Collective: full HF tensors for `names` of `table` (default: the model's; LoRA adapters: peft's keys)
        from per-Megatron-parameter local tensors `local` (weights or optimizer moments shaped like them);
        meaningful on rank 0. The owning stage's DP-rank-0 TP group all-gathers, its TP rank 0 maps and sends to
        rank 0 when it is not rank 0 itself. Experts: the expert-parallel group of expert-DP rank 0 all-gathers
        each rank's experts (DP rank 0 is in it)."""
        out, gathered = {}, {}
        for name in names:
            e = (table or self.entries)[name]
            full = None
            if e.kind in weights.EXPERT_LINEAR:
                if self.pp_rank == e.stage and self.edp_rank == 0:
                    full = self._gather_experts(e, local)
            elif self.pp_rank == e.stage and self.replica_rank == 0:
                if e.mcore not in gathered:
                    gathered[e.mcore] = _tp_shards(self.params[e.mcore], local[e.mcore],
                                                   ps.get_tensor_model_parallel_group(), self.tp_size)
                full = weights.to_hf(e, gathered[e.mcore], self.spec).contiguous()
            sender = e.stage != 0 and self.pp_rank == e.stage and self.replica_rank == 0 and self.tp_rank == 0
            if sender:
                dist.send(full.cpu() if self.device.type == "cpu" else full, dst=0)
            elif self.rank == 0:
                if e.stage != 0:
                    full = torch.empty(e.shape, dtype=torch.float32, device=self.device)
                    dist.recv(full)
                out[name] = full.to("cpu", copy=True)
        return out

    def _gather_experts(self, e: weights.Entry, local: dict[str, torch.Tensor]) -> torch.Tensor:
        """Collective over the expert-parallel group: expert entry e's full HF tensor [E, ...] from each rank's
        local experts (`local`, by Megatron name)."""
        mine = torch.stack([local[n].detach() for n in weights.expert_params(e, self.spec, self.ep_size)])
        if self.ep_size == 1:
            return mine
        parts = [torch.empty_like(mine) for _ in range(self.ep_size)]
        dist.all_gather(parts, mine.contiguous(), group=ps.get_expert_model_parallel_group())
        return torch.cat(parts)

    def _main_weights(self) -> dict[str, torch.Tensor]:
        """Collective over DP: the trainable weights in fp32 by Megatron name, from the main (in bf16: the fp32
        master) copies; the distributed optimizer's bf16 masters are DP shards, summed into full tensors."""
        if self.dist_opt is not None and self.cfg.precision == "bfloat16":
            return self.sharded.main_weights()
        return {n: p.detach() for n, p in self.main.items()}

    def gather_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full HF tensors in fp32: trainable weights from _main_weights, frozen ones from the model; with LoRA
        each targeted weight merged, W + scale * B A, on the local shard before the gather."""
        local = self._main_weights()
        local.update({n: p.detach().float() for n, p in self.params.items() if n not in local})
        return self._gather_hf(names, self.adapters.merged(local) if self.adapters else local)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        if self.adapters is None:
            raise NotImplementedError("MegatronEngine has no LoRA adapters")
        return self._gather_hf(list(self.adapters.entries), self._main_weights(), self.adapters.entries)

    # ------------------------------------------------------------------------------------------ checkpoints
    def _optimizer_moments(self) -> tuple[list[str], dict[str, Any]]:
        """Collective: (names of the per-parameter optimizer tensors, e.g. exp_avg / exp_avg_sq; the scalar
        states by key), as rank 0 sees them (rank 0 steps a share of every kind of state)."""
        state = next((v for v in self.optimizer.state.values() if v), {})  # (distributed: its inner optimizer)
        moments = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        box = [(moments, {k: v for k, v in state.items() if k not in moments})]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _full_moment(self, key: str) -> dict[str, torch.Tensor]:
        """Collective: Megatron parameter name -> this rank's (TP / PP shard of the) optimizer tensor `key`; the
        distributed optimizer's DP shares are summed into it."""
        if self.dist_opt is not None:
            return self.sharded.moments(key)
        state = self.optimizer.state
        return {n: state[p][key] if p in state and key in state[p] else torch.zeros_like(p)
                for n, p in self.main.items()}

    def _checkpoint_table(self) -> dict[str, weights.Entry]:
        """What a checkpoint holds, by name: the HF tensors; with LoRA the adapters under peft's keys only (the
        frozen base is reloaded from the model directory)."""
        return self.adapters.entries if self.adapters else self.entries

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """DCP of HF-named full tensors: model/<name>, optim/<moment>/<name> (written from rank 0); the rank file
        keeps the moments' names and the scalar optimizer state. Loadable at any layout."""
        table = self._checkpoint_table()
        state = {f"model/{k}": v for k, v in self._gather_hf(list(table), self._main_weights(), table).items()}
        moments, scalars = self._optimizer_moments()
        for key in moments:
            full = self._gather_hf(list(table), self._full_moment(key), table)
            state.update({f"optim/{key}/{k}": v for k, v in full.items()})
        dcp.save(state if self.rank == 0 else {}, checkpoint_id=path)
        return {"moments": moments, "scalars": scalars}

    def load_checkpoint(self, path: str, extra: dict[str, Any]) -> None:
        """Every rank reads the full tensors and keeps its shards (another layout is fine)."""
        table = self._checkpoint_table()
        names = [n for n in table if n not in self.tied_aliases]
        loaded = {f"model/{n}": torch.empty(table[n].shape) for n in names}
        for key in extra["moments"]:
            loaded.update({f"optim/{key}/{n}": torch.empty(table[n].shape) for n in names})
        dcp.load(loaded, checkpoint_id=path)
        m = self.cfg.megatron_cfg
        shard = self.adapters.shard if self.adapters else partial(
            weights.to_megatron, s=self.spec, tp=m.tensor_model_parallel_size, tp_rank=self.tp_rank,
            pp=m.pipeline_model_parallel_size, pp_rank=self.pp_rank, ep=self.ep_size, ep_rank=self.ep_rank)
        local = shard(lambda name: loaded[f"model/{name}"])
        with torch.no_grad():
            for n, t in local.items():
                self.params[n].copy_(t)
                self.main[n].copy_(t)
        self._load_optimizer_state(local, {key: shard(lambda name: loaded[f"optim/{key}/{name}"])
                                           for key in extra["moments"]}, extra["scalars"])

    def _load_optimizer_state(self, shards: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]],
                              scalars: dict[str, Any]) -> None:
        """shards: Megatron parameter name -> this rank's shard (fp32); moments: key -> the same, per state."""
        if self.dist_opt is not None:
            return self.sharded.load(shards, moments, scalars)
        state = self.optimizer.state
        state.clear()
        if not moments:
            return
        for n, p in self.main.items():
            state[p].update({key: by_name[n].to(self.device).clone() for key, by_name in moments.items()})
            state[p].update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})


def _pipeline_gloo_group():
    """A gloo group of this rank's pipeline (Megatron's pipeline group: its ranks in stage order), for the
    router's exchange between stages (backends/router.StageExchange). Every rank creates every pipeline's, in
    one order, as torch.distributed requires."""
    mine = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    group = None
    for ranks in sorted({tuple(r) for r in every}):
        created = dist.new_group(list(ranks), backend="gloo")
        if list(ranks) == mine:
            group = created
    return group


def _attention_params(inputs: ModelInputs):
    """What GPTModel passes down to the core attention for these inputs: the CP shard, a packed row's segments
    (attention per segment), or None."""
    if inputs.context is not None:
        return context_params(inputs.context)
    return segment_params(inputs.cu_seqlens) if inputs.varlen else None


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` over `group` in one collective (flattened, then copied back in place)."""
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(reduced)


def _is_expert(param: torch.nn.Parameter) -> bool:
    """A routed expert's parameter under expert or tensor parallelism: marked `allreduce=False` (by Megatron at
    ep > 1, by model.mark_replicated_experts at tp > 1; at tp = ep = 1 they are not, and the expert-data-parallel
    group is the data-parallel one)."""
    return not getattr(param, "allreduce", True)


def _tp_shards(param: torch.nn.Parameter, local: torch.Tensor, group, tp: int) -> list[torch.Tensor]:
    """The TP shards of a Megatron parameter's companion tensor `local` in TP rank order ([local] if replicated)."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return [local.detach()]
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return parts


def _accumulate_into(main: torch.nn.Parameter, param: torch.nn.Parameter) -> None:
    """Post-accumulate-grad hook of a bf16 parameter: add its gradient to the fp32 master's, then drop it."""
    grad = param.grad.float()
    main.grad = grad if main.grad is None else main.grad.add_(grad)
    param.grad = None

