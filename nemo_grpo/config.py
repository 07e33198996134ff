"""Typed configuration: the dataclass schema, YAML recipes and dotted command-line overrides (the ground floor).

A recipe is YAML data merged onto the schema below with OmegaConf, so an unknown key or a value of the
wrong type is rejected with the full dotted key (`read_config`). Cross-field rules (batch divisibility,
parallel layout, resources, files) live one floor up in nemo_grpo/validation.py, which also has the
validated loaders the entry points use. Every error is a `ConfigError` whose message names the key and what is
allowed. Key names follow NeMo RL's GRPO guide so its users recognise them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from nemo_grpo.errors import ConfigError  # noqa: F401  (re-exported: the config's own error)

BUILTIN_MODEL_PREFIX = "builtin:"


# ----------------------------------------------------------------------------------------------- policy
@dataclass
class OptimizerConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 5e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
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
    tensor_parallel_size: int = 1
    # data-parallel (FSDP2) degree; null = world size / tensor_parallel_size
    data_parallel_size: Optional[int] = None
    # context-parallel degree: each sequence cut into 2 x this many chunks over as many ranks (world = dp x cp x
    # tp); the max_total_sequence_length and token budgets must divide by 2 x this (nemo_grpo/validation.py)
    context_parallel_size: int = 1
    activation_checkpointing: bool = False


@dataclass
class DistributedDataParallelConfig:
    """policy.megatron_cfg.distributed_data_parallel_config (NeMo RL's keys), used with use_distributed_optimizer."""
    overlap_grad_reduce: bool = True  # reduce-scatter each gradient bucket as soon as the backward fills it
    grad_reduce_in_fp32: bool = True  # bf16 models: accumulate and reduce the gradients in fp32


@dataclass
class MegatronConfig(RouterLossConfig):
    """policy.megatron_cfg: the Megatron-Core back end's layout (world size = tp x cp x pp x dp)."""
    tensor_model_parallel_size: int = 1
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
    gpus_per_node: Optional[int] = None
    num_nodes: Optional[int] = None


@dataclass
class ColocatedConfig:
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


@dataclass
class GenerationConfig:
    backend: str = "vllm"  # vllm | torch (vllm falls back to torch, with a notice, where it is not installed)
    max_new_tokens: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    stop_strings: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None  # besides the tokenizer's EOS
    refit_bucket_size_mb: float = 256.0  # weights travel to the engine in buckets of about this size
    colocated: ColocatedConfig = field(default_factory=ColocatedConfig)
    vllm_cfg: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class DynamicBatchingConfig:
    """policy.dynamic_batching (NeMo RL's keys): each rank's rows sorted by length and cut into micro-batches
    whose padded size (rows x longest row, rounded up to sequence_length_round) stays within a token budget;
    replaces train_micro_batch_size / logprob_batch_size when enabled."""
    enabled: bool = False
    train_mb_tokens: Optional[int] = None  # padded tokens per training micro-batch
    logprob_mb_tokens: Optional[int] = None  # padded tokens per get_logprobs / score forward
    sequence_length_round: int = 64


@dataclass
class SequencePackingConfig:
    """policy.sequence_packing (NeMo RL's keys): each rank's rows packed into bins of at most a token budget
    (algorithm: first_fit_decreasing | concatenative); a bin is one row, its sequences isolated by per-sequence
    attention and position ids. Replaces train_micro_batch_size /
    logprob_batch_size (and dynamic batching) when enabled."""
    enabled: bool = False
    train_mb_tokens: Optional[int] = None  # real tokens per packed training row
    logprob_mb_tokens: Optional[int] = None  # real tokens per packed get_logprobs / score row
    algorithm: str = "first_fit_decreasing"
    sequence_length_round: int = 64  # a packed row is padded to a multiple of this
    # varlen: attention per sequence, sum(len²) (backends/varlen.py); mask: one block-diagonal causal mask over
    # the row, s² (the reference path; Megatron's unfused attention always uses it)
    attention: str = "varlen"


@dataclass
class TokenizerConfig:
    name: Optional[str] = None  # local HF directory; null = policy.model_name
    chat_template: Optional[str] = None  # Jinja template overriding the tokenizer's own


@dataclass
class LoraConfig:
    """policy.lora: low-rank adapters W + (alpha / rank) * B @ A on the targeted linear layers; only the adapters
    train (NeMo RL's dtensor_cfg.lora_cfg / megatron_cfg.peft keys; their `dim` is `rank` here)."""
    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapter's input
    # Hugging Face leaf names of the linear layers that get adapters; empty: every linear layer of attention
    # and MLP (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)
    target_modules: list[str] = field(default_factory=list)
    exclude_modules: list[str] = field(default_factory=list)  # leaf names taken out of the targets


@dataclass
class PolicyConfig:
    # a local Hugging Face directory, or "builtin:tiny-addition" (built and warm-started locally on first use)
    model_name: str = "builtin:tiny-addition"
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    backend: str = "dtensor"  # Policy back end, by registered name
    precision: str = "float32"  # float32 | bfloat16 (bf16 mixed precision: fp32 master weights)
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

    @property
    def router_losses(self) -> RouterLossConfig:
        """The router-loss keys of the configured back end's section (megatron_cfg or dtensor_cfg)."""
        return self.megatron_cfg if self.backend == "megatron" else self.dtensor_cfg


# ----------------------------------------------------------------------------------------------- loss / grpo
@dataclass
class LossConfig:
    """loss_fn: the policy loss, by registered name, and its options (NeMo RL's ClippedPGLossConfig keys)."""
    name: str = "clipped_pg"  # registered loss (algorithms/losses.py LOSSES)
    reference_policy_kl_penalty: float = 0.0  # beta; 0 disables the reference model entirely
    reference_policy_kl_type: str = "k3"  # k1 | k2 | k3: each one's gradient follows KL(pi || pi_ref)
    kl_input_clamp_value: Optional[float] = 20.0  # clamp log-ratios (KL and its weight) before exp
    kl_output_clamp_value: Optional[float] = 10.0  # clamp each token's weighted KL term
    use_kl_in_reward: bool = False  # the sequence KL (beta x sum over tokens) is taken off the reward, not a loss term
    ratio_clip_min: float = 0.2  # epsilon_low: ratio clipped to [1 - ratio_clip_min, 1 + ratio_clip_max]
    ratio_clip_max: float = 0.2  # epsilon_high (DAPO clip-higher when > ratio_clip_min)
    ratio_clip_c: Optional[float] = None  # dual clip (Ye et al. 2019), must be > 1
    # the actor objective by registered name (algorithms/objectives.py OBJECTIVES): ppo_clip | gspo | cispo |
    # reinforce; null: the one NeMo RL's flags below name (none set: ppo_clip)
    objective: Optional[str] = None
    disable_ppo_ratio: bool = False  # objective reinforce: -A x logp, no ratio, no clip (RLOO with leave-one-out)
    force_on_policy_ratio: bool = False  # ppo_clip with ratio 1 (value), the gradient of logp: one update per rollout
    sequence_level_importance_ratios: bool = False  # objective gspo: one length-normalised ratio per sequence, clipped
    use_cispo: bool = False  # objective cispo: -A x stop_grad(clip(ratio)) x logp
    use_on_policy_kl_approximation: bool = False  # weight the KL by pi / pi_gen (samples come from the engine)
    use_importance_sampling_correction: bool = False  # weight the actor loss by pi_old / pi_gen
    truncated_importance_sampling_type: Optional[str] = None  # tis | icepop | seq-mask-tis (null: tis if a ratio is set)
    truncated_importance_sampling_ratio: Optional[float] = None  # upper bound of the IS weight
    truncated_importance_sampling_ratio_min: Optional[float] = None  # lower bound (icepop, seq-mask-tis; tis: 0)
    token_level_loss: bool = True  # false: mean over tokens of each sample, then over samples
    # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (Dr.GRPO); null: from token_level_loss
    loss_aggregation: Optional[str] = None


@dataclass
class RewardScalingConfig:
    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


@dataclass
class RewardShapingConfig:
    """grpo.reward_shaping: DAPO's soft overlong penalty, and a penalty for samples that never stop."""
    enabled: bool = False
    # DAPO: past max_response_length - overlong_buffer_length tokens, the reward falls linearly, by
    # overlong_buffer_penalty at max_response_length (and further beyond it)
    overlong_buffer_length: Optional[int] = None
    overlong_buffer_penalty: Optional[float] = None
    max_response_length: Optional[int] = None  # null: policy.generation.max_new_tokens x grpo.max_rollout_turns
    # a truncated sample's reward is multiplied by this (0: no reward for never stopping; 1: no penalty)
    stop_properly_penalty_coef: Optional[float] = None


@dataclass
class AdvEstimatorConfig:
    """grpo.adv_estimator: how rewards become advantages (algorithms/advantages.py ESTIMATORS)."""
    name: str = "grpo"  # grpo | reinforce_plus_plus | gdpo
    minus_baseline: bool = True  # reinforce_plus_plus: subtract the group mean before the batch normalisation
    reward_weights: Optional[list[float]] = None  # gdpo: one weight per reward component, in sorted name order


@dataclass
class AsyncGRPOConfig:
    """grpo.async_grpo (NeMo RL's keys): generation runs ahead of training on its own actors
    (nemo_grpo/algorithms/async_rollouts.py)."""
    enabled: bool = False
    max_trajectory_age_steps: int = 1  # rollouts train at most this many optimizer steps after their weights
    in_flight_weight_updates: bool = False  # new weights reach the engine between two forward steps of a batch


@dataclass
class GRPOConfig:
    num_prompts_per_step: int = 16
    num_generations_per_prompt: int = 8
    max_rollout_turns: int = 1
    max_num_epochs: int = 1000
    max_num_steps: int = 400
    normalize_rewards: bool = True  # divide advantages by the group's reward std
    use_leave_one_out_baseline: bool = False
    val_period: int = 50  # 0 disables periodic validation
    val_at_start: bool = True
    val_at_end: bool = True
    val_batch_size: int = 100  # prompts per validation generation call
    max_val_samples: int = 100
    seed: int = 42
    overlong_filtering: bool = False  # truncated samples (no EOS) are excluded from the loss
    use_dynamic_sampling: bool = False  # DAPO: keep only groups whose rewards differ
    dynamic_sampling_max_gen_batches: int = 10
    batch_multiplier: float = 1.0  # prompts drawn per generation batch under dynamic sampling
    reward_scaling: RewardScalingConfig = field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    adv_estimator: AdvEstimatorConfig = field(default_factory=AdvEstimatorConfig)
    advantage_clip_low: Optional[float] = None  # advantages clamped to [low, high] after the estimator
    advantage_clip_high: Optional[float] = None
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)


# ----------------------------------------------------------------------------------------------- env / data
@dataclass
class MathEnvConfig:
    num_workers: int = 2  # verifier processes
    timeout_s: float = 5.0  # per-sample parsing / verification budget
    max_answer_chars: int = 2048  # only the tail of a response is parsed


@dataclass
class CodeEnvConfig:
    """env.code: model-written Python run in the sandbox (nemo_grpo/envs/sandbox.py) against test cases."""
    num_workers: int = 2  # sandbox worker actors (each runs one program at a time)
    terminate_on_evaluation: bool = True  # false: multi-turn (code blocks run, output returned)
    reward_mode: str = "fraction"  # fraction of the cases passed | all_or_nothing
    timeout_s: float = 5.0  # wall clock per run
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_bytes: int = 65536
    # identical programs of one step (same code, cases and answer, or same code in a multi-turn run) run once
    # and share the result; false runs every copy (a program that reads time or randomness gets its own draw)
    run_identical_once: bool = True


@dataclass
class RewardModelTypeConfig:
    enabled: bool = True  # NeMo RL's switch; false turns the reward model off like env.reward_model.enabled
    reward_model_type: str = "bradley_terry"  # a scalar head over the last real token (the only type so far)


@dataclass
class RewardModelEnvConfig:
    """env.reward_model: rewards from a sequence classifier (HF *ForSequenceClassification, num_labels=1)."""
    enabled: bool = True
    model_name: str = ""  # local HF directory of the reward model
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # name null = model_name
    precision: str = "float32"  # float32 | bfloat16
    batch_size: int = 32  # sequences per scoring forward on one data-parallel rank
    max_model_len: int = 4096  # longer conversations keep their last max_model_len tokens (counted)
    # the reward model's own devices (worker processes on a CPU); see nemo_grpo/distributed/resource_plan.py
    resources: ResourcesConfig = field(default_factory=lambda: ResourcesConfig(gpus_per_node=1, num_nodes=1))
    reward_model_cfg: RewardModelTypeConfig = field(default_factory=RewardModelTypeConfig)
    backend: str = "dtensor"  # dtensor | megatron
    dtensor_cfg: DTensorConfig = field(default_factory=DTensorConfig)
    megatron_cfg: MegatronConfig = field(default_factory=MegatronConfig)

    @property
    def active(self) -> bool:
        """The reward model runs (gets devices, scores) only when both switches are on."""
        return self.enabled and self.reward_model_cfg.enabled

    def policy_config(self) -> "PolicyConfig":
        """The PolicyConfig of this scoring-only policy (no optimizer steps are taken)."""
        return PolicyConfig(model_name=self.model_name, backend=self.backend, precision=self.precision,
                            logprob_batch_size=self.batch_size, max_total_sequence_length=self.max_model_len,
                            dtensor_cfg=self.dtensor_cfg, megatron_cfg=self.megatron_cfg)


@dataclass
class EnvConfig:
    math: Optional[MathEnvConfig] = field(default_factory=MathEnvConfig)
    reward_model: Optional[RewardModelEnvConfig] = None
    code: Optional[CodeEnvConfig] = None


@dataclass
class DatasetConfig:
    # a built-in name (addition), a local .jsonl file, or a Hugging Face dataset name
    dataset_name: str = "addition"
    data_path: Optional[str] = None  # JSONL path (or HF name) for dataset_name=ResponseDataset
    input_key: str = "input"
    output_key: str = "output"
    subset: Optional[str] = None  # HF datasets only
    split: str = "train"
    prompt_file: Optional[str] = None  # a Python format string with {} for the problem text
    system_prompt_file: Optional[str] = None
    env_name: str = "math"


@dataclass
class DataConfig:
    max_input_seq_length: int = 8  # longer prompts are dropped (counted in the log)
    shuffle: bool = True
    train: DatasetConfig = field(default_factory=DatasetConfig)
    validation: Optional[DatasetConfig] = field(default_factory=DatasetConfig)


# ----------------------------------------------------------------------------------------------- run
@dataclass
class ClusterConfig:
    gpus_per_node: int = 2  # on a CPU-only machine: worker processes standing in for devices
    num_nodes: int = 1
    num_threads_per_worker: int = 1  # torch threads in each actor (pinned: busy processes collide otherwise)
    gpu_memory_gib: float = 79.6  # per device, for `python -m nemo_grpo.plan` (an 80 GB H100 / A100 has 79.6)


@dataclass
class CheckpointingConfig:
    enabled: bool = True
    checkpoint_dir: str = "results/grpo_tiny"
    metric_name: Optional[str] = "val:accuracy"  # ranks checkpoints for keep_top_k; null keeps the newest
    higher_is_better: bool = True
    keep_top_k: Optional[int] = 3
    save_period: int = 100
    resume: bool = True  # continue from the latest checkpoint in checkpoint_dir if there is one


@dataclass
class WandbConfig:
    project: str = "nemo-grpo"
    name: Optional[str] = None


@dataclass
class MLflowConfig:
    experiment_name: str = "nemo-grpo"
    run_name: Optional[str] = None
    tracking_uri: Optional[str] = None


@dataclass
class LoggerConfig:
    log_dir: str = "logs/grpo_tiny"
    tensorboard_enabled: bool = True
    wandb_enabled: bool = False
    mlflow_enabled: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    progress_bar: bool = True
    plot: bool = True  # PNG of reward and validation accuracy per step, next to the logs
    num_val_samples_to_print: int = 0


@dataclass
class MasterConfig:
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    loss_fn: LossConfig = field(default_factory=LossConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


# ----------------------------------------------------------------------------------------------- reward models
@dataclass
class RMDataConfig:
    train_data_path: str = ""  # JSONL of preference pairs, or builtin:addition (generated, seed 0)
    val_data_path: Optional[str] = None  # (builtin:addition: other wrong answers, seed 1)
    max_seq_length: int = 256  # longer conversations keep their last tokens


@dataclass
class RMLoopConfig:
    max_num_steps: int = 100  # optimizer steps of policy.train_global_batch_size rows (= half as many pairs)
    val_period: int = 10  # 0: validate only at the end
    seed: int = 42
    output_dir: str = "results/rm"  # init/ (a causal LM's seeded score head) and hf/ (the trained model)


@dataclass
class RMTrainConfig:
    """python -m nemo_grpo.train_rm: Bradley-Terry training of a reward model (nemo_grpo/algorithms/reward_model.py)."""
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(max_grad_norm=1.0))
    rm: RMLoopConfig = field(default_factory=RMLoopConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpointing: CheckpointingConfig = field(default_factory=lambda: CheckpointingConfig(
        checkpoint_dir="results/rm/checkpoints"))
    logger: LoggerConfig = field(default_factory=lambda: LoggerConfig(log_dir="logs/rm", plot=False))


@dataclass
class RMEvalConfig:
    """python -m nemo_grpo.eval_rm: accuracy of a reward model (the reward-model environment's section, its
    resources being the worker processes / devices it runs on) on preference pairs."""
    reward_model: RewardModelEnvConfig = field(default_factory=lambda: RewardModelEnvConfig(
        resources=ResourcesConfig(gpus_per_node=1, num_nodes=1)))
    data_path: str = ""  # JSONL of preference pairs with a "subset" per row, or builtin:addition


# ----------------------------------------------------------------------------------------------- evaluation
@dataclass
class EvalConfig:
    """eval: python -m nemo_grpo.eval (NeMo RL's eval keys: metric, num_tests_per_prompt, k_value, seed, save_path)."""
    metric: str = "pass@k"  # pass@k | cons@k: the headline score (both are always reported)
    num_tests_per_prompt: int = 1  # samples per prompt (n)
    k_value: int = 1  # the k of pass@k and cons@k; at most num_tests_per_prompt
    seed: int = 42  # sampling seed of the first generation call (the next ones: seed + 1, ...)
    save_path: str = "results/eval"  # directory for samples.jsonl, summary.json and run.log
    num_prompts_per_step: int = 64  # prompts per generation call (each with its num_tests_per_prompt samples)
    max_num_prompts: Optional[int] = None  # only the first N prompts of the data set; null: all
    max_rollout_turns: int = 1  # turns per sample (multi-turn environments)
    progress_bar: bool = True


@dataclass
class EvalDataConfig(DatasetConfig):
    """data for evaluation: the keys of one training split (data.train.*), and the prompt length limit."""
    max_input_seq_length: int = 8  # longer prompts are dropped (counted in the log)


@dataclass
class EvalMasterConfig:
    """python -m nemo_grpo.eval: a model (policy.model_name: an HF directory, builtin:..., or a training
    checkpoint's step_N) generating on a data set, scored by its environment. Generation settings are
    policy.generation's; temperature 0 decodes greedily (NeMo RL's eval default)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    policy: PolicyConfig = field(default_factory=lambda: PolicyConfig(
        generation=GenerationConfig(temperature=0.0)))
    data: EvalDataConfig = field(default_factory=EvalDataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


TOP_LEVEL_SECTIONS = {
    "policy": "model, back end (policy.backend), batch sizes, optimizer, parallelism, generation engine",
    "loss_fn": "clipped policy-gradient loss: clipping, KL to the reference, importance sampling",
    "grpo": "steps, group size, advantages, dynamic sampling, reward scaling, validation",
    "env": "environments by name (env.math.*)",
    "data": "datasets (built-in, JSONL, HF), prompt length limit",
    "cluster": "devices per node, nodes, threads per worker",
    "checkpointing": "where and how often to save, top-k retention, resume",
    "logger": "TensorBoard / W&B / MLflow, progress bar, plots",
}


# ----------------------------------------------------------------------------------------------- loading
def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except UnicodeDecodeError as e:
        before = open(path, "rb").read()[: e.start]
        line, column = 1 + before.count(b"\n"), e.start - before.rfind(b"\n")
        raise ConfigError(f"--config: {path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at column "
                          f"{column}); save the recipe as UTF-8") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of sections, got {type(data).__name__}")
    parent = data.pop("defaults", None)  # a recipe may inherit from another recipe file
    if parent:
        base = _read_yaml(os.path.join(os.path.dirname(path), parent))
        return OmegaConf.to_container(OmegaConf.merge(base, data))
    return data


# keys of one back end's section that a user may look for in the other's: where they are built
BUILT_ELSEWHERE = {
    "dtensor_cfg.expert_model_parallel_size": "expert parallelism is built on the megatron back end: set "
    "policy.backend=megatron and policy.megatron_cfg.expert_model_parallel_size (DTensor replicates the experts "
    "over its tensor-parallel ranks and shards them with FSDP)",
    "dtensor_cfg.moe_router_replay": "routing replay is built on the megatron back end: set policy.backend=megatron "
    "and policy.megatron_cfg.moe_router_replay"}


def _explain(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).split("\n")[0]
    elsewhere = [hint for suffix, hint in BUILT_ELSEWHERE.items() if str(key).endswith(suffix)]
    return f"config key '{key}': {elsewhere[0] if elsewhere else msg}"


def read_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, schema: type = None) -> Any:
    """YAML recipe (optional) + dotted overrides -> a typed config of `schema` (default MasterConfig): unknown keys
    and wrong types are rejected with the dotted key. Cross-field rules are nemo_grpo/validation.py's."""
    try:
        merged = OmegaConf.structured(schema or MasterConfig)
        if path:
            merged = OmegaConf.merge(merged, _read_yaml(path))
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override '{item}' must look like key.sub=value")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from None


def to_dict(cfg: MasterConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]


def to_yaml(cfg: MasterConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


