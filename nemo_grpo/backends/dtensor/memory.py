"""The DTensor back end's memory model for the planner (planning/memory.py asks it through its BackendSpec).

What it keeps, read off its worker:
FSDP2: fp32 parameters, gradients and optimizer state sharded over dp (linear weights split over
tp first); the largest unit all-gathered in the compute dtype, x2 (the next one is prefetched); loading
builds the model sharded (on the meta device) and reads each rank's slices from the checkpoint:
the rank's fp32 shards plus at most one whole tensor in fp32 being read.
"""

from __future__ import annotations

import math

from nemo_grpo.backends import activations as act
from nemo_grpo.backends.memory_model import (DTYPE_BYTES, Device, Shards, Workload, activation_rows, forward_rows,
                                             host_rows, lora_layer, optimizer_bytes, optimizer_row)
from nemo_grpo.models.counts import on_tp_rank, stored_tensors, total_params
from nemo_grpo.models.spec import ModelSpec, hf_tensors


def dtensor_rank_params(spec: ModelSpec, tp: int, dp: int) -> int:
    """Parameters one rank holds between steps under DTensor: the decoder layers' linear weights split over tp
    (embedding, lm_head and norms replicated over tp), then everything sharded over dp by FSDP2."""
    return -(-sum(on_tp_rank(t, spec, tp, vocab_parallel=False) for t in stored_tensors(spec)) // dp)


def largest_tensor(spec: ModelSpec) -> int:
    """Elements of the largest HF tensor (the embedding, or a layer's fused experts [E, 2F, H]): what the DTensor
    back end's sharded load reads at most at once (dtensor/loading.py; it reads only a rank's slice of each)."""
    return max(math.prod(t.shape) for t in stored_tensors(spec))


def largest_fsdp_unit(spec: ModelSpec, tp: int, lora_per_layer: int = 0) -> int:
    """Parameters of the largest FSDP2 unit one rank all-gathers for a forward: a decoder layer (/tp, with its
    `lora_per_layer` adapter parameters) or the root module (embedding, final norm, lm_head or score:
    replicated over tp)."""
    layer = [t for t in hf_tensors(spec) if t.layer == 0]
    local_layer = sum(on_tp_rank(t, spec, tp, vocab_parallel=False) for t in layer) + lora_per_layer
    root = total_params(spec) - spec.num_layers * sum(math.prod(t.shape) for t in layer)
    return max(local_layer, root)


def _rank_weights(p, spec, tp: int, dp: int) -> tuple[dict, dict, float]:
    """One rank's FSDP shards: the weights it keeps, the rows training adds, and the bytes of its parameters.
    LoRA: the frozen base in fp32 (FSDP2's parameters; still sharded over dp), the adapters in fp32 with
    gradients and optimizer state."""
    n = dtensor_rank_params(spec, tp, dp)
    if not p.lora.enabled:
        return ({"parameters (fp32, FSDP shards)": n * 4.0},
                dict([("gradients (fp32, FSDP shards)", n * 4.0), optimizer_row(p, [Shards(n)])]), n * 4.0)
    a = -(-lora_layer(p, spec, tp) * spec.num_layers // dp)
    k, v = optimizer_row(p, [Shards(a)])
    return ({"frozen base weights (fp32, FSDP shards)": n * 4.0, "LoRA adapters (fp32, FSDP shards)": a * 4.0},
            {"LoRA gradients (fp32, FSDP shards)": a * 4.0, "LoRA " + k: v}, n * 4.0)


def plan_devices(p, spec, w: Workload, world: int) -> tuple[list[Device], dict[str, float]]:
    """One Device (every rank holds the same share), and the host memory of one rank. FSDP2 shards over the
    dp x cp ranks."""
    tp = p.dtensor_cfg.tensor_parallel_size
    dp, b = world // tp, DTYPE_BYTES[p.precision]
    vocab = 0 if spec.scalar_head else spec.vocab  # full-vocabulary logits on every rank
    weights, trained, nbytes = _rank_weights(p, spec, tp, dp)
    adapters = lora_layer(p, spec, tp) if p.lora.enabled else 0
    state = dict(weights, **{f"gathered units ({p.precision}, x2)": largest_fsdp_unit(spec, tp, adapters) * b * 2.0})
    phases = {"loading (sharded)": dict(weights, **{"one checkpoint tensor read (fp32, at most whole)":
                                                   largest_tensor(spec) * 4.0})}
    if w.training:
        train = dict(state, **trained)
        train.update(activation_rows(spec, "hf", b, w, tp, False, spec.num_layers, 1,
                                     p.dtensor_cfg.activation_checkpointing))
        if vocab:
            train["logits"] = w.train_micro_batch * w.seq_len / w.cp * act.logits_bytes_per_token(vocab, b)
        phases["training"] = train
    phases["log-prob forward" if w.training else "scoring"] = dict(
        state, **forward_rows(spec, "hf", b, w, tp, False, vocab))
    return [Device("every rank", phases)], host_rows(w, weights=nbytes,
                                                     state=sum(weights.values()) + optimizer_bytes(trained))
