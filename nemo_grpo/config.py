"""Typed configuration: the dataclass schema, YAML recipes and dotted command-line overrides (the ground floor).

A recipe is YAML data merged onto the schema below with OmegaConf, so an unknown key or a value of the
wrong type is rejected with the full dotted key (`read_config`). Cross-field rules (batch divisibility,
parallel layout, resources, files) live one floor up in nemo_grpo/validation.py, which also has the
validated loaders the entry points use. Every error is a `ConfigError` whose message names the key and what is
allowed. Key names follow NeMo RL's GRPO guide so its users recognise them. The policy section's dataclasses
live in nemo_grpo/config_policy.py (re-exported here); docs/config_reference.md lists every key with its field's
comment (python -m nemo_grpo.config_reference), so every field carries a one-line comment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# policy.*: re-exported, so `from nemo_grpo.config import PolicyConfig` (or any of its sections) keeps working
from nemo_grpo.config_policy import (  # noqa: F401
    OptimizerConfig, RouterLossConfig, DTensorConfig, DistributedDataParallelConfig, MegatronConfig,
    ResourcesConfig, ColocatedConfig, VllmConfig, GenerationConfig, DynamicBatchingConfig,
    SequencePackingConfig, TokenizerConfig, LoraConfig, PolicyConfig)
from nemo_grpo.errors import ConfigError  # noqa: F401  (re-exported: the config's own error)

BUILTIN_MODEL_PREFIX = "builtin:"


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
    # tis | icepop | seq-mask-tis (null: tis if a ratio is set)
    truncated_importance_sampling_type: Optional[str] = None
    truncated_importance_sampling_ratio: Optional[float] = None  # upper bound of the IS weight
    truncated_importance_sampling_ratio_min: Optional[float] = None  # lower bound (icepop, seq-mask-tis; tis: 0)
    token_level_loss: bool = True  # false: mean over tokens of each sample, then over samples
    # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm (Dr.GRPO); null: from token_level_loss
    loss_aggregation: Optional[str] = None


@dataclass
class RewardScalingConfig:
    """grpo.reward_scaling: rewards clamped to [source_min, source_max], then mapped linearly onto [target_min,
    target_max], before reward shaping and dynamic sampling (algorithms/advantages.py scale_rewards)."""
    enabled: bool = False  # scale the rewards (false: they pass unchanged)
    source_min: float = 0.0  # lower end of the rewards' range (lower rewards are clamped to it)
    source_max: float = 1.0  # upper end of the rewards' range (must be > source_min)
    target_min: float = 0.0  # what source_min maps to
    target_max: float = 1.0  # what source_max maps to


@dataclass
class RewardShapingConfig:
    """grpo.reward_shaping: DAPO's soft overlong penalty, and a penalty for samples that never stop."""
    enabled: bool = False  # apply the penalties set below (overlong_buffer_length or stop_properly_penalty_coef)
    # DAPO: past max_response_length - overlong_buffer_length tokens, the reward falls linearly, by
    # overlong_buffer_penalty at max_response_length (and further beyond it)
    overlong_buffer_length: Optional[int] = None
    overlong_buffer_penalty: Optional[float] = None  # the reward taken off at max_response_length (>= 0)
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
    # on: needs policy.generation.colocated.enabled=false and loss_fn.use_importance_sampling_correction=true
    enabled: bool = False
    max_trajectory_age_steps: int = 1  # rollouts train at most this many optimizer steps after their weights
    in_flight_weight_updates: bool = False  # new weights reach the engine between two forward steps of a batch


@dataclass
class GRPOConfig:
    """grpo: the GRPO loop (algorithms/grpo.py): steps, groups, advantages, dynamic sampling, validation."""
    num_prompts_per_step: int = 16  # prompts drawn per step
    num_generations_per_prompt: int = 8  # samples per prompt: one group, whose rewards give the advantages
    max_rollout_turns: int = 1  # turns per sample with a multi-turn environment (1: single turn)
    max_num_epochs: int = 1000  # stop once the training prompts have been seen this many times
    max_num_steps: int = 400  # steps to train (each: generate a rollout batch, then train on it)
    normalize_rewards: bool = True  # divide advantages by the group's reward std
    use_leave_one_out_baseline: bool = False  # baseline: mean of the group's other samples (RLOO), not the group mean
    val_period: int = 50  # 0 disables periodic validation
    val_at_start: bool = True  # validate before the first step (not when resuming past step 0)
    val_at_end: bool = True  # validate after the last step
    val_batch_size: int = 100  # prompts per validation generation call
    max_val_samples: int = 100  # validation prompts used: the first N of the validation set (0: none)
    seed: int = 42  # seeds the prompt order, every step's sampling and the weights' initialisation
    overlong_filtering: bool = False  # truncated samples (no EOS) are excluded from the loss
    use_dynamic_sampling: bool = False  # DAPO: keep only groups whose rewards differ
    dynamic_sampling_max_gen_batches: int = 10  # generation batches per step at most before the run fails
    batch_multiplier: float = 1.0  # prompts drawn per generation batch under dynamic sampling
    reward_scaling: RewardScalingConfig = field(default_factory=RewardScalingConfig)
    reward_shaping: RewardShapingConfig = field(default_factory=RewardShapingConfig)
    adv_estimator: AdvEstimatorConfig = field(default_factory=AdvEstimatorConfig)
    advantage_clip_low: Optional[float] = None  # advantages clamped to [low, high] after the estimator
    advantage_clip_high: Optional[float] = None  # upper bound of that clamp (>= 0; null: unbounded)
    async_grpo: AsyncGRPOConfig = field(default_factory=AsyncGRPOConfig)
    # true: always run the separate old-log-prob pass; false: skip it when the step is exactly on-policy (one
    # optimizer step per rollout batch, algorithms/on_policy.py) and take the training forward's log-probs
    recompute_old_logprobs: bool = False


# ----------------------------------------------------------------------------------------------- env / data
@dataclass
class MathEnvConfig:
    """env.math: the answer parsed from the response and checked against the reference (envs/math_env.py)."""
    num_workers: int = 2  # verifier processes
    timeout_s: float = 5.0  # per-sample parsing / verification budget
    max_answer_chars: int = 2048  # only the tail of a response is parsed
    # the answers math-verify cannot parse (no answer found in the response's tail, or an unparsable reference) get
    # env.llm_judge's verdict (mode equivalence) as their reward; the others keep math-verify's
    judge_fallback: bool = False
    # with judge_fallback: this fraction of the answers math-verify did decide is asked to the judge as well (chosen by
    # a hash of the answer and the reference: the same each run), only to measure their agreement (math/judge_agreement)
    judge_agreement_fraction: float = 0.1


@dataclass
class CodeEnvConfig:
    """env.code: model-written Python run in the sandbox (nemo_grpo/envs/sandbox.py) against test cases."""
    num_workers: int = 2  # sandbox worker actors (each runs one program at a time)
    terminate_on_evaluation: bool = True  # false: multi-turn (code blocks run, output returned)
    reward_mode: str = "fraction"  # fraction of the cases passed | all_or_nothing
    timeout_s: float = 5.0  # wall clock per run
    cpu_s: int = 5  # CPU seconds per run (RLIMIT_CPU)
    memory_mb: int = 512  # address space per run, MiB (RLIMIT_AS)
    max_output_bytes: int = 65536  # stdout / stderr read up to this each; a run that writes more is killed
    # identical programs of one step (same code, cases and answer, or same code in a multi-turn run) run once
    # and share the result; false runs every copy (a program that reads time or randomness gets its own draw)
    run_identical_once: bool = True


@dataclass
class RewardModelTypeConfig:
    """reward_model_cfg (NeMo RL's keys): the kind of reward model."""
    enabled: bool = True  # NeMo RL's switch; false turns the reward model off like env.reward_model.enabled
    reward_model_type: str = "bradley_terry"  # a scalar head over the last real token (the only type so far)


@dataclass
class RewardModelEnvConfig:
    """env.reward_model: rewards from a sequence classifier (HF *ForSequenceClassification, num_labels=1)."""
    enabled: bool = True  # false: no reward model (it runs only with reward_model_cfg.enabled as well)
    model_name: str = ""  # local HF directory of the reward model
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # name null = model_name
    precision: str = "auto"  # auto | float32 | bfloat16, as policy.precision
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
class JudgeGenerationConfig:
    """env.llm_judge.generation: how the judge decodes (the in-cluster judge's engine, or each HTTP request)."""
    backend: str = "vllm"  # in the cluster: vllm | torch (vllm falls back to torch, with a notice, where not installed)
    max_new_tokens: int = 512  # tokens per judge reply at most
    # the sampling temperature (> 0) of retries, and of first attempts with env.llm_judge.greedy=false
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling of sampled attempts; 1: off
    top_k: Optional[int] = None  # in the cluster: sampled attempts draw among the k most likely tokens; null: off
    stop_strings: Optional[list[str]] = None  # a reply stops after any of these (over HTTP: the request's stop)
    # in the cluster, the vLLM engine: tensor_parallel_size (devices per replica), gpu_memory_utilization,
    # max_model_len (also the torch engine's context; null: the model's max_position_embeddings), precision (null:
    # auto)
    vllm_cfg: VllmConfig = field(default_factory=VllmConfig)

    def engine_config(self) -> GenerationConfig:
        """The GenerationConfig the judge's engine is made with (generation/__init__.py make_generation_engine)."""
        return GenerationConfig(backend=self.backend, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                top_p=self.top_p, top_k=self.top_k, stop_strings=self.stop_strings,
                                vllm_cfg=self.vllm_cfg)


@dataclass
class LlmJudgeConfig:
    """env.llm_judge: rewards from a judge model's replies (envs/llm_judge_env.py; NeMo Gym's key names where it has
    them): pointwise scores, pairwise comparisons within a prompt's group, or answer equivalence. The judge runs in
    the cluster (model_name: our own engine, frozen) or behind an OpenAI-compatible URL (base_url and model)."""
    mode: str = "pointwise"  # pointwise | pairwise | equivalence
    # a text file, the judge's user message: {response} (pointwise, equivalence), {response_1} and {response_2}
    # (pairwise), {reference} (equivalence; pointwise optional: env_info ground_truth), {prompt} (optional: the
    # prompt's last user message); {{name}} is the literal text {name}, other braces are literal
    judge_prompt_template_fpath: Optional[str] = None
    judge_system_message: Optional[str] = None  # a system message before the template's; null: none
    # a regex whose last match in a reply is its number (its first group, if it has one); null: the last
    # \boxed{...} holding a number. Pairwise: 1 = response_1 is better, 2 = response_2, 0 = a tie
    score_regex: Optional[str] = None
    # pointwise: words the judge answers with, and the score each stands for (e.g. {negative: 10, positive: 0});
    # the label ending last in the reply (case ignored) is its score. A small judge that never writes a number
    # still names a label. Null: the reply's number (score_regex)
    score_labels: Optional[dict[str, float]] = None
    score_min: float = 0.0  # pointwise: the judge's lowest score, reward 0 (scores outside are clamped)
    score_max: float = 10.0  # pointwise: the judge's highest score, reward 1
    comparison_strategy: str = "circular"  # pairwise: circular (G comparisons, i with i+1) | all_pairs (G(G-1)/2)
    # pairwise: each comparison asked in both orders; equivalence: an "equal" verdict asked again with response
    # and reference swapped, equal only if both say so
    check_twice_swap: bool = True
    judge_equal_label: str = "[[A=B]]"  # equivalence: the judge's verdict that the answers are equivalent
    judge_not_equal_label: str = "[[A!=B]]"  # equivalence: the verdict that they are not
    # a reply that does not parse is asked again, sampled with a new seed, up to this many times
    parse_retries: int = 2
    # the reward of a judgment that never parsed (pointwise, equivalence: the sample's; pairwise: both sides'
    # points for that comparison order). NeMo Gym genrm_compare's 3.0 on its 1-5 scale (neutral) is 0.5 here
    default_score: float = 0.0
    greedy: bool = True  # the first attempt decodes greedily; retries sample at generation.temperature
    # in the cluster: the judge's local HF directory (null: over HTTP, base_url)
    model_name: Optional[str] = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)  # name null = model_name
    # decoding: greedy first attempts (greedy), sampled retries (temperature), reply length, the engine's vLLM keys
    generation: JudgeGenerationConfig = field(default_factory=JudgeGenerationConfig)
    # in the cluster: the judge's own devices (worker processes on a CPU); see distributed/resource_plan.py
    resources: ResourcesConfig = field(default_factory=lambda: ResourcesConfig(gpus_per_node=1, num_nodes=1))
    base_url: Optional[str] = None  # over HTTP: an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1
    model: Optional[str] = None  # over HTTP: the served model's name
    api_key_env: Optional[str] = None  # over HTTP: the environment variable holding the API key; null: no key
    judge_endpoint_max_concurrency: int = 8  # over HTTP: requests in flight at most
    timeout_s: float = 60.0  # over HTTP: seconds per request
    max_retries: int = 3  # over HTTP: a failed request is sent again this many times, with exponential backoff

    @property
    def in_cluster(self) -> bool:
        """The judge is our own engine on devices of its own (not a URL)."""
        return self.model_name is not None


@dataclass
class EnvConfig:
    """env: the environments that score samples, by name (a data set's env_name); null: not configured."""
    math: Optional[MathEnvConfig] = field(default_factory=MathEnvConfig)
    reward_model: Optional[RewardModelEnvConfig] = None
    code: Optional[CodeEnvConfig] = None
    llm_judge: Optional[LlmJudgeConfig] = None


@dataclass
class DatasetConfig:
    """A data set of prompts and reference answers, and the environment that scores its samples."""
    # a built-in data set (addition | arithmetic_code), or ResponseDataset: the JSONL file or HF data set in data_path
    dataset_name: str = "addition"
    data_path: Optional[str] = None  # JSONL path (or HF name) for dataset_name=ResponseDataset
    input_key: str = "input"  # the problem's key in each row (JSONL field / HF column)
    output_key: str = "output"  # the reference answer's key in each row
    subset: Optional[str] = None  # HF datasets only
    split: str = "train"  # HF datasets only: the split to load
    prompt_file: Optional[str] = None  # a Python format string with {} for the problem text
    system_prompt_file: Optional[str] = None  # a text file whose content is the system message
    env_name: str = "math"  # the environment (env.<name>) that scores this data set's samples


@dataclass
class DataConfig:
    """data: the training and validation data sets."""
    max_input_seq_length: int = 8  # longer prompts are dropped (counted in the log)
    shuffle: bool = True  # reshuffle the training prompts every epoch (seeded by grpo.seed)
    train: DatasetConfig = field(default_factory=DatasetConfig)
    validation: Optional[DatasetConfig] = field(default_factory=DatasetConfig)


# ----------------------------------------------------------------------------------------------- run
@dataclass
class ClusterConfig:
    """cluster: the devices of the run (a Ray cluster of exactly num_nodes nodes)."""
    gpus_per_node: int = 2  # on a CPU-only machine: worker processes standing in for devices
    num_nodes: int = 1  # nodes of the run (each with gpus_per_node devices)
    num_threads_per_worker: int = 1  # torch threads in each actor (pinned: busy processes collide otherwise)
    gpu_memory_gib: float = 79.6  # per device, for `python -m nemo_grpo.plan` (an 80 GB H100 / A100 has 79.6)


@dataclass
class CheckpointingConfig:
    """checkpointing: step_<N>/ directories with top-k retention (utils/checkpoint.py)."""
    enabled: bool = True  # save every save_period steps and at the last one
    checkpoint_dir: str = "results/grpo_tiny"  # where step_<N>/ go (on a cluster: a directory every node sees)
    metric_name: Optional[str] = "val:accuracy"  # ranks checkpoints for keep_top_k; null keeps the newest
    higher_is_better: bool = True  # metric_name ranks higher values first
    keep_top_k: Optional[int] = 3  # checkpoints kept: the best k by metric_name, plus the newest; null: all
    save_period: int = 100  # save every this many steps
    resume: bool = True  # continue from the latest checkpoint in checkpoint_dir if there is one


@dataclass
class WandbConfig:
    """logger.wandb: the Weights & Biases run (with logger.wandb_enabled)."""
    project: str = "nemo-grpo"  # W&B project
    name: Optional[str] = None  # W&B run name; null: W&B picks one


@dataclass
class MLflowConfig:
    """logger.mlflow: the MLflow run (with logger.mlflow_enabled)."""
    experiment_name: str = "nemo-grpo"  # MLflow experiment
    run_name: Optional[str] = None  # MLflow run name; null: MLflow picks one
    tracking_uri: Optional[str] = None  # MLflow tracking server; null: MLflow's default


@dataclass
class LoggerConfig:
    """logger: metrics to metrics.jsonl and the enabled back ends, a progress bar and a plot."""
    log_dir: str = "logs/grpo_tiny"  # metrics.jsonl, TensorBoard events and the plot go here
    tensorboard_enabled: bool = True  # TensorBoard events under <log_dir>/tensorboard
    wandb_enabled: bool = False  # log to Weights & Biases too (needs the wandb package)
    mlflow_enabled: bool = False  # log to MLflow too (needs the mlflow package)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    progress_bar: bool = True  # a tqdm bar over the steps; false: one log line per step
    plot: bool = True  # PNG of reward and validation accuracy per step, next to the logs
    num_val_samples_to_print: int = 0  # validation generations logged as text at each validation


@dataclass
class MasterConfig:
    """python -m nemo_grpo.train: a GRPO run (policy, loss, loop, environments, data, devices, checkpoints, logs)."""
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
    """data: the preference pairs (chosen, rejected) a reward model trains and validates on."""
    train_data_path: str = ""  # JSONL of preference pairs, or builtin:addition (generated, seed 0)
    val_data_path: Optional[str] = None  # (builtin:addition: other wrong answers, seed 1)
    max_seq_length: int = 256  # longer conversations keep their last tokens


@dataclass
class RMLoopConfig:
    """rm: the reward-model training loop (algorithms/reward_model.py)."""
    max_num_steps: int = 100  # optimizer steps of policy.train_global_batch_size rows (= half as many pairs)
    val_period: int = 10  # 0: validate only at the end
    seed: int = 42  # seeds the score head's initialisation and the pairs' order
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
    progress_bar: bool = True  # a tqdm bar over the generation calls


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


