"""Typed configuration: dataclass schema, YAML recipes, dotted command-line overrides, validation.

A recipe is YAML data merged onto the schema below with OmegaConf, so an unknown key or a value of the
wrong type is rejected with the full dotted key. Cross-field rules (batch divisibility, parallel layout)
live in `validate()`. Every error is a `ConfigError` whose message names the key and what is allowed.
Key names follow NeMo RL's GRPO guide so its users recognise them.
"""

from __future__ import annotations

import importlib.util
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
class DTensorConfig:
    tensor_parallel_size: int = 1
    # data-parallel (FSDP2) degree; null = world size / tensor_parallel_size
    data_parallel_size: Optional[int] = None
    activation_checkpointing: bool = False


@dataclass
class MegatronConfig:
    """policy.megatron_cfg: the Megatron-Core back end's layout (world size = tp x pp x dp)."""
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1  # must divide the model's num_hidden_layers
    sequence_parallel: bool = False  # with tp > 1: activations outside attention/MLP split along the sequence
    context_parallel_size: int = 1  # only 1 is supported so far (rejected otherwise, with a message)
    use_distributed_optimizer: bool = False  # optimizer state sharded over the data-parallel ranks (ZeRO-1)
    activation_checkpointing: bool = False  # full recomputation of every layer in the backward pass
    layer_spec: str = "local"  # local (torch modules) | transformer_engine (needs Transformer Engine)


@dataclass
class ResourcesConfig:
    gpus_per_node: Optional[int] = None
    num_nodes: Optional[int] = None


@dataclass
class ColocatedConfig:
    # true: generation shares the policy's devices; weights refit through Ray's object store.
    # false: generation is a separate group of actors; weights refit over a collective group of their own
    # (gloo on CPU, NCCL on GPU) from policy rank 0 (nemo_grpo/generation/refit.py)
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
class TokenizerConfig:
    name: Optional[str] = None  # local HF directory; null = policy.model_name
    chat_template: Optional[str] = None  # Jinja template overriding the tokenizer's own


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


# ----------------------------------------------------------------------------------------------- loss / grpo
@dataclass
class LossConfig:
    reference_policy_kl_penalty: float = 0.0  # beta; 0 disables the reference model entirely
    reference_policy_kl_type: str = "k3"  # k1 | k2 | k3
    kl_input_clamp_value: Optional[float] = 20.0  # clamp log-ratio before the estimator
    kl_output_clamp_value: Optional[float] = 10.0  # clamp the per-token KL after it
    ratio_clip_min: float = 0.2  # epsilon_low: ratio clipped to [1 - ratio_clip_min, 1 + ratio_clip_max]
    ratio_clip_max: float = 0.2  # epsilon_high (DAPO clip-higher when > ratio_clip_min)
    ratio_clip_c: Optional[float] = None  # dual clip (Ye et al. 2019), must be > 1
    use_on_policy_kl_approximation: bool = False
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_ratio: Optional[float] = None  # cap on the IS weight when correcting
    token_level_loss: bool = True  # false: mean over tokens of each sample, then over samples


@dataclass
class RewardScalingConfig:
    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0


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


@dataclass
class RewardModelTypeConfig:
    enabled: bool = True
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
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of sections, got {type(data).__name__}")
    parent = data.pop("defaults", None)  # a recipe may inherit from another recipe file
    if parent:
        base = _read_yaml(os.path.join(os.path.dirname(path), parent))
        return OmegaConf.to_container(OmegaConf.merge(base, data))
    return data


def _explain(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or "?"
    msg = str(e).split("\n")[0]
    return f"config key '{key}': {msg}"


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, *, schema: type = None,
                check=None) -> Any:
    """YAML recipe (optional) + dotted overrides -> a validated config: MasterConfig and `validate`, or another
    dataclass `schema` with its own `check(cfg)` (e.g. reward-model training)."""
    schema, check = schema or MasterConfig, check or validate
    try:
        merged = OmegaConf.structured(schema)
        if path:
            merged = OmegaConf.merge(merged, _read_yaml(path))
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override '{item}' must look like key.sub=value")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e)) from None
    check(cfg)
    return cfg


def to_dict(cfg: MasterConfig) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]


def to_yaml(cfg: MasterConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# ----------------------------------------------------------------------------------------------- validation
def _need(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"config key '{key}': {msg}")


def _choice(value: Any, key: str, allowed) -> None:
    _need(value in allowed, key, f"got {value!r}; allowed: {', '.join(map(str, allowed))}")


def world_size(cfg: MasterConfig) -> int:
    """The policy's devices (worker processes on a CPU): the cluster less what the resource plan gives the
    reward model and non-colocated generation (nemo_grpo/distributed/resource_plan.py)."""
    from nemo_grpo.distributed.resource_plan import plan_resources

    return plan_resources(cfg).placements["policy"].world_size


def validate(cfg: MasterConfig, files: bool = True) -> None:
    """Cross-field checks; raises ConfigError naming the key. Runs before anything is built.
    files=False skips checking that model directories and prompt files exist (planning before a download)."""
    _validate_policy(cfg, files)
    _validate_parallel(cfg)
    _validate_batches(cfg)
    _validate_loss(cfg.loss_fn)
    _validate_grpo(cfg)
    _validate_data_env(cfg, files)


def _validate_policy(cfg: MasterConfig, files: bool) -> None:
    from nemo_grpo.backends import BACKENDS

    p = cfg.policy
    _choice(p.backend, "policy.backend", sorted(BACKENDS))
    _choice(p.precision, "policy.precision", ["float32", "bfloat16"])
    _choice(p.optimizer.name, "policy.optimizer.name", ["adamw", "sgd"])
    _need(p.optimizer.lr > 0, "policy.optimizer.lr", f"must be > 0, got {p.optimizer.lr}")
    _need(p.max_grad_norm is None or p.max_grad_norm > 0, "policy.max_grad_norm", "must be > 0 or null")
    if files and not p.model_name.startswith(BUILTIN_MODEL_PREFIX):
        _need(os.path.isdir(p.model_name), "policy.model_name",
              f"'{p.model_name}' is not a local directory (a Hugging Face model directory or builtin:tiny-addition)")
    g = p.generation
    _choice(g.backend, "policy.generation.backend", ["torch", "vllm"])
    _need(g.temperature > 0, "policy.generation.temperature", f"must be > 0, got {g.temperature}")
    _need(0 < g.top_p <= 1, "policy.generation.top_p", f"must be in (0, 1], got {g.top_p}")
    _need(g.top_k is None or g.top_k > 0, "policy.generation.top_k", "must be > 0 or null")
    _need(g.max_new_tokens > 0, "policy.generation.max_new_tokens", "must be > 0")
    _need(g.refit_bucket_size_mb > 0, "policy.generation.refit_bucket_size_mb", "must be > 0")
    _need(g.vllm_cfg.tensor_parallel_size > 0, "policy.generation.vllm_cfg.tensor_parallel_size", "must be > 0")
    _need(0 < g.vllm_cfg.gpu_memory_utilization <= 1, "policy.generation.vllm_cfg.gpu_memory_utilization",
          f"must be in (0, 1], got {g.vllm_cfg.gpu_memory_utilization}")
    for key in ("gpus_per_node", "num_nodes"):  # (on GPUs non-colocated generation needs both: refit.py checks)
        value = getattr(g.colocated.resources, key)
        _need(value is None or value > 0, f"policy.generation.colocated.resources.{key}",
              f"must be > 0 or null, got {value}")
    total = cfg.data.max_input_seq_length + g.max_new_tokens * cfg.grpo.max_rollout_turns
    _need(total <= p.max_total_sequence_length, "policy.max_total_sequence_length",
          f"{p.max_total_sequence_length} < data.max_input_seq_length ({cfg.data.max_input_seq_length}) + "
          f"policy.generation.max_new_tokens ({g.max_new_tokens}) x grpo.max_rollout_turns "
          f"({cfg.grpo.max_rollout_turns}) = {total}")


def _validate_parallel(cfg: MasterConfig) -> None:
    c = cfg.cluster
    _need(c.gpus_per_node > 0, "cluster.gpus_per_node", "must be > 0")
    _need(c.num_nodes > 0, "cluster.num_nodes", "must be > 0")
    _need(c.num_threads_per_worker > 0, "cluster.num_threads_per_worker", "must be > 0")
    _need(c.gpu_memory_gib > 0, "cluster.gpu_memory_gib", f"must be > 0, got {c.gpu_memory_gib}")
    world = world_size(cfg)
    where = f"world size {world} (the policy's devices of cluster.gpus_per_node {c.gpus_per_node} x " \
            f"cluster.num_nodes {c.num_nodes})"
    if cfg.policy.backend == "megatron":
        validate_megatron_layout(cfg.policy, world, where)
        return
    d = cfg.policy.dtensor_cfg
    tp = d.tensor_parallel_size
    _need(tp > 0, "policy.dtensor_cfg.tensor_parallel_size", "must be > 0")
    _need(world % tp == 0, "policy.dtensor_cfg.tensor_parallel_size",
          f"{where} is not divisible by tensor_parallel_size {tp}")
    if d.data_parallel_size is not None:
        _need(d.data_parallel_size * tp == world, "policy.dtensor_cfg.data_parallel_size",
              f"data_parallel_size {d.data_parallel_size} x tensor_parallel_size {tp} = "
              f"{d.data_parallel_size * tp} != {where}")


def validate_megatron_layout(p: PolicyConfig, world: int, where: str = "") -> None:
    """policy.megatron_cfg against the world size (also called by the back end before any actor starts)."""
    m, key, where = p.megatron_cfg, "policy.megatron_cfg.", where or f"world size {world}"
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    _need(tp > 0, key + "tensor_model_parallel_size", "must be > 0")
    _need(pp > 0, key + "pipeline_model_parallel_size", "must be > 0")
    _need(world % (tp * pp) == 0, key + "tensor_model_parallel_size",
          f"tensor_model_parallel_size {tp} x pipeline_model_parallel_size {pp} = {tp * pp} does not divide {where}")
    _need(m.context_parallel_size == 1, key + "context_parallel_size",
          f"got {m.context_parallel_size}; context parallelism is not built yet: only 1 is supported")
    _choice(m.layer_spec, key + "layer_spec", ["local", "transformer_engine"])
    _need(m.layer_spec == "local" or importlib.util.find_spec("transformer_engine") is not None,
          key + "layer_spec", "transformer_engine needs Transformer Engine installed (the gpu extra); use local")


def data_parallel_size(cfg: MasterConfig) -> int:
    if cfg.policy.backend == "megatron":
        m = cfg.policy.megatron_cfg
        return world_size(cfg) // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size)
    return world_size(cfg) // cfg.policy.dtensor_cfg.tensor_parallel_size


def _validate_batches(cfg: MasterConfig) -> None:
    p, g = cfg.policy, cfg.grpo
    dp = data_parallel_size(cfg)
    rollout = g.num_prompts_per_step * g.num_generations_per_prompt
    _need(p.train_global_batch_size > 0 and p.train_micro_batch_size > 0 and p.logprob_batch_size > 0,
          "policy.train_global_batch_size", "batch sizes must be > 0")
    _need(rollout % p.train_global_batch_size == 0, "policy.train_global_batch_size",
          f"{p.train_global_batch_size} does not divide the rollout batch grpo.num_prompts_per_step "
          f"({g.num_prompts_per_step}) x grpo.num_generations_per_prompt ({g.num_generations_per_prompt}) = {rollout}")
    per_rank = p.train_global_batch_size // dp
    _need(p.train_global_batch_size % dp == 0, "policy.train_global_batch_size",
          f"{p.train_global_batch_size} is not divisible by the data-parallel size {dp}")
    _need(per_rank % p.train_micro_batch_size == 0, "policy.train_micro_batch_size",
          f"{p.train_micro_batch_size} does not divide the per-rank batch train_global_batch_size / "
          f"data-parallel size = {p.train_global_batch_size} / {dp} = {per_rank}")


def _validate_loss(l: LossConfig) -> None:
    _choice(l.reference_policy_kl_type, "loss_fn.reference_policy_kl_type", ["k1", "k2", "k3"])
    _need(l.reference_policy_kl_penalty >= 0, "loss_fn.reference_policy_kl_penalty", "must be >= 0")
    _need(0 <= l.ratio_clip_min < 1, "loss_fn.ratio_clip_min", f"must be in [0, 1), got {l.ratio_clip_min}")
    _need(l.ratio_clip_max >= 0, "loss_fn.ratio_clip_max", f"must be >= 0, got {l.ratio_clip_max}")
    _need(l.ratio_clip_c is None or l.ratio_clip_c > 1, "loss_fn.ratio_clip_c",
          f"dual-clip constant must be > 1 (usually 3) or null, got {l.ratio_clip_c}")
    _need(l.truncated_importance_sampling_ratio is None or l.truncated_importance_sampling_ratio > 0,
          "loss_fn.truncated_importance_sampling_ratio", "must be > 0 or null")
    _need(l.truncated_importance_sampling_ratio is None or l.use_importance_sampling_correction,
          "loss_fn.truncated_importance_sampling_ratio", "needs loss_fn.use_importance_sampling_correction=true")


def _validate_grpo(cfg: MasterConfig) -> None:
    g = cfg.grpo
    _need(g.num_prompts_per_step > 0, "grpo.num_prompts_per_step", "must be > 0")
    _need(g.num_generations_per_prompt > 0, "grpo.num_generations_per_prompt", "must be > 0")
    _need(not g.use_leave_one_out_baseline or g.num_generations_per_prompt >= 2, "grpo.use_leave_one_out_baseline",
          "needs grpo.num_generations_per_prompt >= 2")
    _need(g.max_num_steps > 0, "grpo.max_num_steps", "must be > 0")
    _need(g.max_rollout_turns >= 1, "grpo.max_rollout_turns", "must be >= 1")
    _need(g.val_period >= 0, "grpo.val_period", "must be >= 0 (0 disables)")
    _need(g.dynamic_sampling_max_gen_batches >= 1, "grpo.dynamic_sampling_max_gen_batches", "must be >= 1")
    _need(g.batch_multiplier >= 1, "grpo.batch_multiplier", "must be >= 1")
    r = g.reward_scaling
    _need(r.source_max > r.source_min, "grpo.reward_scaling.source_max", "must be > source_min")
    ck = cfg.checkpointing
    _need(ck.save_period > 0, "checkpointing.save_period", "must be > 0")
    _need(ck.keep_top_k is None or ck.keep_top_k > 0, "checkpointing.keep_top_k", "must be > 0 or null")


def _validate_data_env(cfg: MasterConfig, files: bool) -> None:
    from nemo_grpo.envs import ENVIRONMENTS

    d = cfg.data
    _need(d.max_input_seq_length > 0, "data.max_input_seq_length", "must be > 0")
    for split in ("train", "validation"):
        ds: Optional[DatasetConfig] = getattr(d, split)
        if ds is None:
            continue
        _choice(ds.env_name, f"data.{split}.env_name", sorted(ENVIRONMENTS))
        _need(getattr(cfg.env, ds.env_name, None) is not None, f"env.{ds.env_name}",
              f"data.{split}.env_name is '{ds.env_name}' but env.{ds.env_name} is null")
        for key in ("prompt_file", "system_prompt_file"):
            path = getattr(ds, key)
            _need(path is None or not files or os.path.isfile(path), f"data.{split}.{key}", f"file not found: {path}")
    if cfg.env.reward_model is not None and cfg.env.reward_model.enabled:
        from nemo_grpo.distributed.resource_plan import plan_resources

        _validate_reward_model(cfg.env.reward_model, plan_resources(cfg).placements["reward_model"].world_size,
                               files)
    if cfg.env.code is not None:
        c = cfg.env.code
        _need(c.num_workers > 0, "env.code.num_workers", "must be > 0")
        _choice(c.reward_mode, "env.code.reward_mode", ["fraction", "all_or_nothing"])
        _need(c.timeout_s > 0 and c.cpu_s > 0 and c.memory_mb > 0, "env.code.timeout_s",
              "timeout_s, cpu_s and memory_mb must be > 0")
    if cfg.env.math is not None:
        _need(cfg.env.math.num_workers > 0, "env.math.num_workers", "must be > 0")
        _need(cfg.env.math.timeout_s > 0, "env.math.timeout_s", "must be > 0")


def _validate_reward_model(r: RewardModelEnvConfig, world: int, files: bool = True) -> None:
    """env.reward_model on its `world` devices of the resource plan."""
    from nemo_grpo.backends import BACKENDS

    key = "env.reward_model."
    _need(not files or os.path.isdir(r.model_name), key + "model_name",
          f"'{r.model_name}' is not a local directory (a Hugging Face *ForSequenceClassification model)")
    _choice(r.backend, key + "backend", sorted(BACKENDS))
    _choice(r.precision, key + "precision", ["float32", "bfloat16"])
    _choice(r.reward_model_cfg.reward_model_type, key + "reward_model_cfg.reward_model_type", ["bradley_terry"])
    _need(r.batch_size > 0, key + "batch_size", "must be > 0")
    _need(r.max_model_len > 0, key + "max_model_len", "must be > 0")
    if r.backend == "megatron":
        m = r.megatron_cfg
        _need(world % (m.tensor_model_parallel_size * m.pipeline_model_parallel_size) == 0,
              key + "megatron_cfg.tensor_model_parallel_size",
              f"tensor_model_parallel_size {m.tensor_model_parallel_size} x pipeline_model_parallel_size "
              f"{m.pipeline_model_parallel_size} does not divide the reward model's {world} devices")
    else:
        tp = r.dtensor_cfg.tensor_parallel_size
        _need(tp > 0 and world % tp == 0, key + "dtensor_cfg.tensor_parallel_size",
              f"{tp} does not divide the reward model's {world} devices (env.reward_model.resources)")

