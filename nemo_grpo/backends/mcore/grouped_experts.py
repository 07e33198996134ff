"""Grouped-GEMM expert compute for Megatron-Core's local-spec MoE, without Transformer Engine or the `grouped_gemm`
package: Megatron's SequentialMLP runs one matmul pair per local expert in a Python loop; `GroupedSequentialMLP`
runs all local experts in two `torch.nn.functional.grouped_mm` calls (on an H100 in bf16, Qwen3-30B-A3B's layer
with 64 experts: 3.2x the loop's training tokens/s, level with HF's module; docs/guides/gpu.md).

Its parameters are SequentialMLP's, unchanged: `local_experts.{i}.linear_fc1.weight` [2*ffn, h] ([gate; up] on
dim 0) and `local_experts.{i}.linear_fc2.weight` [h, ffn], so the weight mapping (weights.py), checkpoints, the
distributed optimizer and refit see the same modules. Each forward stacks them into [G, 2*ffn, h] and [G, h, ffn]
(torch.stack: autograd sends each expert's slice of the gradient back to its own parameter).

Expert tensor parallelism is 1 (model._moe_config): every local expert is whole on its rank. Under expert
parallelism G = experts / ep, the experts this rank holds; tokens_per_expert counts this rank's permuted tokens
per local expert (0 allowed: an empty group). On CUDA, torch's fast grouped kernel takes bf16 (Hopper, Blackwell);
other dtypes run torch's own per-group fallback, correct but no faster than the loop. On CPU fp32 and bf16 run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

HAS_GROUPED_MM = hasattr(F, "grouped_mm")


class GroupedSequentialMLP(SequentialMLP):
    """SequentialMLP whose forward is two grouped matmuls over its local experts (same parameters, same routing
    probs, same gated SiLU). Falls back to SequentialMLP's loop where grouped_mm cannot run: its kernels (CPU
    and CUDA) need 16-byte-aligned row strides and data, which e.g. bf16 with h or ffn not a multiple of 8
    (fp32: of 4) does not give."""

    def __init__(self, num_local_experts: int, config, submodules, pg_collection=None):
        check_supported(config)
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """permuted_local_hidden_states [n, h] ordered by local expert, tokens_per_expert [G] (sums to n),
        permuted_probs [n] -> ([n, h], None), as SequentialMLP.forward."""
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if not grouped_mm_fits(hidden, self.config.moe_ffn_hidden_size):
            return super().forward(hidden, tokens_per_expert, probs)
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP: scale the input, then probs of 1
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        return grouped_experts_mlp(hidden, tokens_per_expert, probs, self.local_experts, self.config), None


def grouped_mm_fits(hidden: torch.Tensor, ffn: int) -> bool:
    """Whether grouped_mm's stride and alignment rules hold for input rows [n, h] and the [n, ffn] activations."""
    size = hidden.element_size()
    return (HAS_GROUPED_MM and hidden.is_contiguous() and hidden.data_ptr() % 16 == 0
            and hidden.shape[-1] * size % 16 == 0 and ffn * size % 16 == 0)


def grouped_experts_mlp(hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                        experts, config) -> torch.Tensor:
    """hidden [n, h] (rows grouped by expert, tokens_per_expert [G] of them each), probs [n] -> [n, h]: per group
    g, fc2_g( act(fc1_g x) * prob ), act the gated linear unit silu(gate) * up of Megatron's MLP (no bias)."""
    ends = torch.cumsum(tokens_per_expert.to(hidden.device), 0).to(torch.int32)  # [G] each group's end row
    fc1 = torch.stack([e.linear_fc1.weight for e in experts])  # [G, 2*ffn, h]
    fc2 = torch.stack([e.linear_fc2.weight for e in experts])  # [G, h, ffn]
    gate_up = _contiguous_grad(F.grouped_mm(hidden, fc1.transpose(1, 2), offs=ends))  # [n, 2*ffn]
    gate, up = torch.chunk(gate_up, 2, dim=-1)  # [n, ffn] each
    act = config.activation_func(gate) * (up + config.glu_linear_offset)
    act = (act * probs.unsqueeze(-1)).to(act.dtype)  # MLP's per_token_scale: the routing prob of each row
    return _contiguous_grad(F.grouped_mm(act, fc2.transpose(1, 2), offs=ends))  # [n, h]


def _contiguous_grad(out: torch.Tensor) -> torch.Tensor:
    """out, its incoming gradient made contiguous: grouped_mm's backward refuses a broadcast one (stride 0)."""
    if out.requires_grad:
        out.register_hook(lambda grad: grad.contiguous())
    return out


def check_supported(config) -> None:
    """Raise unless config is the expert MLP grouped_experts_mlp computes: gated, no bias, unfused, expert TP 1,
    no fp8/fp4 padding, no activation clamp."""
    unsupported = {"gated_linear_unit": not config.gated_linear_unit, "add_bias_linear": config.add_bias_linear,
                   "bias_activation_fusion": config.bias_activation_fusion,
                   "use_te_activation_func": config.use_te_activation_func, "fp8": bool(config.fp8),
                   "fp4": bool(config.fp4), "activation_func_clamp_value": config.activation_func_clamp_value
                   is not None, "expert_tensor_parallel_size": config.expert_tensor_parallel_size != 1}
    bad = [name for name, yes in unsupported.items() if yes]
    if bad:
        raise ValueError(f"GroupedSequentialMLP does not compute this expert MLP (config: {', '.join(bad)})")
