"""Parameter counts of a decoder read off its HF tensor table (models/spec.py): in total, per token
(`active_params`), on one tensor-parallel rank (`on_tp_rank`), and of its LoRA adapters (`lora_layer_params`).
The back ends' memory models (backends/*/memory.py) and the planner count with them."""

from __future__ import annotations

import math

from nemo_grpo.models.spec import HFTensor, ModelSpec, hf_tensors


def stored_tensors(spec: ModelSpec) -> list[HFTensor]:
    """The tensors that are tensors of their own (a tied lm_head is the embedding)."""
    return [t for t in hf_tensors(spec) if not (spec.tied and t.name == "lm_head.weight")]


def on_tp_rank(t: HFTensor, spec: ModelSpec, tp: int, vocab_parallel: bool) -> int:
    """Elements of HF tensor t on one tensor-parallel rank: replicated ones whole; the vocabulary padded and
    split with vocab_parallel (a vocabulary-parallel embedding), else whole; the other linear weights / tp."""
    if t.kind == "copy" or (t.kind == "vocab" and not vocab_parallel):
        return math.prod(t.shape)
    if t.kind == "vocab":
        return spec.padded_vocab * t.shape[1] // tp
    return math.prod(t.shape) // tp


def total_params(spec: ModelSpec) -> int:
    """Parameters of the HF model (a tied lm_head counted once)."""
    return sum(math.prod(t.shape) for t in stored_tensors(spec))


def active_params(spec: ModelSpec) -> int:
    """Parameters one token computes with: all of a dense model; of an MoE, its experts_per_token experts of
    every layer, not all its experts."""
    idle = spec.num_layers * 3 * spec.hidden * spec.moe_ffn * (spec.experts - spec.experts_per_token)
    return total_params(spec) - idle


def is_expert(t: HFTensor) -> bool:
    """A routed expert's tensor (HF's fused mlp.experts.*): expert parallelism splits these over its ranks."""
    return ".mlp.experts." in t.name


def lora_layer_params(spec: ModelSpec, targets: list[str], rank: int, tp: int) -> int:
    """LoRA adapter parameters of one decoder layer on one tensor-parallel rank: A [rank, in] and B [out, rank] per
    targeted HF linear (leaf names, models/lora.py). Column-parallel layers (q, k, v, gate, up: split on out) keep
    A whole and B / tp; row-parallel ones (o_proj, down_proj: split on in) A / tp and B whole. Both back ends
    place them so (one adapter per HF projection, also on a fused q/k/v or gate/up linear)."""
    n = 0
    for t in hf_tensors(spec):
        leaf = t.name.split(".")[-2]
        if t.layer == 0 and t.name.endswith(".weight") and leaf in targets:
            out, inp = t.shape
            n += rank * inp // tp + out * rank if t.kind == "col" else rank * inp + out * rank // tp
    return n
