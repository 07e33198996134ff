"""`MegatronPolicyWorker`: Megatron-Core `GPTModel` under tensor, pipeline and data parallelism.

Only what differs from `PolicyWorker` is here:
- build: megatron parallel_state (tp, pp; dp = world / (tp * pp); rank order tp-dp-pp), a GPTModel chunk per
  pipeline stage loaded from the HF directory (weights.py maps the names, model.py builds it);
- forward: Megatron's `get_forward_backward_func` schedule (1F1B under PP, plain loop otherwise), also for
  forward-only log-probs / scores. The schedule's loss closure on the last stage computes vocab-parallel
  log-probs from the local logits [b, t, V/tp] (the full-vocabulary logits are never gathered) and calls the
  shared `loss_fn` through `base.loss_and_metrics`; `calculate_per_token_loss` keeps the contribution undivided;
- gradients: TP all-reduce of replicated-but-partial grads (Qwen3 q/k norms, sequence-parallel norms), the
  tied-embedding grad sum between first and last stage, then a data-parallel SUM (losses use global counts);
- the clipped norm counts every element once (TP duplicates and the last stage's tied copy skipped);
- export: TP shards all-gathered on the owning stage, mapped to full HF tensors, sent to rank 0;
- checkpoints: torch.distributed.checkpoint of HF-named full tensors (weights and optimizer moments), so a
  checkpoint loads at any TP / PP / DP layout.
Optimizer: a torch optimizer over the "main" parameters: the local shards themselves in fp32; in bf16, fp32
master copies with fp32 gradient accumulation. use_distributed_optimizer shards its state over the DP group
(ZeRO-1, torch's ZeroRedundancyOptimizer), not Megatron's DistributedOptimizer.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from nemo_grpo.backends.batching import attention_mask_from_lengths, pool_last_token
from nemo_grpo.backends.mcore import shim, weights
from nemo_grpo.backends.optimizer import optimizer_class
from nemo_grpo.backends.worker import PolicyWorker, accumulate, loss_and_metrics
from nemo_grpo.models.spec import CAUSAL_LM, SEQ_CLS, model_spec
from nemo_grpo.weights.transfer import TensorSpec

REPLICATED_PARTIAL = ("q_layernorm", "k_layernorm")  # per-head norms: under TP each rank sees its heads only


class MegatronPolicyWorker(PolicyWorker):
    """One rank: the GPTModel chunk of its pipeline stage, sharded over its TP group."""

    # ------------------------------------------------------------------------------------------ build
    def _build_model(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from transformers import AutoConfig

        from nemo_grpo.backends.mcore import model as mmodel

        m = self.cfg.megatron_cfg
        tp, pp = self.parallel_layout.tp, self.parallel_layout.pp
        shim.apply()
        if m.sequence_parallel and tp > 1:
            shim.allow_sequence_parallel_norm()
        with shim.device_context():
            if not ps.model_parallel_is_initialized():
                ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
            self.hf_config = self._hf_config_of(AutoConfig.from_pretrained(self.model_path))
            self.spec = model_spec(self.hf_config, tp, pp, self.scalar_head,
                                           transformer_engine=m.layer_spec == "transformer_engine")
            dtype = torch.bfloat16 if self.cfg.precision == "bfloat16" else torch.float32
            self.mconfig = mmodel.transformer_config(self.spec, m, dtype)
            model = mmodel.build_gpt(self.spec, self.mconfig).to(self.device)
        self.tp_size, self.pp_size = tp, pp
        self.tp_rank, self.pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.is_last_stage = self.pp_rank == pp - 1
        self.output_rank = self.is_last_stage and self.tp_rank == 0
        local = weights.to_megatron(mmodel.hf_tensor_reader(self.model_path), self.spec, tp, self.tp_rank, pp,
                                    self.pp_rank)
        mmodel.load_local(model, local)
        mmodel.mark_tensor_parallel(model, weights.tp_split_dims(self.spec, pp, self.pp_rank))
        self.model = model
        self.params = dict(model.named_parameters())
        self.main = self._main_params(local)
        self.entries = {e.hf: e for e in weights.entries(self.spec, pp)}
        self.tied_aliases = weights.tied_aliases(self.spec)

    def _main_params(self, local: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
        """The tensors the optimizer steps, by Megatron name: the parameters themselves in fp32; in bf16, fp32
        master copies made from the checkpoint's fp32 tensors, whose .grad accumulates each backward's bf16
        gradient in fp32 (the bf16 .grad is dropped right after: Megatron's main_grad scheme)."""
        if self.mconfig.params_dtype == torch.float32:
            return self.params
        main = {n: torch.nn.Parameter(local[n].to(self.device, torch.float32)) for n in self.params}
        for n, p in self.params.items():
            p.register_post_accumulate_grad_hook(partial(_accumulate_into, main[n]))
        return main

    def _make_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """Over the main parameters. use_distributed_optimizer: their state sharded over the data-parallel
        group (ZeRO-1, torch's ZeroRedundancyOptimizer: each DP rank steps its share and broadcasts it)."""
        params = list(self.main.values())
        if not self.cfg.megatron_cfg.use_distributed_optimizer or self.dp_size == 1:
            return super()._make_optimizer(params)
        from megatron.core import parallel_state as ps
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = optimizer_class(self.cfg.optimizer)
        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=ps.get_data_parallel_group(),
                                       **kwargs)

    @torch.no_grad()
    def _after_optimizer_step(self) -> None:
        """bf16: the updated fp32 masters rounded into the model's parameters."""
        if self.main is not self.params:
            for n, p in self.params.items():
                p.copy_(self.main[n])

    def _hf_config_of(self, hf_config):
        """The HF config of the model actually built (architecture name matching the head, num_labels=1)."""
        family = model_spec(hf_config, scalar_head=self.scalar_head).family
        table = SEQ_CLS if self.scalar_head else CAUSAL_LM
        hf_config.architectures = [next(a for a, f in table.items() if f == family)]
        if self.scalar_head:
            hf_config.num_labels = 1
        return hf_config

    def _hf_config(self):
        return self.hf_config

    # ------------------------------------------------------------------------------------------ forward
    def _schedule_len(self, t: int) -> int:
        """Columns the schedule runs: t, rounded up to a multiple of tp under sequence parallelism."""
        sp = self.mconfig.sequence_parallel
        return -(-t // self.tp_size) * self.tp_size if sp else t

    def _run_schedule(self, micro_batches: list[dict[str, Any]], seq_len: int,
                      on_output: Callable[[dict, torch.Tensor], Any], forward_only: bool) -> None:
        """Megatron's schedule over micro-batches on device (same row count each; input_ids cut or right-padded
        to seq_len columns). on_output(mb, output) runs on the last stage with the model output ([b, s, V/tp]
        logits or [b, s, 1] scores) and returns the scalar to backpropagate when training (else None)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def step(data_iterator, model):
            mb = next(data_iterator)
            ids = _fit_columns(mb["input_ids"], seq_len)  # [b, s]
            pos = torch.arange(seq_len, device=ids.device)[None, :].expand_as(ids)
            return model(ids, pos, attention_mask=None), partial(closure, mb)

        def closure(mb, output):
            loss = on_output(mb, output)
            if loss is None:
                loss = torch.zeros((), device=output.device)
            return loss, torch.ones((), dtype=torch.int), {}

        with shim.device_context():
            get_forward_backward_func()(
                forward_step_func=step, data_iterator=iter(micro_batches), model=[self.model],
                num_microbatches=len(micro_batches), seq_length=seq_len,
                micro_batch_size=int(micro_batches[0]["input_ids"].shape[0]), forward_only=forward_only)

    def _token_logprobs(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Local logits [b, s, V_pad/tp], input_ids [b, s] -> log-probs [b, s] before masking (column 0 is 0).

        Vocab-parallel: `vocab_parallel_cross_entropy` reduces max / sum-exp over the TP group and overwrites
        its input, so it gets a fresh tensor (the temperature division); padded vocabulary columns are -inf."""
        from megatron.core import tensor_parallel

        scaled = logits[:, :-1].float() / self.cfg.generation.temperature  # [b, s-1, V_pad/tp], a new tensor
        if self.spec.padded_vocab > self.spec.vocab:
            width = scaled.shape[-1]
            col = torch.arange(width, device=scaled.device) + self.tp_rank * width
            scaled = scaled.masked_fill(col >= self.spec.vocab, float("-inf"))
        lp = -tensor_parallel.vocab_parallel_cross_entropy(scaled, input_ids[:, 1:])  # [b, s-1]
        return torch.nn.functional.pad(lp, (1, 0))  # [b, s]

    def _last_stage_output(self, input_ids: torch.Tensor, fn) -> Optional[torch.Tensor]:
        """Forward-only over one micro-batch [b, t] (every stage runs it); fn(output) on the last stage, None
        elsewhere."""
        box = {}
        self._run_schedule([{"input_ids": input_ids}], self._schedule_len(input_ids.shape[1]),
                           lambda mb, out: box.__setitem__("out", fn(out)), forward_only=True)
        return box.get("out")

    def _logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[b, t] -> [b, t] log-probs at generation.temperature (zeros on ranks that are not output ranks)."""
        t = input_ids.shape[1]
        lp = self._last_stage_output(input_ids, lambda out: self._token_logprobs(out, _fit_columns(input_ids,
                                                                                                  out.shape[1])))
        if lp is None:
            return torch.zeros(input_ids.shape, device=input_ids.device)
        return torch.where(attention_mask.bool(), lp[:, :t], torch.zeros_like(lp[:, :t]))

    def _scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                input_lengths: torch.Tensor) -> torch.Tensor:
        """[b, t] -> [b]: the scalar head at position input_lengths - 1 (zeros off the last stage)."""
        scores = self._last_stage_output(input_ids, lambda out: pool_last_token(out, input_lengths))
        return torch.zeros(input_ids.shape[0], device=input_ids.device) if scores is None else scores

    def _forward_backward(self, micro_batches: list[dict[str, Any]], loss_fn, gvs: torch.Tensor,
                          gvt: torch.Tensor) -> dict[str, float]:
        """The schedule over this rank's micro-batches (all cut to the longest row of the step); the last stage's
        loss closure calls the shared loss function. Metrics are summed on the last stage (empty elsewhere)."""
        sizes = {int(mb["input_ids"].shape[0]) for mb in micro_batches}
        if len(sizes) > 1 and self.pp_size > 1:
            raise ValueError(f"pipeline parallelism needs equal micro-batches; got sizes {sorted(sizes)} "
                             "(policy.train_micro_batch_size must divide the per-rank batch)")
        full_t = int(micro_batches[0]["input_ids"].shape[1])
        t = max(1, min(full_t, max(int(mb["input_lengths"].max()) for mb in micro_batches)))
        totals: dict[str, float] = {}

        def on_output(mb, out):  # logits [b, s, V_pad/tp], or scores [b, s, 1] with a scalar head
            loss, metrics = loss_and_metrics(loss_fn, self._train_output_of(out, mb, t, full_t), mb, gvs, gvt)
            accumulate(totals, metrics)
            return loss

        self._run_schedule([self._to_device(mb) for mb in micro_batches], self._schedule_len(t), on_output,
                           forward_only=False)
        return totals

    def _train_output_of(self, out: torch.Tensor, mb: dict[str, Any], t: int, full_t: int) -> torch.Tensor:
        """The last stage's model output -> the loss input: log-probs [b, full_t] or scalar-head scores [b]."""
        if self.scalar_head:
            return pool_last_token(out, mb["input_lengths"]).float()
        lp = self._token_logprobs(out, _fit_columns(mb["input_ids"], out.shape[1]))[:, :t]  # [b, t]
        lp = lp * attention_mask_from_lengths(mb["input_lengths"], t)
        return torch.nn.functional.pad(lp, (0, full_t - t))

    # ------------------------------------------------------------------------------------------ gradients
    def _grads(self, names) -> list[torch.Tensor]:
        out = []
        for n in names:
            p = self.main[n]
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            out.append(p.grad)
        return out

    def _finish_gradients(self) -> None:
        """TP sum of partial grads of replicated params, tied-embedding sum over PP, then the DP sum."""
        from megatron.core import parallel_state as ps

        if self.tp_size > 1:
            names = [n for n, p in self.params.items()
                     if any(k in n for k in REPLICATED_PARTIAL) or getattr(p, "sequence_parallel", False)]
            _all_reduce_flat(self._grads(names), ps.get_tensor_model_parallel_group())
        if self.spec.tied and self.pp_size > 1 and (self.pp_rank in (0, self.pp_size - 1)):
            shared = "embedding.word_embeddings.weight" if self.pp_rank == 0 else "output_layer.weight"
            dist.all_reduce(self._grads([shared])[0], group=ps.get_embedding_group())
        if self.dp_size > 1:
            _all_reduce_flat(self._grads(list(self.params)), ps.get_data_parallel_group())

    def _grad_norm(self) -> float:
        """Global L2 norm over the model-parallel group (DP ranks hold the same summed grads), each element
        counted once: TP-replicated parameters only on TP rank 0, the last stage's tied embedding copy not."""
        from megatron.core import parallel_state as ps

        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for n, p in self.params.items():
            duplicate = getattr(p, "shared", False) or (
                self.tp_rank > 0 and not getattr(p, "tensor_model_parallel", False))
            grad = self.main[n].grad
            if grad is not None and not duplicate:
                sq = sq + grad.detach().float().pow(2).sum()
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        return float(sq.sqrt())

    def _local_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.main.values() if p.grad is not None]

    # ------------------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def _local_weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.params.items()}

    def _export_specs(self) -> list[TensorSpec]:
        return [TensorSpec(e.hf, tuple(e.shape), torch.float32) for e in self.entries.values()]

    def _gather_hf(self, names: list[str], local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Collective: full HF tensors for `names` from per-Megatron-parameter local tensors `local` (weights or
        optimizer moments shaped like them); meaningful on rank 0. The owning stage's DP-rank-0 TP group
        all-gathers, its TP rank 0 maps and sends to rank 0 when it is not rank 0 itself."""
        from megatron.core import parallel_state as ps

        out, gathered = {}, {}
        for name in names:
            e = self.entries[name]
            full = None
            if self.pp_rank == e.stage and self.dp_rank == 0:
                if e.mcore not in gathered:
                    gathered[e.mcore] = _tp_shards(self.params[e.mcore], local[e.mcore],
                                                   ps.get_tensor_model_parallel_group(), self.tp_size)
                full = weights.to_hf(e, gathered[e.mcore], self.spec).contiguous()
            sender = e.stage != 0 and self.pp_rank == e.stage and self.dp_rank == 0 and self.tp_rank == 0
            if sender:
                dist.send(full.cpu() if self.device.type == "cpu" else full, dst=0)
            elif self.rank == 0:
                if e.stage != 0:
                    full = torch.empty(e.shape, dtype=torch.float32, device=self.device)
                    dist.recv(full)
                out[name] = full.to("cpu", copy=True)
        return out

    def _export_tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Full HF tensors of the main (in bf16: the fp32 master) weights."""
        return self._gather_hf(names, {n: p.detach() for n, p in self.main.items()})

    # ------------------------------------------------------------------------------------------ checkpoints
    @property
    def _optimizer_state(self) -> dict:
        """param -> its optimizer state on this rank (sharded: only the parameters this DP rank steps)."""
        return self._local_optimizer.state

    def _owned(self, p: torch.nn.Parameter) -> bool:
        local = self._local_optimizer
        return any(p is q for group in local.param_groups for q in group["params"])

    def _optimizer_moments(self) -> tuple[list[str], dict[str, Any]]:
        """Collective: (names of the per-parameter optimizer tensors, e.g. exp_avg / exp_avg_sq; the scalar
        states by key), as rank 0 sees them (every rank steps at least one parameter's state with rank 0)."""
        state = next((v for v in self._optimizer_state.values() if v), {})
        moments = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        box = [(moments, {k: v for k, v in state.items() if k not in moments})]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _full_moment(self, key: str) -> dict[str, torch.Tensor]:
        """Collective: Megatron parameter name -> this rank's (TP / PP shard of the) optimizer tensor `key`; under
        the sharded optimizer the DP ranks sum their shares (zeros where another rank owns the state)."""
        from megatron.core import parallel_state as ps

        state = self._optimizer_state
        local = {n: state[p][key] if p in state and key in state[p] else torch.zeros_like(p)
                 for n, p in self.main.items()}
        if self._local_optimizer is not self.optimizer:  # sharded: each DP rank holds a share
            _all_reduce_flat(list(local.values()), ps.get_data_parallel_group())
        return local

    def save_checkpoint(self, path: str) -> None:
        """DCP of HF-named full tensors: model/<name>, optim/<moment>/<name> (written from rank 0), plus a per-rank
        file with the scalar optimizer state, scheduler and RNG states. Loadable at any layout."""
        import torch.distributed.checkpoint as dcp

        os.makedirs(path, exist_ok=True)
        names = list(self.entries)
        state = {f"model/{k}": v for k, v in self._export_tensors(names).items()}
        moments, scalars = self._optimizer_moments()
        for key in moments:
            state.update({f"optim/{key}/{k}": v for k, v in self._gather_hf(names, self._full_moment(key)).items()})
        dcp.save(state if self.rank == 0 else {}, checkpoint_id=path)
        self._save_rank_state(path, moments=moments, scalars=scalars)
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Every rank reads the full tensors and keeps its shards (another layout is fine); RNG states only
        when the checkpoint has this rank's file."""
        import torch.distributed.checkpoint as dcp

        extra = self._load_rank_state(path)
        names = [e.hf for e in self.entries.values() if e.hf not in self.tied_aliases]
        loaded = {f"model/{n}": torch.empty(self.entries[n].shape) for n in names}
        for key in extra["moments"]:
            loaded.update({f"optim/{key}/{n}": torch.empty(self.entries[n].shape) for n in names})
        dcp.load(loaded, checkpoint_id=path)
        m = self.cfg.megatron_cfg
        shard = partial(weights.to_megatron, s=self.spec, tp=m.tensor_model_parallel_size, tp_rank=self.tp_rank,
                        pp=m.pipeline_model_parallel_size, pp_rank=self.pp_rank)
        with torch.no_grad():
            for n, t in shard(lambda name: loaded[f"model/{name}"]).items():
                self.params[n].copy_(t)
                self.main[n].copy_(t)
        self._load_optimizer_state({key: shard(lambda name: loaded[f"optim/{key}/{name}"])
                                    for key in extra["moments"]}, extra["scalars"])
        self._restore_schedule_and_rng(extra)

    def _load_optimizer_state(self, moments: dict[str, dict[str, torch.Tensor]], scalars: dict[str, Any]) -> None:
        """moments: key -> Megatron parameter name -> this rank's shard; set for the parameters this rank steps."""
        state = self._optimizer_state
        state.clear()
        if not moments:
            return
        for n, p in self.main.items():
            if self._owned(p):
                state[p].update({key: by_name[n].to(self.device).clone() for key, by_name in moments.items()})
                state[p].update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` over `group` in one collective (flattened, then copied back in place)."""
    if not tensors:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(reduced)


def _tp_shards(param: torch.nn.Parameter, local: torch.Tensor, group, tp: int) -> list[torch.Tensor]:
    """The TP shards of a Megatron parameter's companion tensor `local` in TP rank order ([local] if replicated)."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return [local.detach()]
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return parts


def _fit_columns(ids: torch.Tensor, width: int) -> torch.Tensor:
    """input_ids [b, t] cut or right-padded with 0 to [b, width] (causal attention: padding never reaches
    the real positions)."""
    t = ids.shape[1]
    return ids[:, :width] if t >= width else torch.nn.functional.pad(ids, (0, width - t))


def _accumulate_into(main: torch.nn.Parameter, param: torch.nn.Parameter) -> None:
    """Post-accumulate-grad hook of a bf16 parameter: add its gradient to the fp32 master's, then drop it."""
    grad = param.grad.float()
    main.grad = grad if main.grad is None else main.grad.add_(grad)
    param.grad = None

