"""The policy section of the configuration (policy.*): model, batch sizes, optimizer, the back ends' parallel
layouts, the generation engine, dynamic batching, sequence packing and LoRA.

Split out of nemo_grpo/config.py, which re-exports every class here (`from nemo_grpo.config import PolicyConfig`
keeps working); the reward model's sections reuse several of them (resources, tokenizer, layouts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class OptimizerConfig:
    """policy.optimizer: the torch optimizer of the policy's training steps (backends/optimizer.py)."""
    name: str = "adamw"  # adamw | sgd
    lr: float = 5e-4  # learning rate (after the warm-up); must be > 0
    weight_decay: float = 0.0  # AdamW: decoupled weight decay; SGD: L2 penalty added to the gradients
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's (beta1, beta2) moment decays
    eps: float = 1e-8  # AdamW's epsilon, added to the denominator
    warmup_steps: int = 0  # linear warm-up of the learning rate over this many optimizer steps, then constant


@dataclass
class RouterLossConfig:
    """The Mixture-of-Experts router's training losses (Megatron's / NeMo RL's keys), the same fields in
    policy.megatron_cfg and policy.dtensor_cfg; both back ends compute them with backends/router.py (HF's
    load-balancing loss over the non-padding tokens). Ignored for a dense model."""
    # none | aux_loss (HF's / Switch Transformer's load-balancing loss; Megatron's seq_aux_loss is not built)
    moe_router_load_balancing_type: str = "none"
    moe_aux_loss_coeff: float = 0.0  # the load-balancing loss's weight in the training loss (>= 0)
    moe_z_loss_coeff: Optional[float] = None  # the router z-loss's weight (ST-MoE); null or 0: off


@dataclass
class DTensorConfig(RouterLossConfig):
    """dtensor_cfg: the DTensor back end's layout (FSDP2 x tensor parallel; world size = dp x cp x tp)."""
    # tensor-parallel degree: the attention and MLP projections split over this many ranks (must divide the
    # model's heads, KV heads and MLP width)
    tensor_parallel_size: int = 1
    # data-parallel (FSDP2) degree; null = world size / tensor_parallel_size
    data_parallel_size: Optional[int] = None
    # context-parallel degree: each sequence cut into 2 x this many chunks over as many ranks (world = dp x cp x
    # tp); the max_total_sequence_length and token budgets must divide by 2 x this (nemo_grpo/validation.py)
    context_parallel_size: int = 1
    activation_checkpointing: bool = False  # recompute every layer in the backward (HF gradient checkpointing)


@dataclass
class DistributedDataParallelConfig:
    """megatron_cfg.distributed_data_parallel_config (NeMo RL's keys), used with use_distributed_optimizer."""
    overlap_grad_reduce: bool = True  # reduce-scatter each gradient bucket as soon as the backward fills it
    grad_reduce_in_fp32: bool = True  # bf16 models: accumulate and reduce the gradients in fp32


@dataclass
class MegatronConfig(RouterLossConfig):
    """megatron_cfg: the Megatron-Core back end's layout (world size = tp x cp x pp x dp)."""
    tensor_model_parallel_size: int = 1  # tensor-parallel degree (must divide the heads, KV heads and MLP width)
    pipeline_model_parallel_size: int = 1  # must divide the model's num_hidden_layers
    sequence_parallel: bool = False  # with tp > 1: activations outside attention/MLP split along the sequence
    # context-parallel degree: each sequence cut into 2 x this many chunks over as many ranks (world = tp x cp x pp
    # x dp); the max_total_sequence_length and token budgets must divide by 2 x this (x tp with sequence_parallel)
    context_parallel_size: int = 1
    # Mixture-of-Experts models: the routed experts of each layer split over this many ranks (Megatron's expert
    # parallelism, tokens exchanged all-to-all); carved out of the data-parallel ranks, so it must divide dp and
    # the number of experts
    expert_model_parallel_size: int = 1
    # Megatron-Core's DistributedOptimizer: fp32 main weights and optimizer state sharded over the data-parallel
    # ranks, gradients reduce-scattered by its DistributedDataParallel (distributed_data_parallel_config)
    use_distributed_optimizer: bool = False
    distributed_data_parallel_config: DistributedDataParallelConfig = field(
        default_factory=DistributedDataParallelConfig)
    activation_checkpointing: bool = False  # full recomputation of every layer in the backward pass
    # Mixture-of-Experts routing replay: none | old_policy (R2: the training forward routes every position to the
    # experts the log-prob pass of the same weights chose, recorded per position and layer) | engine (R3: the
    # routes the generation engine recorded while it sampled; the torch engine records them)
    moe_router_replay: str = "none"
    # Mixture-of-Experts: each layer's local experts computed by two torch grouped matmuls (where torch has
    # grouped_mm; backends/mcore/grouped_experts.py) instead of Megatron-Core's SequentialMLP loop over them
    moe_grouped_gemm: bool = True
    layer_spec: str = "local"  # local (torch modules) | transformer_engine (needs Transformer Engine)
    # core attention of the local spec: sdpa (torch's scaled_dot_product_attention: flash / memory-efficient
    # kernels, no [s, s] scores kept) | unfused (Megatron's DotProductAttention); TE's spec has its own
    attention_backend: str = "sdpa"


@dataclass
class ResourcesConfig:
    """A role's own devices (non-colocated generation, a reward model): distributed/resource_plan.py."""
    # devices on each of its nodes (one node: taken out of cluster.gpus_per_node; several nodes: null = all)
    gpus_per_node: Optional[int] = None
    num_nodes: Optional[int] = None  # whole nodes of its own (required when cluster.num_nodes > 1)


@dataclass
class ColocatedConfig:
    """policy.generation.colocated: whether generation shares the policy's devices."""
    # true: generation shares the policy's devices; weights refit through host shared memory.
    # false: generation is a separate group of actors; weights refit over a collective group of their own
    # (gloo on CPU, NCCL on GPU) from policy rank 0 (nemo_grpo/weights/refit.py)
    enabled: bool = True
    # the devices of non-colocated generation: required on GPUs, unused on a CPU-only cluster
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)


@dataclass
class VllmConfig:
    """policy.generation.vllm_cfg (NeMo RL's keys)."""
    tensor_parallel_size: int = 1  # devices of one engine (CPU: worker processes, threads unbound)
    gpu_memory_utilization: float = 0.6  # of each GPU, for weights + KV cache (colocated: the policy shares it)
    max_model_len: Optional[int] = None  # null: min(max_position_embeddings, 32768)
    # auto | float32 | bfloat16, chosen on the engine's device as policy.precision is (nemo_grpo/precision.py);
    # null: policy.precision
    precision: Optional[str] = None


@dataclass
class GenerationConfig:
    """policy.generation: the engine that samples the rollouts (and the evaluation's answers)."""
    backend: str = "vllm"  # vllm | torch (vllm falls back to torch, with a notice, where it is not installed)
    max_new_tokens: int = 4  # tokens generated per sample and turn at most
    temperature: float = 1.0  # > 0 (eval: 0 decodes greedily); training log-probs use logits / temperature too
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this probability mass; 1: off
    top_k: Optional[int] = None  # sample among the k most likely tokens only; null: off
    stop_strings: Optional[list[str]] = None  # generation stops after any of these (kept in the response)
    stop_token_ids: Optional[list[int]] = None  # besides the tokenizer's EOS
    refit_bucket_size_mb: float = 256.0  # weights travel to the engine in buckets of about this size
    # engine replicas; null: one per vllm_cfg.tensor_parallel_size devices of generation (colocated: the
    # policy's), every device generating. N: the first N of those, node by node (fewer replicas: less memory,
    # each holds the weights and a KV cache, on a CPU VLLM_CPU_KVCACHE_SPACE GiB of host memory; fewer
    # start-ups and refits where generation is short). Samples do not depend on it (seeded per request)
    num_replicas: Optional[int] = None
    colocated: ColocatedConfig = field(default_factory=ColocatedConfig)
    vllm_cfg: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class DynamicBatchingConfig:
    """policy.dynamic_batching (NeMo RL's keys): each rank's rows sorted by length and cut into micro-batches
    whose padded size (rows x longest row, rounded up to sequence_length_round) stays within a token budget;
    replaces train_micro_batch_size / logprob_batch_size when enabled."""
    enabled: bool = False  # cut micro-batches by the token budgets below instead of by row count
    train_mb_tokens: Optional[int] = None  # padded tokens per training micro-batch
    logprob_mb_tokens: Optional[int] = None  # padded tokens per get_logprobs / score forward
    sequence_length_round: int = 64  # each micro-batch's longest row is rounded up to a multiple of this


@dataclass
class SequencePackingConfig:
    """policy.sequence_packing (NeMo RL's keys): each rank's rows packed into bins of at most a token budget
    (algorithm: first_fit_decreasing | concatenative); a bin is one row, its sequences isolated by per-sequence
    attention and position ids. Replaces train_micro_batch_size /
    logprob_batch_size (and dynamic batching) when enabled."""
    enabled: bool = False  # pack rows into bins of the token budgets below instead of batching by row count
    train_mb_tokens: Optional[int] = None  # real tokens per packed training row
    logprob_mb_tokens: Optional[int] = None  # real tokens per packed get_logprobs / score row
    algorithm: str = "first_fit_decreasing"  # first_fit_decreasing (longest first) | concatenative (row order)
    sequence_length_round: int = 64  # a packed row is padded to a multiple of this
    # varlen: attention per sequence, sum(len²) (backends/varlen.py); mask: one block-diagonal causal mask over
    # the row, s² (the reference path; Megatron's unfused attention always uses it)
    attention: str = "varlen"


@dataclass
class TokenizerConfig:
    """The tokenizer: the model's own unless named here."""
    name: Optional[str] = None  # local HF directory; null = policy.model_name
    chat_template: Optional[str] = None  # Jinja template overriding the tokenizer's own


@dataclass
class LoraConfig:
    """policy.lora: low-rank adapters W + (alpha / rank) * B @ A on the targeted linear layers; only the adapters
    train (NeMo RL's dtensor_cfg.lora_cfg / megatron_cfg.peft keys; their `dim` is `rank` here)."""
    enabled: bool = False  # train adapters only (the base weights frozen)
    rank: int = 8  # r of A [r, in] and B [out, r] (NeMo RL's dim)
    alpha: float = 16.0  # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0  # on the adapter's input
    # Hugging Face leaf names of the linear layers that get adapters; empty: every linear layer of attention
    # and MLP (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)
    target_modules: list[str] = field(default_factory=list)
    exclude_modules: list[str] = field(default_factory=list)  # leaf names taken out of the targets
    # what a refit sends the generation engine: "adapters" (the engine starts from the base weights with LoRA on
    # and each refit installs the adapters, A and B, as its LoRA adapter; the base never moves) or "merged" (the
    # engine holds plain weights; each refit sends the engine layers under adapters, W + scale * B @ A)
    refit: str = "adapters"


@dataclass
class PolicyConfig:
    """policy: the model that is trained (or evaluated), its back end, batch sizes and generation engine."""
    # a local Hugging Face directory, or "builtin:tiny-addition" (built and warm-started locally on first use)
    model_name: str = "builtin:tiny-addition"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    backend: str = "dtensor"  # Policy back end, by registered name
    # auto | float32 | bfloat16 (bf16 mixed precision: fp32 master weights); auto: bf16 where the device computes
    # it natively (a GPU with bf16, a CPU with AVX512-BF16/AMX), else fp32 (nemo_grpo/precision.py)
    precision: str = "auto"
    train_global_batch_size: int = 128  # samples per optimizer step
    train_micro_batch_size: int = 32  # samples per forward/backward on one data-parallel rank
    logprob_batch_size: int = 64  # samples per forward in get_logprobs on one data-parallel rank
    max_total_sequence_length: int = 16  # prompt + response tokens
    max_grad_norm: Optional[float] = 0.2  # null disables clipping
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dtensor_cfg: DTensorConfig = field(default_factory=DTensorConfig)
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
