"""Megatron-Core model construction: a `GPTModel` (local layer spec, RMSNorm) from an HF config, loaded with the
HF weights of a local directory, for this rank's (tp, pp) position. Needs megatron parallel_state initialized.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                      get_gpt_layer_with_transformer_engine_spec)
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from nemo_grpo.backends.mcore.attention import SDPAttention
from nemo_grpo.backends.mcore.grouped_experts import HAS_GROUPED_MM, GroupedSequentialMLP
from nemo_grpo.models.spec import ModelSpec


class ScalarHead(nn.Module):
    """Replaces GPTModel.output_layer on the last stage: hidden [s(/tp under SP), b, h] -> ([s, b, 1], None).

    Replicated over TP (the decoder output is full-hidden on every TP rank); the parameter is named
    `output_layer.weight` [1, h] like HF `score.weight` (no bias)."""

    def __init__(self, hidden: int, sequence_parallel: bool, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None, **kwargs):
        if self.sequence_parallel:
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return hidden_states @ self.weight.t(), None  # [s, b, 1]


def transformer_config(spec: ModelSpec, mcfg, dtype: torch.dtype):
    """ModelSpec + policy.megatron_cfg -> megatron TransformerConfig (no dropout, no fusions, per-token loss)."""
    tp, pp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if mcfg.activation_checkpointing else {}
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden, ffn_hidden_size=spec.ffn,
        num_attention_heads=spec.heads, num_query_groups=spec.kv_heads, kv_channels=spec.head_dim,
        normalization="RMSNorm", layernorm_epsilon=spec.eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=spec.qkv_bias, qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=bool(mcfg.sequence_parallel and tp > 1),
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, perform_initialization=False,
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        calculate_per_token_loss=True,  # the schedule passes our loss contributions through undivided
        softmax_scale=_softmax_scale(spec), **recompute, **_moe_config(spec, mcfg))


def _moe_config(spec: ModelSpec, mcfg) -> dict:
    """TransformerConfig's MoE fields ({} for a dense model), routing as HF Qwen3-MoE: softmax over all experts,
    the top k, renormalised when norm_topk_prob: Megatron's softmax over the top-k logits (moe_router_pre_softmax
    False) is that function; without norm_topk_prob, pre_softmax (softmax over all, then the top k). Megatron's
    own load-balancing and z-losses stay off ("none", coefficients 0 / None): policy.megatron_cfg's router-loss
    keys are computed by backends/router.py with HF's definition (its docstring says why), from the logits
    record_router_logits captures. The router runs in fp32. Token dispatch "alltoall" (gloo's all_to_all).
    Expert tensor parallelism 1: under TP (with sequence parallelism) the experts are whole on every TP rank,
    each rank's tokens (its sequence share) go to them (mark_replicated_experts). Every router has Megatron's
    RouterReplay (replay_routes; idle, it computes its own top k)."""
    if not spec.experts:
        return {}
    return dict(num_moe_experts=spec.experts, moe_router_topk=spec.experts_per_token,
                moe_ffn_hidden_size=spec.moe_ffn, moe_router_score_function="softmax",
                moe_router_pre_softmax=not spec.moe_norm_topk, moe_router_dtype="fp32",
                moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
                moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False,
                expert_model_parallel_size=mcfg.expert_model_parallel_size, expert_tensor_parallel_size=1,
                moe_enable_routing_replay=True)


def record_router_logits(model: nn.Module, recorder, sequence_parallel: bool) -> None:
    """Every TopKRouter's gating (its fp32 logits [s, b, E]) also hands the logits, row by row as [b * s, E],
    to `recorder` (backends/router.RouterLogits), the router's own routing reading them unchanged; and its
    output, the experts it dispatched each position to (routing_map [s * b, E]), as ids row by row [b * s, k].
    Under sequence parallelism a TP rank's router sees its share [s / tp, b, ...] of the positions: both are
    all-gathered over the TP group into the whole [s, b, ...] (the logits' backward keeps this rank's share of
    their gradient), so every TP rank records the exact, whole micro-batch."""
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    whole = partial(gather_from_sequence_parallel_region, tensor_parallel_output_grad=False) \
        if sequence_parallel else (lambda x: x)

    def record_routes(router, args, out):
        if recorder.wants_routes(router):
            s, b = args[0].shape[:2]  # the router's input [s(/tp), b, H]
            chosen = whole(out[1].reshape(s, b, -1).float())  # [s, b, E] 1.0 where dispatched
            chosen = chosen.transpose(0, 1).reshape(-1, chosen.shape[-1])  # [b * s, E]
            recorder.record_routes(router, torch.topk(chosen, router.topk, dim=-1).indices)

    def wrap(router, gating):
        def recorded(hidden):
            logits = gating(hidden)  # [s(/tp), b, E]
            if recorder.wants_logits(router):
                full = whole(logits)  # [s, b, E]
                recorder.record(router, full.transpose(0, 1).reshape(-1, full.shape[-1]))
            return logits
        return recorded

    for router in routers:
        router.gating = wrap(router, router.gating)
        router.register_forward_hook(record_routes)


def mark_replicated_experts(model: nn.Module, tp: int) -> None:
    """Under TP the experts are whole on every TP rank (expert TP 1), each rank's gradient a share of the
    tokens': mark them `allreduce=False` as Megatron marks expert-parallel ones (it does at ep > 1 only), so
    the worker and Megatron's DDP sum them over the expert-data-parallel group (tp x dp / ep ranks, the TP
    peers among them) and the norm counts them on every TP rank."""
    if tp == 1:
        return
    for experts in (m for m in model.modules() if isinstance(m, SequentialMLP)):
        for p in experts.parameters():
            p.allreduce = False


def replay_routes(routes: torch.Tensor, sequence_parallel: bool = False) -> None:
    """The next forward of every TopKRouter dispatches as `routes` [r, t, L, k] (expert ids per position and
    MoE layer of this rank's stage, row by row; negative on positions never recorded, which go to experts
    0..k-1) instead of its own top k: Megatron's RouterReplay (REPLAY_FORWARD), its gates still the softmax of
    its own logits at those experts. Under sequence parallelism this TP rank's share [t / tp] of the positions.
    Until stop_replay()."""
    routes = torch.where(routes < 0, torch.arange(routes.shape[-1], device=routes.device), routes.long())
    routes = routes.transpose(0, 1)  # [t, r, L, k]
    if sequence_parallel:
        routes = scatter_to_sequence_parallel_region(routes)  # [t / tp, r, L, k]
    t, r, layers, k = routes.shape
    instances = RouterReplay.global_router_replay_instances
    if len(instances) != layers:
        raise RuntimeError(f"routing replay: routes of {layers} MoE layers for {len(instances)} routers")
    RouterReplay.clear_global_indices()
    RouterReplay.set_replay_data([routes[:, :, i].reshape(t * r, k) for i in range(layers)])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def stop_replay() -> None:
    """Routers compute their own top k again; the replayed routes dropped."""
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()


def _softmax_scale(spec: ModelSpec):
    """None (Megatron's 1 / sqrt(head_dim)), or under YaRN 1 / sqrt(head_dim) x attention_factor^2: HF multiplies
    cos and sin by attention_factor, hence rotated q and k each, hence q.k by its square. Carried by the softmax
    scale it holds for every core attention (sdpa, unfused, TE) and equals HF's up to fp32 rounding."""
    scaling = spec.rope_scaling
    if scaling is None or scaling.attention_factor == 1.0:
        return None
    return spec.head_dim ** -0.5 * scaling.attention_factor ** 2


def build_gpt(spec: ModelSpec, config, attention: str = "sdpa", grouped_experts: bool = True) -> nn.Module:
    """The GPTModel chunk of this rank's pipeline stage (scalar head on the last stage when spec.scalar_head).
    attention: the local spec's core attention, sdpa (attention.SDPAttention) or unfused (Megatron's own).
    MoE experts (local spec): with grouped_experts (policy.megatron_cfg.moe_grouped_gemm), where torch has
    grouped_mm, grouped_experts.GroupedSequentialMLP: SequentialMLP's parameters computed by two grouped matmuls;
    else Megatron's SequentialMLP (a loop over the experts)."""
    post = ps.is_pipeline_last_stage()
    RouterReplay.clear_global_router_replay_instances()  # per process; a restarted worker's were its last model's
    if spec.transformer_engine:  # fused norm + linear kernels; weights.py names the norms accordingly
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_norm)
    else:
        layer_spec = get_gpt_layer_local_spec(num_experts=spec.experts or None, moe_grouped_gemm=False,
                                              normalization="RMSNorm", qk_layernorm=spec.qk_norm)
        if attention == "sdpa":
            layer_spec.submodules.self_attention.submodules.core_attention = SDPAttention
        if spec.experts and grouped_experts and HAS_GROUPED_MM:  # SequentialMLP's, by two grouped matmuls
            layer_spec.submodules.mlp.submodules.experts.module = GroupedSequentialMLP
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec.padded_vocab, max_sequence_length=spec.max_positions,
        pre_process=ps.is_pipeline_first_stage(), post_process=post,
        share_embeddings_and_output_weights=spec.tied, position_embedding_type="rope",
        rotary_base=int(spec.rope_theta), parallel_output=True,
        seq_len_interpolation_factor=_linear_rope_factor(spec))
    if spec.rope_scaling is not None and spec.rope_scaling.kind == "llama3":
        _scale_llama3_frequencies(model, spec)
    if spec.rope_scaling is not None and spec.rope_scaling.kind == "yarn":
        _set_yarn_frequencies(model, spec)
    if spec.scalar_head and post:
        model.output_layer = ScalarHead(spec.hidden, config.sequence_parallel, config.params_dtype)
    if spec.padding_idx is not None and model.pre_process:
        model.embedding.word_embeddings.register_forward_hook(_padding_row_without_lookup_grad(spec.padding_idx))
    return model


def _linear_rope_factor(spec: ModelSpec):
    """rope_type linear: Megatron's seq_len_interpolation_factor divides the positions by the factor."""
    scaling = spec.rope_scaling
    return scaling.factor if scaling is not None and scaling.kind == "linear" else None


def _scale_llama3_frequencies(model: nn.Module, spec: ModelSpec) -> None:
    """rope_type llama3: the rotary inverse frequencies [head_dim / 2] rescaled by Megatron-Core's own
    RotaryEmbedding._apply_scaling with all four of the checkpoint's parameters (GPTModel's rope_scaling flag
    passes only the factor and fixes the others at Llama 3.1's 1, 4, 8192; Llama 3.2 and tiny test models differ)."""
    rotary, s = model.rotary_pos_emb, spec.rope_scaling
    rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, factor=s.factor, low_freq_factor=s.low_freq_factor,
                                            high_freq_factor=s.high_freq_factor,
                                            original_max_position_embeddings=s.original_max_positions)


def _set_yarn_frequencies(model: nn.Module, spec: ModelSpec) -> None:
    """rope_type yarn: the rotary inverse frequencies [head_dim / 2] replaced by HF's (ModelSpec.rope_scaling
    holds them); the attention factor is the softmax scale's (_softmax_scale)."""
    rotary = model.rotary_pos_emb
    inv_freq = torch.tensor(spec.rope_scaling.inv_freq, dtype=torch.float32, device=rotary.inv_freq.device)
    if inv_freq.shape != rotary.inv_freq.shape:  # a partial_rotary_factor, which Llama and Qwen do not have
        raise ValueError(f"YaRN gives {inv_freq.numel()} frequencies, Megatron's rotary embedding has "
                         f"{rotary.inv_freq.numel()}")
    rotary.inv_freq = inv_freq


def _padding_row_without_lookup_grad(padding_idx: int):
    """Forward hook on the word embedding (input ids [b, s] -> [b, s, h], or [s / tp, b, h] under sequence
    parallelism): positions holding padding_idx pass their embedding on detached, so that row gets no gradient
    from the lookup, as HF's nn.Embedding(padding_idx=pad_token_id). Measured on SmolLM2 (pad = EOS, in every
    chat turn): without it the tied embedding's gradient was 6% off HF's."""

    def hook(module, args, output):
        is_pad = args[0] == padding_idx  # [b, s]
        if output.shape[:2] == is_pad.shape:  # [b, s, h]
            mask = is_pad[..., None]
        else:  # sequence parallel: reduce-scattered to this TP rank's chunk of the sequence, [s / tp, b, h]
            chunk, rank = output.shape[0], ps.get_tensor_model_parallel_rank()
            mask = is_pad.t()[rank * chunk : (rank + 1) * chunk, :, None]
        return torch.where(mask, output.detach(), output)

    return hook


class RotaryPositions:
    """Per-sequence RoPE positions for packed rows. GPTModel's rotary table covers positions 0..s-1 of the row
    (it ignores position_ids); a forward hook on `model.rotary_pos_emb` re-indexes the table, [s, 1, 1, d], by
    the row's position ids while `use(position_ids [1, s])` is active, so each packed sequence starts at 0."""

    def __init__(self, model: nn.Module):
        self.positions = None
        if getattr(model, "rotary_pos_emb", None) is not None:
            model.rotary_pos_emb.register_forward_hook(self._hook)

    def _hook(self, module, args, table):
        return table if self.positions is None else table[self.positions]

    @contextlib.contextmanager
    def use(self, position_ids):
        self.positions = None if position_ids is None else position_ids[0]
        try:
            yield
        finally:
            self.positions = None


def load_local(model: nn.Module, local: dict[str, torch.Tensor]) -> None:
    """Copy this rank's shards into the model; every parameter must be covered and every shard used."""
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(local))
    unexpected = sorted(set(local) - set(params))
    if missing or unexpected:
        raise RuntimeError(f"megatron weight mapping: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(local[name].shape) != tuple(p.shape):
                raise RuntimeError(f"megatron weight mapping: {name} has shape {tuple(local[name].shape)}, "
                                   f"the model expects {tuple(p.shape)}")
            p.copy_(local[name])


def mark_tensor_parallel(model: nn.Module, split_dims: dict[str, int]) -> None:
    """Set Megatron's TP attributes (`tensor_model_parallel`, `partition_dim`) on the split parameters: Megatron
    sets them only when it initializes weights itself (perform_initialization), and its gradient-norm and
    optimizer code, like ours, tell split parameters from TP-replicated ones by them."""
    params = dict(model.named_parameters())
    for name, dim in split_dims.items():
        if not hasattr(params[name], "tensor_model_parallel"):  # (biases get them even without initialization)
            set_tensor_model_parallel_attributes(params[name], True, dim, 1)

