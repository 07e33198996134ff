"""Per-GPU memory of every role of a recipe on its cluster, phase by phase; layouts that do not fit are rejected
with the numbers. Arithmetic on the config and the models' HF configs (planning/params.py): no GPU, no weights.

What each back end keeps, read off nemo_grpo/backends/:
  megatron   per pipeline stage: parameters in the precision; in bf16 fp32 master copies (made also for a
             scoring-only reward model); fp32 gradients of the main parameters; optimizer state (Adam: two fp32
             moments); masters and moments / dp with use_distributed_optimizer (Megatron's DistributedOptimizer,
             whose DDP gradient buffer stays whole); 1F1B keeps min(pp - stage, micro-batches) micro-batches of
             activations on a stage. Mixture-of-Experts: a rank keeps experts / expert_model_parallel_size of
             each layer, whole over tp (expert tensor parallel size 1); their gradients are reduced, and under
             the distributed optimizer their masters and moments sharded, over the expert-data-parallel ranks
             (tp x cp x dp / ep), the rest over dp; plus the alltoall dispatch buffers of the layer running.
             Layouts the back end does not build for MoE yet (tp > 1 without sequence parallelism) are
             sized all the same, with a note that training refuses them.
  dtensor    FSDP2: fp32 parameters, gradients and optimizer state sharded over dp (linear weights split over
             tp first); the largest unit all-gathered in the compute dtype, x2 (the next one is prefetched); loading
             builds the model sharded (on the meta device) and reads each rank's slices from the checkpoint:
             the rank's fp32 shards plus at most one whole tensor in fp32 being read.
  reference  a host-memory copy of each rank's shards swapped into the live parameters for its forward: no
             GPU memory. With LoRA the reference is the frozen base with the adapters disabled: no copy at all.
  LoRA       (policy.lora) the frozen base weights alone: no fp32 masters, no gradients, no optimizer state;
             Megatron keeps them in the precision, whole on every DP rank (the distributed optimizer shards
             only what it steps), FSDP2 in fp32 (as it keeps every parameter), sharded over dp. The adapters (A [r, in],
             B [out, r] per targeted linear; column-parallel q/k/v/gate/up: A whole, B / tp; row-parallel
             o/down: A / tp, B whole; per pipeline stage on Megatron) are kept as full-parameter training keeps
             parameters: masters, gradients, optimizer state and their division by dp as above. Activations are
             counted as without LoRA: the adapters' rank-r intermediates are negligible.
  context    (context_parallel_size cp, both back ends) the cp ranks of a row act as data-parallel ranks for
  parallel   the weights: parameters, masters, gradients and optimizer state shard over dp x cp wherever they
             shard over dp; each rank keeps the activations, logits and packing mask of 1/cp of a row's tokens,
             plus the full-length K and V its attention all-gathers: of every layer (kept for the backward), of
             one layer with recomputation and in a forward.
  vLLM       gpu_memory_utilization of each device for its weights (bf16, / its tp) and KV cache. The engine runs
             as data-parallel replicas of tp devices each (ResourcePlan.generation_replicas), each a full copy of
             the weights with a KV cache of its own; the rows are one device's, the notes count the replicas.
             Colocated, the policy moves to host memory while vLLM generates and vLLM sleeps (level 1) while the
             policy trains: the two phases are checked apart.
Activations assume every sequence at policy.max_total_sequence_length, a packed row full at its token budget
(planning/activations.py). Every GPU also keeps RUNTIME_RESERVE_GIB for the CUDA context, NCCL buffers and
allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_grpo.distributed.resource_plan import counted, node_list, plan_resources
from nemo_grpo.errors import ConfigError
from nemo_grpo.layout import policy_layout
from nemo_grpo.models.lora import target_modules
from nemo_grpo.models.spec import check_expert_split, megatron_moe_unbuilt
from nemo_grpo.planning import activations as act
from nemo_grpo.planning.params import decoder_spec, hf_config
from nemo_grpo.planning.params import (dtensor_rank_params, largest_fsdp_unit, largest_tensor, lora_layer_params,
                                       megatron_stage_split, total_params)

GIB = float(1 << 30)
RUNTIME_RESERVE_GIB = 3.0
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}  # fp32 tensors per parameter
RESERVE = "runtime reserve"
VLLM_WEIGHTS = "vLLM weights (bf16, / its TP)"


@dataclass
class Device:
    """One kind of GPU of a role (every rank alike, or one pipeline stage): bytes by component, per phase."""
    label: str
    phases: dict[str, dict[str, float]] = field(default_factory=dict)

    def total(self, phase: str) -> float:
        return sum(self.phases[phase].values())

    def peak(self) -> tuple[str, float]:
        """(phase, bytes) of the phase that needs the most."""
        return max(((p, self.total(p)) for p in self.phases), key=lambda x: x[1])


@dataclass
class RolePlan:
    """One role's devices, e.g. the policy: megatron TP 8 x PP 2 x DP 3 on nodes 0-5."""
    role: str
    layout: str
    devices: list[Device]
    gpus_per_node: int
    host_per_gpu: dict[str, float] = field(default_factory=dict)  # host memory a GPU's process keeps
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # besides devices over the budget (e.g. no KV cache)


@dataclass
class MemoryPlan:
    gpu_bytes: float
    roles: list[RolePlan]

    def problems(self) -> list[str]:
        out = []
        for role in self.roles:
            for d in role.devices:
                phase, need = d.peak()
                if need > self.gpu_bytes:
                    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in d.phases[phase].items() if v)
                    out.append(f"{role.role} ({role.layout}), {d.label}: {phase} needs {need / GIB:.1f} GiB per "
                               f"GPU > cluster.gpu_memory_gib {self.gpu_bytes / GIB:g} ({parts})")
            out += [f"{role.role}: {p}" for p in role.problems]
        return out

    def table(self) -> str:
        return "\n\n".join(_role_table(r, self.gpu_bytes) for r in self.roles)


def _role_table(r: RolePlan, gpu_bytes: float) -> str:
    """Rows: components (their largest value over phases), then each phase's total, then the peak; a column
    per kind of device; GiB."""
    width = max(34, *(len(k) + 2 for d in r.devices for ph in d.phases.values() for k in ph))
    head = f"{r.role}: {r.layout}"
    lines = [head, f"{'GiB per GPU':<{width}}" + "".join(f"{d.label:>14}" for d in r.devices)]
    rows: list[str] = []
    for d in r.devices:
        for ph in d.phases.values():
            rows += [k for k in ph if k not in rows and k != RESERVE]
    for k in rows + [RESERVE]:
        vals = [max((ph.get(k, 0.0) for ph in d.phases.values()), default=0.0) for d in r.devices]
        lines.append(f"  {k:<{width - 2}}" + "".join(f"{v / GIB:>14.2f}" if v else f"{'-':>14}" for v in vals))
    for phase in r.devices[0].phases:
        lines.append(f"  = {phase:<{width - 4}}" + "".join(f"{d.total(phase) / GIB:>14.2f}" for d in r.devices))
    verdicts = []
    for d in r.devices:
        need = d.peak()[1]
        verdicts.append(f"{need / GIB:.1f} {'ok' if need <= gpu_bytes else 'OVER'}")
    peak = f"peak of {gpu_bytes / GIB:g} GiB"
    lines.append(f"{peak:<{width}}" + "".join(f"{v:>14}" for v in verdicts))
    host = sum(r.host_per_gpu.values()) * r.gpus_per_node
    if host:
        parts = ", ".join(f"{k} {v * r.gpus_per_node / GIB:.0f}" for k, v in r.host_per_gpu.items())
        lines.append(f"host memory per node: {host / GIB:.0f} GiB ({parts})")
    return "\n".join(lines + [f"note: {n}" for n in r.notes])


# ---------------------------------------------------------------------------------------------- policies
@dataclass
class Workload:
    """What one data-parallel rank of a policy processes (rows of `seq_len` tokens; a packed row holds a token
    budget)."""
    seq_len: int
    train_micro_batch: int  # rows per forward/backward
    micro_batches: int  # per optimizer step on one data-parallel rank
    forward_batch: int  # rows per log-prob / scoring forward
    training: bool
    reference: bool  # a host copy of the initial weights
    offload: bool = False  # moved to host memory while a colocated vLLM generates (CUDA)
    forward_seq_len: int = 0  # tokens of a forward row, if not seq_len (packing: logprob_mb_tokens)
    packed: bool = False  # one packed row of a token budget per micro-batch
    dense_mask: bool = False  # the packed row carries a block-diagonal mask [t, t] (else attention per segment)
    cp: int = 1  # context-parallel ranks sharing each row: a rank holds 1/cp of its tokens, all of its K/V


def policy_workload(p, dp: int, reference: bool, offload: bool, cp: int = 1) -> Workload:
    """A policy's Workload: fixed micro-batches of sequences at policy.max_total_sequence_length; with sequence
    packing one packed row of train_mb_tokens (logprob_mb_tokens in the forward), as many per step as the
    rank's sequences need at full length; with dynamic batching as many full-length rows as the budget holds.
    The rows are a data-parallel rank's, shared by its cp context-parallel ranks. A packed row's dense
    block-diagonal mask exists with policy.sequence_packing.attention=mask or Megatron's unfused attention,
    never under context parallelism (its attention masks each query chunk itself)."""
    s, rows_per_rank = p.max_total_sequence_length, max(1, p.train_global_batch_size // dp)
    if p.sequence_packing.enabled:
        sp = p.sequence_packing
        return Workload(seq_len=sp.train_mb_tokens, train_micro_batch=1, forward_batch=1,
                        micro_batches=-(-rows_per_rank * s // sp.train_mb_tokens), training=True,
                        reference=reference, offload=offload, forward_seq_len=sp.logprob_mb_tokens, packed=True,
                        dense_mask=cp == 1 and (sp.attention == "mask" or _unfused_megatron(p)), cp=cp)
    db = p.dynamic_batching
    train_rows = max(1, db.train_mb_tokens // s) if db.enabled else p.train_micro_batch_size
    forward_rows = max(1, db.logprob_mb_tokens // s) if db.enabled else p.logprob_batch_size
    return Workload(seq_len=s, train_micro_batch=train_rows, forward_batch=forward_rows,
                    micro_batches=max(1, rows_per_rank // train_rows), training=True, reference=reference,
                    offload=offload, cp=cp)


def _unfused_megatron(p) -> bool:
    return p.backend == "megatron" and p.megatron_cfg.attention_backend == "unfused"


def _shards(dp: int, cp: int) -> tuple[int, str]:
    """The ranks weights and optimizer state shard over (data- and context-parallel alike), and their name."""
    return dp * cp, f"dp {dp} x cp {cp}" if cp > 1 else f"dp {dp}"


@dataclass(frozen=True)
class Shards:
    """`params` parameters whose fp32 state (masters, optimizer state, a bf16 reduction's fp32 gradient shard)
    one rank keeps 1/`ranks` of; `label` names those ranks in the rows ('' to name none)."""
    params: int
    ranks: int = 1
    label: str = ""


def _sharded(groups: list[Shards], per_param: float) -> tuple[float, str]:
    """Bytes of `per_param` bytes of state per parameter of each group, / its ranks; and the rows' label
    (' / dp 4, experts / expert dp 2'; '' when no group names its ranks)."""
    labels = [g.label for g in groups if g.label]
    return sum(g.params * per_param / g.ranks for g in groups), " / " + ", ".join(labels) if labels else ""


def _weight_shards(dense: int, expert: int, tp: int, dp: int, cp: int, ep: int) -> list[Shards]:
    """What Megatron's data-parallel gradient reduction and DistributedOptimizer shard over: the non-expert
    parameters over dp (x cp), the experts over their expert-data-parallel group, tp x cp x dp / ep ranks (the
    ranks of a pipeline stage holding the same experts: expert tensor parallel size 1)."""
    ranks, label = _shards(dp, cp)
    out = [Shards(dense, ranks, label if ranks > 1 else "")]
    if expert:
        out.append(Shards(expert, tp * cp * dp // ep, f"experts / expert dp {tp * cp * dp // ep}"))
    return out


def _optimizer_row(p, groups: list[Shards]) -> tuple[str, float]:
    k = OPTIMIZER_STATES[p.optimizer.name]
    total, where = _sharded(groups, 4.0 * k)
    return f"optimizer state ({p.optimizer.name}: {k} x fp32{where})", total


def _gradient_row(p, groups: list[Shards]) -> dict[str, float]:
    """fp32 gradients of the main parameters; Megatron's DistributedOptimizer reducing in bf16
    (grad_reduce_in_fp32 false) keeps DDP's bf16 buffer plus an fp32 copy of this rank's shard."""
    m, n = p.megatron_cfg, sum(g.params for g in groups)
    if p.precision == "bfloat16" and m.use_distributed_optimizer and \
            not m.distributed_data_parallel_config.grad_reduce_in_fp32:
        shard, where = _sharded(groups, 4.0)
        return {f"gradients (bfloat16; fp32 shard{where})": n * 2.0 + shard}
    return {"gradients (fp32)": n * 4.0}


def _activation_rows(spec, impl: str, b: int, w: Workload, tp: int, sp: bool, layers: int, in_flight: int,
                     recompute: bool) -> dict[str, float]:
    """What the backward keeps: the layers' activations of this rank's 1/cp of the micro-batches in flight
    (with recomputation the layers' inputs and one layer's), their dense packing masks; with
    context parallelism the all-gathered K/V of every layer kept (of one with recomputation)."""
    tokens = w.train_micro_batch * w.seq_len / w.cp
    one_layer = act.layer_bytes_per_token(spec, impl, b, w.seq_len, tp, sp, w.train_micro_batch) * tokens
    if recompute:
        kept = act.layer_input_bytes_per_token(spec, b, tp, sp) * tokens * layers * in_flight + one_layer
    else:
        kept = one_layer * layers * in_flight
    if w.dense_mask:  # each micro-batch in flight keeps its block-diagonal mask (bool and additive bias)
        kept += w.seq_len * w.seq_len * (1 + b) * in_flight
    what = "1 packed row of" if w.packed else f"{w.train_micro_batch} x"
    share = f" / cp {w.cp}" if w.cp > 1 else ""
    rows = {f"activations ({what} {w.seq_len} tok{share}{', recompute' if recompute else ''})": kept}
    if w.cp > 1:
        kv = act.gathered_kv_bytes(spec, b, w.seq_len, tp, w.train_micro_batch)
        rows[f"gathered K/V (cp {w.cp}, {'1 layer' if recompute else 'every layer'})"] = \
            kv * (1 if recompute else layers * in_flight)
    return rows


def _forward_rows(spec, impl: str, b: int, w: Workload, tp: int, sp: bool, vocab_on_rank: int) -> dict:
    """One forward without gradients: a layer's intermediates and the logits of a forward batch (a packed row:
    also its dense block-diagonal mask, bool and as an additive bias, if it has one)."""
    s = w.forward_seq_len or w.seq_len
    tokens = w.forward_batch * s / w.cp
    what = "1 packed row of" if w.packed else f"{w.forward_batch} x"
    share = f" / cp {w.cp}" if w.cp > 1 else ""
    rows = {f"forward working set ({what} {s} tok{share})":
            act.layer_bytes_per_token(spec, impl, b, s, tp, sp, w.forward_batch) * tokens}
    if w.cp > 1:
        rows[f"forward gathered K/V (cp {w.cp}, 1 layer)"] = act.gathered_kv_bytes(spec, b, s, tp, w.forward_batch)
    if vocab_on_rank:
        rows["forward logits"] = tokens * vocab_on_rank * (b + 4)
    if w.dense_mask:
        rows["packing mask"] = float(s * s * (1 + b))
    return rows


def _megatron_weights(p, spec, tp: int, pp: int, stage: int, dp: int, cp: int) -> tuple[dict, dict, float]:
    """One rank of `stage`: the weights it keeps (parameters; in bf16 fp32 masters), the rows training adds
    (gradients, optimizer state) and the bytes of its parameters. The experts count / ep, their sharded state /
    their expert-data-parallel ranks (_weight_shards). LoRA: the frozen base in the precision alone, whole on
    every DP rank; the adapters (`LoRA ` rows) as full-parameter training keeps parameters."""
    m, b = p.megatron_cfg, DTYPE_BYTES[p.precision]
    dense, expert = megatron_stage_split(spec, tp, pp, stage, m.expert_model_parallel_size)
    state, tag, weights = {}, "", (dense + expert) * b
    if p.lora.enabled:
        state[f"frozen base weights ({p.precision})"] = weights
        dense, expert, tag = _lora_layer(p, spec, tp) * (spec.num_layers // pp), 0, "LoRA "
    state[f"LoRA adapters ({p.precision})" if tag else f"parameters ({p.precision})"] = (dense + expert) * b
    grads = _weight_shards(dense, expert, tp, dp, cp, m.expert_model_parallel_size)
    # DistributedOptimizer: masters and optimizer state sharded as the gradients are reduced; else whole
    kept = grads if m.use_distributed_optimizer else [Shards(g.params) for g in grads]
    if b == 2:
        masters, where = _sharded(kept, 4.0)
        state[f"{tag}fp32 master weights{where}"] = masters
    train = {tag + k: v for k, v in [*_gradient_row(p, grads).items(), _optimizer_row(p, kept)]}
    return state, train, weights


def _lora_layer(p, spec, tp: int) -> int:
    """LoRA adapter parameters of one decoder layer on one tensor-parallel rank."""
    return lora_layer_params(spec, target_modules(p.lora), p.lora.rank, tp)


def megatron_devices(p, spec, w: Workload, world: int) -> tuple[list[Device], dict[str, float]]:
    """A Device per pipeline stage, and the host memory of one rank (of the stage with the most parameters)."""
    m = p.megatron_cfg
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, w.cp
    dp, b = world // (tp * pp * cp), DTYPE_BYTES[p.precision]
    impl = "megatron_te" if m.layer_spec == "transformer_engine" else \
        "megatron_sdpa" if m.attention_backend == "sdpa" else "megatron"
    sp = bool(m.sequence_parallel and tp > 1)
    devices, host = [], {}
    for stage in range(pp):
        state, trained, weights = _megatron_weights(p, spec, tp, pp, stage, dp, cp)
        last = stage == pp - 1
        vocab = spec.padded_vocab // tp if last and not spec.scalar_head else 0
        phases = {}
        if w.training:
            train = dict(state, **trained)
            train.update(_activation_rows(spec, impl, b, w, tp, sp, spec.num_layers // pp,
                                          min(pp - stage, w.micro_batches), m.activation_checkpointing))
            train.update(_dispatch_row(spec, b, w.train_micro_batch * w.seq_len / cp / (tp if sp else 1)))
            if vocab:
                train["logits"] = w.train_micro_batch * w.seq_len / cp * act.logits_bytes_per_token(vocab, b)
            phases["training"] = train
        forward = (w.forward_seq_len or w.seq_len) * w.forward_batch / cp / (tp if sp else 1)
        phases["log-prob forward" if w.training else "scoring"] = dict(
            state, **_forward_rows(spec, impl, b, w, tp, sp, vocab), **_dispatch_row(spec, b, forward))
        devices.append(Device(f"stage {stage}" if pp > 1 else "every rank", phases))
        host = max(host, _host_rows(w, weights=weights, state=sum(state.values()) + _optimizer_bytes(trained)),
                   key=lambda h: sum(h.values()))
    return devices, host


def _dispatch_row(spec, b: int, tokens: float) -> dict[str, float]:
    """A Mixture-of-Experts model's alltoall dispatch buffers of the layer running, for `tokens` on this rank
    (activations.moe_dispatch_bytes); {} for a dense model."""
    if not spec.experts:
        return {}
    return {f"MoE token dispatch (3 x tok x top-{spec.experts_per_token} x h)": act.moe_dispatch_bytes(spec, b, tokens)}


def _dtensor_weights(p, spec, tp: int, dp: int) -> tuple[dict, dict, float]:
    """One rank's FSDP shards: the weights it keeps, the rows training adds, and the bytes of its parameters.
    LoRA: the frozen base in fp32 (FSDP2's parameters; still sharded over dp), the adapters in fp32 with
    gradients and optimizer state."""
    n = dtensor_rank_params(spec, tp, dp)
    if not p.lora.enabled:
        return ({"parameters (fp32, FSDP shards)": n * 4.0},
                dict([("gradients (fp32, FSDP shards)", n * 4.0), _optimizer_row(p, [Shards(n)])]), n * 4.0)
    a = -(-_lora_layer(p, spec, tp) * spec.num_layers // dp)
    k, v = _optimizer_row(p, [Shards(a)])
    return ({"frozen base weights (fp32, FSDP shards)": n * 4.0, "LoRA adapters (fp32, FSDP shards)": a * 4.0},
            {"LoRA gradients (fp32, FSDP shards)": a * 4.0, "LoRA " + k: v}, n * 4.0)


def dtensor_devices(p, spec, w: Workload, world: int) -> tuple[list[Device], dict[str, float]]:
    """One Device (every rank holds the same share), and the host memory of one rank. FSDP2 shards over the
    dp x cp ranks."""
    tp = p.dtensor_cfg.tensor_parallel_size
    dp, b = world // tp, DTYPE_BYTES[p.precision]
    vocab = 0 if spec.scalar_head else spec.vocab  # full-vocabulary logits on every rank
    weights, trained, nbytes = _dtensor_weights(p, spec, tp, dp)
    adapters = _lora_layer(p, spec, tp) if p.lora.enabled else 0
    state = dict(weights, **{f"gathered units ({p.precision}, x2)": largest_fsdp_unit(spec, tp, adapters) * b * 2.0})
    phases = {"loading (sharded)": dict(weights, **{"one checkpoint tensor read (fp32, at most whole)":
                                                   largest_tensor(spec) * 4.0})}
    if w.training:
        train = dict(state, **trained)
        train.update(_activation_rows(spec, "hf", b, w, tp, False, spec.num_layers, 1,
                                      p.dtensor_cfg.activation_checkpointing))
        if vocab:
            train["logits"] = w.train_micro_batch * w.seq_len / w.cp * act.logits_bytes_per_token(vocab, b)
        phases["training"] = train
    phases["log-prob forward" if w.training else "scoring"] = dict(
        state, **_forward_rows(spec, "hf", b, w, tp, False, vocab))
    return [Device("every rank", phases)], _host_rows(w, weights=nbytes,
                                                      state=sum(weights.values()) + _optimizer_bytes(trained))


def _optimizer_bytes(trained: dict[str, float]) -> float:
    return sum(v for k, v in trained.items() if "optimizer state" in k)


def _host_rows(w: Workload, weights: float, state: float) -> dict[str, float]:
    """Host memory of one rank: the reference copy of its `weights`; while a colocated vLLM generates, its
    offloaded `state` (parameters, masters, optimizer state)."""
    rows = {}
    if w.reference:
        rows["reference copy"] = weights
    if w.offload:
        rows["offloaded while vLLM generates"] = state
    return rows


DEVICE_PLANNERS = {"megatron": megatron_devices, "dtensor": dtensor_devices}


def _with_reserve(devices: list[Device]) -> list[Device]:
    for d in devices:
        for phase in d.phases.values():
            phase[RESERVE] = RUNTIME_RESERVE_GIB * GIB
    return devices


# ---------------------------------------------------------------------------------------------- the plan
def plan_memory(cfg, plan=None) -> MemoryPlan:
    """The per-GPU memory of cfg's roles on cfg.cluster (plan: its resource plan, made here when None)."""
    plan = plan or plan_resources(cfg)
    gpu = cfg.cluster.gpu_memory_gib * GIB
    spec = _spec(cfg.policy, "policy", False)
    roles = [_policy_role(cfg, plan, spec, gpu)]
    g = cfg.policy.generation
    if g.backend == "vllm" and not g.colocated.enabled and "generation" not in plan.placements:
        roles[0].notes.append(f"{plan.describe_replicas()}: vLLM on a CPU-only cluster, nothing to plan")
    elif g.backend == "vllm" and not g.colocated.enabled:
        place = plan.placements["generation"]
        rows, problems, notes = _vllm_rows(cfg, plan, spec, gpu)
        layout = (f"vLLM {counted(len(plan.generation_replicas()), 'replica')} x TP {plan.generation_tp} = "
                  f"{place.world_size} GPUs on nodes {node_list(place.nodes)}")
        roles.append(RolePlan("generation", layout, _with_reserve([Device("every rank", {"generation": rows})]),
                              place.gpus_per_node, notes=notes, problems=problems))
    r = cfg.env.reward_model
    if r is not None and r.active:
        roles.append(_reward_model_role(r, plan))
    return MemoryPlan(gpu, roles)


def _spec(p, key: str, scalar_head: bool):
    """The ModelSpec of policy-like config p (model, back end, layout); ConfigError naming `key` otherwise.
    Its total size, heads and layers do not depend on the layout (the vLLM rows use it too)."""
    megatron = p.backend == "megatron"
    tp, pp = ((p.megatron_cfg.tensor_model_parallel_size, p.megatron_cfg.pipeline_model_parallel_size)
              if megatron else (1, 1))
    try:
        spec = decoder_spec(hf_config(p.model_name, f"{key}.model_name"), scalar_head, tp, pp, megatron,
                            layout_key=f"{key}.megatron_cfg")
        if megatron:
            check_expert_split(spec.experts, p.megatron_cfg.expert_model_parallel_size, f"{key}.megatron_cfg",
                               p.model_name)
        return spec
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{key} ({p.model_name}): {e}") from None


def _layout(p, world: int, nodes: tuple, key: str) -> str:
    layout = policy_layout(p, world, prefix=key)
    if p.backend == "megatron":
        m = p.megatron_cfg
        cp = f" x CP {layout.cp}" if layout.cp > 1 else ""
        ep = f" (EP {m.expert_model_parallel_size})" if m.expert_model_parallel_size > 1 else ""
        shape = f"megatron TP {layout.tp} x PP {layout.pp}{cp} x DP {layout.dp}{ep}"
        extras = [n for n, on in (("sequence parallel", m.sequence_parallel and layout.tp > 1),
                                  ("distributed optimizer", m.use_distributed_optimizer),
                                  ("recompute", m.activation_checkpointing)) if on]
    else:
        cp = f" (DP {layout.dp} x CP {layout.cp})" if layout.cp > 1 else ""
        shape = f"dtensor FSDP {layout.dp * layout.cp}{cp} x TP {layout.tp}"
        extras = ["recompute"] if p.dtensor_cfg.activation_checkpointing else []
    if p.lora.enabled:
        extras.append(f"LoRA rank {p.lora.rank}")
    return f"{shape} = {world} GPUs on nodes {node_list(nodes)}, {p.precision}" + "".join(f", {e}" for e in extras)


def _policy_role(cfg, plan, spec, gpu: float) -> RolePlan:
    p, place = cfg.policy, plan.placements["policy"]
    layout = policy_layout(p, place.world_size)
    vllm_colocated = p.generation.backend == "vllm" and p.generation.colocated.enabled
    kl = cfg.loss_fn.reference_policy_kl_penalty > 0
    w = policy_workload(p, layout.dp, reference=kl and not p.lora.enabled, offload=vllm_colocated, cp=layout.cp)
    devices, host = DEVICE_PLANNERS[p.backend](p, spec, w, place.world_size)
    role = RolePlan("policy", _layout(p, place.world_size, place.nodes, "policy"), _with_reserve(devices),
                    place.gpus_per_node, host_per_gpu=host)
    pp = p.megatron_cfg.pipeline_model_parallel_size if p.backend == "megatron" else 1
    if pp > 1:
        role.notes.append(f"1F1B: stage k keeps the activations of min({pp} - k, {w.micro_batches} micro-batches)")
    if spec.experts:
        role.notes += _moe_notes(p, spec, layout)
    if vllm_colocated:
        rows, role.problems, notes = _vllm_rows(cfg, plan, spec, gpu)
        for d in role.devices:
            d.phases["generation (colocated vLLM)"] = dict(rows, **{RESERVE: RUNTIME_RESERVE_GIB * GIB})
        role.host_per_gpu["vLLM asleep (weights)"] = rows[VLLM_WEIGHTS]
        role.notes += notes
    elif p.generation.backend == "torch":
        role.notes.append("generation: the torch engine (a fallback) is not planned")
    if w.reference:
        role.notes.append("reference model: a host copy of each rank's shards, swapped in for its forward")
    elif kl:
        role.notes.append("reference model: the frozen base with the LoRA adapters disabled (no copy)")
    if p.lora.enabled:
        role.notes.append(f"LoRA rank {p.lora.rank} on {', '.join(target_modules(p.lora))}: only the adapters "
                          f"train")
    return role


def _moe_notes(p, spec, layout) -> list[str]:
    """Where a Mixture-of-Experts policy's experts live; on Megatron, what its training does not build yet."""
    if p.backend != "megatron":
        return [f"experts: all {spec.experts} per layer on every rank (HF's modules, replicated over TP), sharded "
                f"by FSDP2 like the rest"]
    m = p.megatron_cfg
    ep, edp = m.expert_model_parallel_size, layout.tp * layout.cp * layout.dp // m.expert_model_parallel_size
    notes = [f"experts: {spec.experts} per layer / EP {ep} = {spec.experts // ep} per rank, whole over TP (expert "
             f"TP 1); expert data parallel {edp} (tp x cp x dp / ep), the group their gradients are reduced "
             f"over{' and their masters and optimizer state sharded over' if m.use_distributed_optimizer else ''}"]
    return notes + [f"training refuses this layout today: {u}" for u in megatron_moe_unbuilt(
        spec.experts, "policy.megatron_cfg", p.model_name, layout.tp, m.sequence_parallel)]


def _vllm_rows(cfg, plan, spec, gpu: float) -> tuple[dict[str, float], list[str], list[str]]:
    """vLLM on one of its devices: weights (bf16, / tp) and the KV cache gpu_memory_utilization leaves; the
    problems (no room for one sequence) and notes: the replicas, a replica's weights and the caches' capacity."""
    g, seq = cfg.policy.generation, cfg.policy.max_total_sequence_length
    tp, util = plan.generation_tp, g.vllm_cfg.gpu_memory_utilization
    weights = total_params(spec) * 2.0 / tp
    kv_per_token = 2 * spec.num_layers * max(1, spec.kv_heads // tp) * spec.head_dim * 2  # K and V, bf16
    kv = util * gpu - weights
    rows = {VLLM_WEIGHTS: weights, "vLLM KV cache": max(kv, 0.0)}
    problems = []
    if kv < kv_per_token * seq:
        problems.append(f"policy.generation.vllm_cfg.gpu_memory_utilization {util} x {gpu / GIB:g} GiB leaves "
                        f"{kv / GIB:.1f} GiB for the KV cache after {weights / GIB:.1f} GiB of weights, less than "
                        f"one sequence of {seq} tokens ({kv_per_token * seq / GIB:.2f} GiB): raise it or "
                        f"vllm_cfg.tensor_parallel_size")
    tokens = max(kv, 0.0) / kv_per_token  # of one replica: its TP devices hold a share of each token's K and V
    return rows, problems, _replica_notes(cfg, plan, weights, tokens)


def _replica_notes(cfg, plan, device_weights: float, tokens: float) -> list[str]:
    """What one engine replica holds (a full copy of the weights over its TP devices, a KV cache of `tokens`)
    and what all of them hold, in tokens and sequences of policy.max_total_sequence_length."""
    tp, n, seq = plan.generation_tp, len(plan.generation_replicas()), cfg.policy.max_total_sequence_length
    rollouts = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    return [f"vLLM replica: weights {device_weights * tp / GIB:.1f} GiB (bf16, / TP {tp} = "
            f"{device_weights / GIB:.1f} per device), KV cache {tokens:,.0f} tokens = {tokens / seq:,.1f} sequences "
            f"of {seq} tokens",
            f"vLLM, {counted(n, 'replica')}: KV cache {tokens * n:,.0f} tokens = {tokens * n / seq:,.1f} sequences "
            f"at once, for {rollouts} rollouts per step ({rollouts / n:,.0f} per replica)"]


def _reward_model_role(r, plan) -> RolePlan:
    p, place = r.policy_config(), plan.placements["reward_model"]
    spec = _spec(p, "env.reward_model", True)
    w = Workload(seq_len=r.max_model_len, train_micro_batch=0, micro_batches=0, forward_batch=r.batch_size,
                 training=False, reference=False, cp=policy_layout(p, place.world_size, "env.reward_model").cp)
    devices, _ = DEVICE_PLANNERS[p.backend](p, spec, w, place.world_size)
    return RolePlan("reward model", _layout(p, place.world_size, place.nodes, "env.reward_model"),
                    _with_reserve(devices), place.gpus_per_node)
