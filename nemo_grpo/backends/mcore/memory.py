"""The Megatron back end's memory model for the planner (planning/memory.py asks it through its BackendSpec).

What it keeps, read off its worker:
per pipeline stage: parameters in the precision; in bf16 fp32 master copies (made also for a
scoring-only reward model); fp32 gradients of the main parameters; optimizer state (Adam: two fp32
moments); masters and moments / dp with use_distributed_optimizer (Megatron's DistributedOptimizer,
whose DDP gradient buffer stays whole); 1F1B keeps min(pp - stage, micro-batches) micro-batches of
activations on a stage. Mixture-of-Experts: a rank keeps experts / expert_model_parallel_size of
each layer, whole over tp (expert tensor parallel size 1); their gradients are reduced, and under
the distributed optimizer their masters and moments sharded, over the expert-data-parallel ranks
(tp x cp x dp / ep), the rest over dp; plus the alltoall dispatch buffers of the layer running.
Layouts the back end does not build for MoE yet (tp > 1 without sequence parallelism) are
sized all the same, with a note that training refuses them.
"""

from __future__ import annotations

import math

from nemo_grpo.backends import activations as act
from nemo_grpo.backends.memory_model import (DTYPE_BYTES, Device, Shards, Workload, activation_rows, dispatch_row,
                                             forward_rows, host_rows, lora_layer, optimizer_bytes, optimizer_row,
                                             shards, sharded)
from nemo_grpo.models.counts import is_expert, on_tp_rank, stored_tensors
from nemo_grpo.models.spec import ModelSpec, pipeline_stage


def megatron_stage_split(spec: ModelSpec, tp: int, pp: int, stage: int, ep: int = 1) -> tuple[int, int]:
    """(non-expert, expert) parameters of one rank of pipeline stage `stage` under TP tp and EP ep: split tensors
    / tp (the vocabulary padded to spec.padded_vocab), replicated ones (norms, routers) whole; the routed experts
    / ep and whole over tp (expert tensor parallel size 1, as Megatron-Core's MoE recipes set it). With tied
    embeddings and pp > 1 the last stage holds its own copy of the embedding as output layer."""
    on_stage = [t for t in stored_tensors(spec) if pipeline_stage(t, spec, pp) == stage]
    dense = sum(on_tp_rank(t, spec, tp, vocab_parallel=True) for t in on_stage if not is_expert(t))
    if spec.tied and pp > 1 and stage == pp - 1:
        dense += spec.padded_vocab * spec.hidden // tp
    return dense, sum(math.prod(t.shape) for t in on_stage if is_expert(t)) // ep


def megatron_stage_params(spec: ModelSpec, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """All parameters of one rank of `stage` (megatron_stage_split's two parts)."""
    return sum(megatron_stage_split(spec, tp, pp, stage, ep))


def _weight_shards(dense: int, expert: int, tp: int, dp: int, cp: int, ep: int) -> list[Shards]:
    """What Megatron's data-parallel gradient reduction and DistributedOptimizer shard over: the non-expert
    parameters over dp (x cp), the experts over their expert-data-parallel group, tp x cp x dp / ep ranks (the
    ranks of a pipeline stage holding the same experts: expert tensor parallel size 1)."""
    ranks, label = shards(dp, cp)
    out = [Shards(dense, ranks, label if ranks > 1 else "")]
    if expert:
        out.append(Shards(expert, tp * cp * dp // ep, f"experts / expert dp {tp * cp * dp // ep}"))
    return out


def _gradient_row(p, groups: list[Shards]) -> dict[str, float]:
    """fp32 gradients of the main parameters; Megatron's DistributedOptimizer reducing in bf16
    (grad_reduce_in_fp32 false) keeps DDP's bf16 buffer plus an fp32 copy of this rank's shard."""
    m, n = p.megatron_cfg, sum(g.params for g in groups)
    if p.precision == "bfloat16" and m.use_distributed_optimizer and \
            not m.distributed_data_parallel_config.grad_reduce_in_fp32:
        shard, where = sharded(groups, 4.0)
        return {f"gradients (bfloat16; fp32 shard{where})": n * 2.0 + shard}
    return {"gradients (fp32)": n * 4.0}


def _rank_weights(p, spec, tp: int, pp: int, stage: int, dp: int, cp: int) -> tuple[dict, dict, float]:
    """One rank of `stage`: the weights it keeps (parameters; in bf16 fp32 masters), the rows training adds
    (gradients, optimizer state) and the bytes of its parameters. The experts count / ep, their sharded state /
    their expert-data-parallel ranks (_weight_shards). LoRA: the frozen base in the precision alone, whole on
    every DP rank; the adapters (`LoRA ` rows) as full-parameter training keeps parameters."""
    m, b = p.megatron_cfg, DTYPE_BYTES[p.precision]
    dense, expert = megatron_stage_split(spec, tp, pp, stage, m.expert_model_parallel_size)
    state, tag, weights = {}, "", (dense + expert) * b
    if p.lora.enabled:
        state[f"frozen base weights ({p.precision})"] = weights
        dense, expert, tag = lora_layer(p, spec, tp) * (spec.num_layers // pp), 0, "LoRA "
    state[f"LoRA adapters ({p.precision})" if tag else f"parameters ({p.precision})"] = (dense + expert) * b
    grads = _weight_shards(dense, expert, tp, dp, cp, m.expert_model_parallel_size)
    # DistributedOptimizer: masters and optimizer state sharded as the gradients are reduced; else whole
    kept = grads if m.use_distributed_optimizer else [Shards(g.params) for g in grads]
    if b == 2:
        masters, where = sharded(kept, 4.0)
        state[f"{tag}fp32 master weights{where}"] = masters
    train = {tag + k: v for k, v in [*_gradient_row(p, grads).items(), optimizer_row(p, kept)]}
    return state, train, weights


def plan_devices(p, spec, w: Workload, world: int) -> tuple[list[Device], dict[str, float]]:
    """A Device per pipeline stage, and the host memory of one rank (of the stage with the most parameters)."""
    m = p.megatron_cfg
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, w.cp
    dp, b = world // (tp * pp * cp), DTYPE_BYTES[p.precision]
    impl = "megatron_te" if m.layer_spec == "transformer_engine" else \
        "megatron_sdpa" if m.attention_backend == "sdpa" else "megatron"
    sp = bool(m.sequence_parallel and tp > 1)
    devices, host = [], {}
    for stage in range(pp):
        state, trained, weights = _rank_weights(p, spec, tp, pp, stage, dp, cp)
        last = stage == pp - 1
        vocab = spec.padded_vocab // tp if last and not spec.scalar_head else 0
        phases = {}
        if w.training:
            train = dict(state, **trained)
            train.update(activation_rows(spec, impl, b, w, tp, sp, spec.num_layers // pp,
                                         min(pp - stage, w.micro_batches), m.activation_checkpointing))
            train.update(dispatch_row(spec, b, w.train_micro_batch * w.seq_len / cp / (tp if sp else 1)))
            if vocab:
                train["logits"] = w.train_micro_batch * w.seq_len / cp * act.logits_bytes_per_token(vocab, b)
            phases["training"] = train
        forward = (w.forward_seq_len or w.seq_len) * w.forward_batch / cp / (tp if sp else 1)
        phases["log-prob forward" if w.training else "scoring"] = dict(
            state, **forward_rows(spec, impl, b, w, tp, sp, vocab), **dispatch_row(spec, b, forward))
        devices.append(Device(f"stage {stage}" if pp > 1 else "every rank", phases))
        host = max(host, host_rows(w, weights=weights, state=sum(state.values()) + optimizer_bytes(trained)),
                   key=lambda h: sum(h.values()))
    return devices, host
