"""What the back ends' memory models (backends/*/memory.py) share: a Device's bytes by component and phase, the
Workload of one data-parallel rank, and the rows both back ends keep alike (optimizer state, activations, the
forward's working set, MoE dispatch buffers, host memory). Arithmetic only: no torch, no GPU.

Activations follow backends/activations.py's per-token formulas; `impl` names the layer implementation there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nemo_grpo.backends import activations as act
from nemo_grpo.models.counts import lora_layer_params
from nemo_grpo.models.lora import target_modules

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0}  # fp32 tensors per parameter


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


def shards(dp: int, cp: int) -> tuple[int, str]:
    """The ranks weights and optimizer state shard over (data- and context-parallel alike), and their name."""
    return dp * cp, f"dp {dp} x cp {cp}" if cp > 1 else f"dp {dp}"


@dataclass(frozen=True)
class Shards:
    """`params` parameters whose fp32 state (masters, optimizer state, a bf16 reduction's fp32 gradient shard)
    one rank keeps 1/`ranks` of; `label` names those ranks in the rows ('' to name none)."""
    params: int
    ranks: int = 1
    label: str = ""


def sharded(groups: list[Shards], per_param: float) -> tuple[float, str]:
    """Bytes of `per_param` bytes of state per parameter of each group, / its ranks; and the rows' label
    (' / dp 4, experts / expert dp 2'; '' when no group names its ranks)."""
    labels = [g.label for g in groups if g.label]
    return sum(g.params * per_param / g.ranks for g in groups), " / " + ", ".join(labels) if labels else ""


def optimizer_row(p, groups: list[Shards]) -> tuple[str, float]:
    k = OPTIMIZER_STATES[p.optimizer.name]
    total, where = sharded(groups, 4.0 * k)
    return f"optimizer state ({p.optimizer.name}: {k} x fp32{where})", total


def activation_rows(spec, impl: str, b: int, w: Workload, tp: int, sp: bool, layers: int, in_flight: int,
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


def forward_rows(spec, impl: str, b: int, w: Workload, tp: int, sp: bool, vocab_on_rank: int) -> dict:
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


def lora_layer(p, spec, tp: int) -> int:
    """LoRA adapter parameters of one decoder layer on one tensor-parallel rank."""
    return lora_layer_params(spec, target_modules(p.lora), p.lora.rank, tp)


def dispatch_row(spec, b: int, tokens: float) -> dict[str, float]:
    """A Mixture-of-Experts model's alltoall dispatch buffers of the layer running, for `tokens` on this rank
    (activations.moe_dispatch_bytes); {} for a dense model."""
    if not spec.experts:
        return {}
    return {f"MoE token dispatch (3 x tok x top-{spec.experts_per_token} x h)": act.moe_dispatch_bytes(spec, b, tokens)}


def optimizer_bytes(trained: dict[str, float]) -> float:
    return sum(v for k, v in trained.items() if "optimizer state" in k)


def host_rows(w: Workload, weights: float, state: float) -> dict[str, float]:
    """Host memory of one rank: the reference copy of its `weights`; while a colocated vLLM generates, its
    offloaded `state` (parameters, masters, optimizer state)."""
    rows = {}
    if w.reference:
        rows["reference copy"] = weights
    if w.offload:
        rows["offloaded while vLLM generates"] = state
    return rows
