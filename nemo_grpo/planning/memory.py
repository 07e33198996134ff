"""Per-GPU memory of every role of a recipe on its cluster, phase by phase; layouts that do not fit are rejected
with the numbers. Arithmetic on the config and the models' HF configs (planning/params.py): no GPU, no weights.

What a back end keeps is its own memory model (backends/<back end>/memory.py, asked through its BackendSpec);
what they share (backends/memory_model.py), and the rest:
  reference  a host-memory copy of each rank's shards swapped into the live parameters for its forward: no
             GPU memory. With LoRA the reference is the frozen base with the adapters disabled: no copy at all.
  LoRA       (policy.lora) the frozen base weights alone: no fp32 masters, no gradients, no optimizer state;
             each back end keeps them as it keeps parameters (in the precision, or fp32 where its sharding
             keeps every parameter so). The adapters (A [r, in], B [out, r] per targeted linear;
             column-parallel q/k/v/gate/up: A whole, B / tp; row-parallel o/down: A / tp, B whole; per
             pipeline stage) are kept as full-parameter training keeps
             parameters: masters, gradients, optimizer state and their division by dp as above. Activations are
             counted as without LoRA: the adapters' rank-r intermediates are negligible.
  context    (context_parallel_size cp) the cp ranks of a row act as data-parallel ranks for
  parallel   the weights: parameters, masters, gradients and optimizer state shard over dp x cp wherever they
             shard over dp; each rank keeps the activations, logits and packing mask of 1/cp of a row's tokens,
             plus the full-length K and V its attention all-gathers: of every layer (kept for the backward), of
             one layer with recomputation and in a forward.
  refit      the bytes a refit sends the engine per step, in its dtype (bf16 for auto): every weight; with LoRA
             the adapters (policy.lora.refit=adapters) or the engine layers under them, merged (=merged).
  vLLM       gpu_memory_utilization of each device for its weights (bf16, / its tp) and KV cache. The engine runs
             as data-parallel replicas of tp devices each (ResourcePlan.generation_replicas), each a full copy of
             the weights with a KV cache of its own; the rows are one device's, the notes count the replicas.
             Colocated, the policy moves to host memory while vLLM generates and vLLM sleeps (level 1) while the
             policy trains: the two phases are checked apart.
  LLM judge  (env.llm_judge.model_name: in the cluster) the same vLLM rows and replica notes on its own devices
             (env.llm_judge.resources; devices / its tp replicas per node), for a model that is never refit. A
             device must hold one sequence of the judge's context: vllm_cfg.max_model_len, else the model's
             max_position_embeddings capped as the engine caps it (vLLM's own check at start). The torch engine
             is not planned (a note), as the policy's torch generation is not.
Activations assume every sequence at policy.max_total_sequence_length, a packed row full at its token budget
(backends/activations.py). Every GPU also keeps RUNTIME_RESERVE_GIB for the CUDA context, NCCL buffers and
allocator fragmentation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from nemo_grpo.backends.memory_model import Device, Workload
from nemo_grpo.backends.registry import backend_spec, policy_layout
from nemo_grpo.distributed.resource_plan import counted, node_list, plan_resources
from nemo_grpo.envs import judging
from nemo_grpo.errors import ConfigError
from nemo_grpo.models import lora
from nemo_grpo.models.counts import total_params
from nemo_grpo.models.spec import ModelSpec, hf_tensors
from nemo_grpo.planning.params import decoder_spec, hf_config
from nemo_grpo.precision import gpu_precision
from nemo_grpo.weights.transfer import TensorSpec

GIB = float(1 << 30)
RUNTIME_RESERVE_GIB = 3.0
RESERVE = "runtime reserve"
VLLM_WEIGHTS = "vLLM weights (bf16, / its TP)"


@dataclass
class RolePlan:
    """One role's devices, e.g. the policy: its back end's layout on nodes 0-5."""
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
def policy_workload(p, dp: int, reference: bool, offload: bool, cp: int = 1) -> Workload:
    """A policy's Workload: fixed micro-batches of sequences at policy.max_total_sequence_length; with sequence
    packing one packed row of train_mb_tokens (logprob_mb_tokens in the forward), as many per step as the
    rank's sequences need at full length; with dynamic batching as many full-length rows as the budget holds.
    The rows are a data-parallel rank's, shared by its cp context-parallel ranks. A packed row's dense
    block-diagonal mask exists with policy.sequence_packing.attention=mask or where the back end's attention
    needs it (BackendSpec.dense_packing_mask), never under context parallelism (its attention masks each
    query chunk itself)."""
    s, rows_per_rank = p.max_total_sequence_length, max(1, p.train_global_batch_size // dp)
    if p.sequence_packing.enabled:
        sp = p.sequence_packing
        mask = cp == 1 and (sp.attention == "mask" or backend_spec(p.backend).dense_packing_mask(p))
        return Workload(seq_len=sp.train_mb_tokens, train_micro_batch=1, forward_batch=1,
                        micro_batches=-(-rows_per_rank * s // sp.train_mb_tokens), training=True,
                        reference=reference, offload=offload, forward_seq_len=sp.logprob_mb_tokens, packed=True,
                        dense_mask=mask, cp=cp)
    db = p.dynamic_batching
    train_rows = max(1, db.train_mb_tokens // s) if db.enabled else p.train_micro_batch_size
    forward_rows = max(1, db.logprob_mb_tokens // s) if db.enabled else p.logprob_batch_size
    return Workload(seq_len=s, train_micro_batch=train_rows, forward_batch=forward_rows,
                    micro_batches=max(1, rows_per_rank // train_rows), training=True, reference=reference,
                    offload=offload, cp=cp)


def _with_reserve(devices: list[Device]) -> list[Device]:
    for d in devices:
        for phase in d.phases.values():
            phase[RESERVE] = RUNTIME_RESERVE_GIB * GIB
    return devices


# ---------------------------------------------------------------------------------------------- the plan
def plan_memory(cfg, plan=None) -> MemoryPlan:
    """The per-GPU memory of cfg's roles on cfg.cluster (plan: its resource plan, made here when None).
    Precision "auto" counts as bf16: every GPU planned for computes it (precision.gpu_precision)."""
    plan = plan or plan_resources(cfg)
    cfg = _with_gpu_precisions(cfg)
    gpu = cfg.cluster.gpu_memory_gib * GIB
    spec = _spec(cfg.policy, "policy", False)
    roles = [_policy_role(cfg, plan, spec, gpu)]
    g = cfg.policy.generation
    if g.backend == "vllm" and not g.colocated.enabled and "generation" not in plan.placements:
        roles[0].notes.append(f"{plan.describe_replicas()}: vLLM on a CPU-only cluster, nothing to plan")
    elif g.backend == "vllm" and not g.colocated.enabled:
        roles.append(_engine_role("generation", "generation", _generation_engine(cfg, plan, spec),
                                  plan.placements["generation"], gpu))
    r = cfg.env.reward_model
    if r is not None and r.active:
        roles.append(_reward_model_role(r, plan))
    j = cfg.env.llm_judge
    if j is not None and j.in_cluster:
        roles += _judge_roles(cfg, plan, gpu, roles[0])
    return MemoryPlan(gpu, roles)


def _with_gpu_precisions(cfg):
    """cfg with "auto" precisions (the policy's, the reward model's) replaced by what a GPU runs."""
    policy = replace(cfg.policy, precision=gpu_precision(cfg.policy.precision))
    r = cfg.env.reward_model
    env = cfg.env if r is None else replace(cfg.env, reward_model=replace(r, precision=gpu_precision(r.precision)))
    return replace(cfg, policy=policy, env=env)


def _spec(p, key: str, scalar_head: bool):
    """The ModelSpec of policy-like config p (model, back end, layout); ConfigError naming `key` otherwise.
    Its total size, heads and layers do not depend on the layout (the vLLM rows use it too)."""
    try:
        return backend_spec(p.backend).model_spec(p, hf_config(p.model_name, f"{key}.model_name"), scalar_head, key)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{key} ({p.model_name}): {e}") from None


def _layout(p, world: int, nodes: tuple, key: str) -> str:
    shape, extras = backend_spec(p.backend).describe_plan(p, policy_layout(p, world, prefix=key))
    if p.lora.enabled:
        extras.append(f"LoRA rank {p.lora.rank}")
    return f"{shape} = {world} GPUs on nodes {node_list(nodes)}, {p.precision}" + "".join(f", {e}" for e in extras)


def _policy_role(cfg, plan, spec, gpu: float) -> RolePlan:
    p, place = cfg.policy, plan.placements["policy"]
    layout = policy_layout(p, place.world_size)
    vllm_colocated = p.generation.backend == "vllm" and p.generation.colocated.enabled
    kl = cfg.loss_fn.reference_policy_kl_penalty > 0
    w = policy_workload(p, layout.dp, reference=kl and not p.lora.enabled, offload=vllm_colocated, cp=layout.cp)
    devices, host = backend_spec(p.backend).plan_devices(p, spec, w, place.world_size)
    role = RolePlan("policy", _layout(p, place.world_size, place.nodes, "policy"), _with_reserve(devices),
                    place.gpus_per_node, host_per_gpu=host)
    pp = layout.pp
    if pp > 1:
        role.notes.append(f"1F1B: stage k keeps the activations of min({pp} - k, {w.micro_batches} micro-batches)")
    if spec.experts:
        role.notes += backend_spec(p.backend).moe_notes(p, spec, layout)
    if vllm_colocated:
        rows, role.problems, notes = _vllm_rows(_generation_engine(cfg, plan, spec), gpu)
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
        role.notes.append(f"LoRA rank {p.lora.rank} on {', '.join(lora.target_modules(p.lora))}: only the adapters "
                          f"train")
    role.notes.append(_refit_note(p, spec))
    return role


def refit_bytes(spec: ModelSpec, lora_cfg, itemsize: int) -> dict[str, int]:
    """Bytes a refit sends, tensors of `itemsize` bytes (the engine's dtype), as weights/sender.py plans them:
    "full", every HF tensor (a tied lm_head too: the engine takes it); with LoRA on, "merged"
    (policy.lora.refit=merged, each refit after the first: the engine layers under adapters) and "adapters"
    (policy.lora.refit=adapters, every refit: A and B of each targeted linear)."""
    tensors = hf_tensors(spec)
    out = {"full": sum(math.prod(t.shape) for t in tensors) * itemsize}
    if lora_cfg.enabled:
        trained = lora.trained_names([t.name for t in tensors], lora.target_modules(lora_cfg))
        out["merged"] = sum(math.prod(t.shape) for t in tensors if t.name in trained) * itemsize
        specs = [TensorSpec(t.name, tuple(t.shape), torch.float32) for t in tensors]
        out["adapters"] = sum(s.numel for s in lora.adapter_specs(specs, lora_cfg)) * itemsize
    return out


def _refit_note(p, spec: ModelSpec) -> str:
    """What a refit sends the engine per step, in its dtype; with LoRA, adapters against merged."""
    dtype = gpu_precision(p.generation.vllm_cfg.precision or p.precision)
    b = refit_bytes(spec, p.lora, getattr(torch, dtype).itemsize)
    if not p.lora.enabled:
        return f"refit: {b['full'] / GIB:.1f} GiB a step ({dtype}, every weight)"
    mark = {kind: ", this recipe" if p.lora.refit == kind else "" for kind in lora.REFITS}
    return (f"refit a step ({dtype}): LoRA adapters {b['adapters'] / GIB:.2f} GiB (policy.lora.refit=adapters"
            f"{mark['adapters']}) vs merged {b['merged'] / GIB:.1f} GiB (=merged{mark['merged']}: the layers under "
            f"adapters, after a first refit of {b['full'] / GIB:.1f} GiB), "
            f"{b['merged'] / b['adapters']:.0f}x the bytes")


@dataclass(frozen=True)
class VllmEngine:
    """A vLLM engine to plan (policy generation, the LLM judge): its model, devices per replica, replicas,
    gpu_memory_utilization, the tokens of one sequence its KV cache must hold, the prefix of its vllm_cfg keys (named
    in a problem), the requests it serves (`noun`: of what, per what), `remedy` besides raising utilization or TP."""
    spec: ModelSpec
    tp: int
    replicas: int
    util: float
    seq: int
    key: str
    requests: int
    noun: str = "rollouts per step"
    remedy: str = ""


def _generation_engine(cfg, plan, spec) -> VllmEngine:
    """The policy's vLLM engine: policy.max_total_sequence_length per sequence, a step's rollouts."""
    g = cfg.policy.generation
    return VllmEngine(spec, plan.generation_tp, len(plan.generation_replicas()), g.vllm_cfg.gpu_memory_utilization,
                      cfg.policy.max_total_sequence_length, "policy.generation.vllm_cfg",
                      cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt)


def _vllm_rows(e: VllmEngine, gpu: float) -> tuple[dict[str, float], list[str], list[str]]:
    """vLLM on one of its devices: weights (bf16, / tp) and the KV cache gpu_memory_utilization leaves; the
    problems (no room for one sequence) and notes: the replicas, a replica's weights and the caches' capacity."""
    weights = total_params(e.spec) * 2.0 / e.tp
    kv_per_token = 2 * e.spec.num_layers * max(1, e.spec.kv_heads // e.tp) * e.spec.head_dim * 2  # K and V, bf16
    kv = e.util * gpu - weights
    rows = {VLLM_WEIGHTS: weights, "vLLM KV cache": max(kv, 0.0)}
    problems = []
    if kv < kv_per_token * e.seq:
        problems.append(f"{e.key}.gpu_memory_utilization {e.util} x {gpu / GIB:g} GiB leaves {kv / GIB:.1f} GiB for "
                        f"the KV cache after {weights / GIB:.1f} GiB of weights, less than one sequence of {e.seq} "
                        f"tokens ({kv_per_token * e.seq / GIB:.2f} GiB): raise it or vllm_cfg.tensor_parallel_size"
                        f"{e.remedy}")
    tokens = max(kv, 0.0) / kv_per_token  # of one replica: its TP devices hold a share of each token's K and V
    return rows, problems, _replica_notes(e, weights, tokens)


def _replica_notes(e: VllmEngine, device_weights: float, tokens: float) -> list[str]:
    """What one engine replica holds (a full copy of the weights over its TP devices, a KV cache of `tokens`)
    and what all of them hold, in tokens and sequences of e.seq tokens, against the requests of a step."""
    tp, n, seq = e.tp, e.replicas, e.seq
    return [f"vLLM replica: weights {device_weights * tp / GIB:.1f} GiB (bf16, / TP {tp} = "
            f"{device_weights / GIB:.1f} per device), KV cache {tokens:,.0f} tokens = {tokens / seq:,.1f} sequences "
            f"of {seq} tokens",
            f"vLLM, {counted(n, 'replica')}: KV cache {tokens * n:,.0f} tokens = {tokens * n / seq:,.1f} sequences "
            f"at once, for {e.requests} {e.noun} ({e.requests / n:,.0f} per replica)"]


def _engine_role(role: str, phase: str, e: VllmEngine, place, gpu: float, extra: str = "") -> RolePlan:
    """A role of vLLM replicas on devices of its own (`place`): one device's rows in `phase`, the replica notes."""
    rows, problems, notes = _vllm_rows(e, gpu)
    layout = (f"vLLM {counted(e.replicas, 'replica')} x TP {e.tp} = {place.world_size} GPUs on nodes "
              f"{node_list(place.nodes)}{extra}")
    return RolePlan(role, layout, _with_reserve([Device("every rank", {phase: rows})]), place.gpus_per_node,
                    notes=notes, problems=problems)


def _reward_model_role(r, plan) -> RolePlan:
    p, place = r.policy_config(), plan.placements["reward_model"]
    spec = _spec(p, "env.reward_model", True)
    w = Workload(seq_len=r.max_model_len, train_micro_batch=0, micro_batches=0, forward_batch=r.batch_size,
                 training=False, reference=False, cp=policy_layout(p, place.world_size, "env.reward_model").cp)
    devices, _ = backend_spec(p.backend).plan_devices(p, spec, w, place.world_size)
    return RolePlan("reward model", _layout(p, place.world_size, place.nodes, "env.reward_model"),
                    _with_reserve(devices), place.gpus_per_node)


# ---------------------------------------------------------------------------------------------- the LLM judge
def _judge_roles(cfg, plan, gpu: float, policy: RolePlan) -> list[RolePlan]:
    """The in-cluster LLM judge (env.llm_judge.model_name, frozen): its vLLM replicas on its own devices; a note on
    the policy's role instead where nothing is planned (the torch engine, or no devices: a CPU-only cluster)."""
    j = cfg.env.llm_judge
    if j.generation.backend != "vllm":
        policy.notes.append("LLM judge: the torch engine (a fallback) is not planned")
        return []
    if "llm_judge" not in plan.placements:
        policy.notes.append("LLM judge: vLLM on an actor without devices (no llm_judge placement): on a CPU-only "
                            "cluster, nothing to plan")
        return []
    place = plan.placements["llm_judge"]
    return [_engine_role("LLM judge", "judging", _judge_engine(cfg, place), place, gpu, f", {j.model_name}, frozen")]


def _judge_engine(cfg, place) -> VllmEngine:
    """The judge's engine: its ModelSpec from its HF config, devices / TP replicas on each of its nodes
    (resource_plan.judge_replicas), one sequence of its context: vllm_cfg.max_model_len, else what vLLM takes
    (vllm_engine.default_max_model_len) and checks at start."""
    from nemo_grpo.generation.vllm_engine import MAX_MODEL_LEN_CAP, default_max_model_len  # here: it imports ray

    j, key = cfg.env.llm_judge, "env.llm_judge"
    hf = hf_config(j.model_name, f"{key}.model_name")
    try:
        spec = decoder_spec(hf, scalar_head=False, any_rope=True)  # vLLM builds any RoPE scaling
    except ValueError as e:
        raise ConfigError(f"{key} ({j.model_name}): {e}") from None
    v = j.generation.vllm_cfg
    if v.max_model_len is not None:
        seq, remedy = v.max_model_len, ", or lower vllm_cfg.max_model_len"
    else:
        seq = default_max_model_len(hf)
        remedy = (f", or set a shorter vllm_cfg.max_model_len (unset: the model's max_position_embeddings "
                  f"{getattr(hf, 'max_position_embeddings', None)}, capped at {MAX_MODEL_LEN_CAP})")
    requests, noun = _judge_requests(cfg)
    replicas = place.num_nodes * (place.gpus_per_node // v.tensor_parallel_size)
    return VllmEngine(spec, v.tensor_parallel_size, replicas, v.gpu_memory_utilization, seq,
                      f"{key}.generation.vllm_cfg", requests, noun, remedy)


def _judge_requests(cfg) -> tuple[int, str]:
    """The judge's first asks (parse retries aside) of a training step, or of a validation batch where only
    validation is judged: one a sample (pointwise; equivalence with check_twice_swap: at most two), or its
    group's ordered comparisons (pairwise); and what they are."""
    j, g = cfg.env.llm_judge, cfg.grpo
    if cfg.data.train.env_name == "llm_judge":
        groups, size, per = g.num_prompts_per_step, g.num_generations_per_prompt, "per step"
    else:
        groups, size, per = min(g.val_batch_size, g.max_val_samples), 1, "per validation batch"
    if j.mode == "pairwise":
        pairs = judging.ordered_comparisons(size, j.comparison_strategy, j.check_twice_swap)
        return groups * len(pairs), f"judge requests {per}"
    if j.mode == "equivalence" and j.check_twice_swap:
        return 2 * groups * size, f"judge requests {per} at most"
    return groups * size, f"judge requests {per}"
