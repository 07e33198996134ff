"""Cross-field validation of a run's config, and the validated loaders the entry points use.

It sits above the rooms it consults (the back-end and environment registries, the resource plan, the
parallel layout), so config.py below stays schema and loading only. Every rule raises a ConfigError naming
the key, before anything is built:

    cfg = load_config("configs/grpo_tiny_cpu.yaml", ["grpo.max_num_steps=50"])   # MasterConfig, validated
    cfg = load_config(path, overrides, files=False)          # planning before models or data are downloaded
    cfg = load_rm_train_config(path, overrides)              # RMTrainConfig (python -m nemo_grpo.train_rm)
    cfg = load_eval_config(path, overrides)                  # EvalMasterConfig (python -m nemo_grpo.eval)

The entry points import this module before they parse a config, so it imports transformers (and models.builtin,
which imports it) inside the checks that need them, not at the top.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Optional

from nemo_grpo.algorithms.advantages import ESTIMATORS
from nemo_grpo.algorithms.losses import LOSSES, check_loss_config
from nemo_grpo.backends.batching import PACKING_ALGORITHMS
from nemo_grpo.backends.registry import all_specs, backend_names, backend_spec, check_degrees, policy_layout
from nemo_grpo.backends.router import validate_router_losses
from nemo_grpo.config import (BUILTIN_MODEL_PREFIX, DatasetConfig, EnvConfig, EvalMasterConfig, LlmJudgeConfig,
                              MasterConfig, PolicyConfig, RewardModelEnvConfig, RMEvalConfig, RMTrainConfig,
                              read_config)
from nemo_grpo.distributed.resource_plan import plan_resources
from nemo_grpo.envs import ENVIRONMENTS
from nemo_grpo.envs.judging import MODES, STRATEGIES, template_problem
from nemo_grpo.errors import ConfigError
from nemo_grpo.errors import require as _need
from nemo_grpo.errors import require_choice as _choice
from nemo_grpo.layout import ParallelLayout
from nemo_grpo.models.files import check_model_dir
from nemo_grpo.models.lora import validate_lora
from nemo_grpo.precision import PRECISIONS
from nemo_grpo.utils.checkpoint import CONFIG_YAML, FINAL_PREFIX, POLICY_DIR, TRAINING_INFO, checkpoint_problem

PACKED_ATTENTION = ["varlen", "mask"]
log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------- loaders
def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None, files: bool = True) -> MasterConfig:
    """A GRPO run's config: recipe + overrides, typed and validated. files=False skips checking that model
    directories and prompt files exist (planning before a download)."""
    cfg = read_config(path, overrides)
    validate(cfg, files)
    return cfg


def load_rm_train_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> RMTrainConfig:
    cfg = read_config(path, overrides, schema=RMTrainConfig)
    validate_rm_train(cfg)
    return cfg


def load_rm_eval_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> RMEvalConfig:
    cfg = read_config(path, overrides, schema=RMEvalConfig)
    _need(bool(cfg.data_path), "data_path", "is required: a JSONL of preference pairs, or builtin:addition")
    _need_data_file(cfg.data_path, "data_path")
    r = cfg.reward_model.resources
    world = (r.gpus_per_node or 1) * (r.num_nodes or 1)
    _validate_reward_model(cfg.reward_model, world, files=True, prefix="reward_model")
    return cfg


# ----------------------------------------------------------------------------------------------- small rules
def _positive(value, key: str, nullable: bool = False) -> None:
    _need((nullable and value is None) or (value is not None and value > 0), key,
          f"must be > 0{' or null' if nullable else ''}, got {value}")


def _need_model_dir(path: str, key: str, what: str) -> None:
    if path.startswith(BUILTIN_MODEL_PREFIX):
        from nemo_grpo.models.builtin import builtin_name  # here: it imports transformers (see the module's note)

        builtin_name(path, key)
        return
    _need(os.path.isdir(path), key, f"'{path}' is not a local directory ({what})")
    check_model_dir(path, key)


def _need_data_file(path: Optional[str], key: str) -> None:
    _need(path is None or path.startswith(BUILTIN_MODEL_PREFIX) or os.path.isfile(path), key,
          f"file not found: '{path}'")


# ----------------------------------------------------------------------------------------------- GRPO runs
def world_size(cfg: MasterConfig) -> int:
    """The policy's devices (worker processes on a CPU): the cluster less what the resource plan gives the
    reward model and non-colocated generation (nemo_grpo/distributed/resource_plan.py)."""
    return plan_resources(cfg).placements["policy"].world_size


def layout_of(cfg: MasterConfig) -> ParallelLayout:
    """The policy's parallel layout on its share of the resource plan (ConfigError naming the key)."""
    c = cfg.cluster
    world = world_size(cfg)
    return policy_layout(cfg.policy, world, where=f"world size {world} (the policy's devices of "
                         f"cluster.gpus_per_node {c.gpus_per_node} x cluster.num_nodes {c.num_nodes})")


def data_parallel_size(cfg: MasterConfig) -> int:
    return layout_of(cfg).dp


def validate(cfg: MasterConfig, files: bool = True) -> None:
    """Cross-field checks; raises ConfigError naming the key. Runs before anything is built."""
    _validate_grpo(cfg)
    _validate_cluster(cfg)
    validate_policy(cfg.policy, files)
    total = cfg.data.max_input_seq_length + cfg.policy.generation.max_new_tokens * cfg.grpo.max_rollout_turns
    _need(total <= cfg.policy.max_total_sequence_length, "policy.max_total_sequence_length",
          f"{cfg.policy.max_total_sequence_length} < data.max_input_seq_length ({cfg.data.max_input_seq_length}) "
          f"+ policy.generation.max_new_tokens ({cfg.policy.generation.max_new_tokens}) x "
          f"grpo.max_rollout_turns ({cfg.grpo.max_rollout_turns}) = {total}")
    _validate_generation(cfg.policy.generation)
    _validate_batches(cfg, layout_of(cfg))
    _validate_loss(cfg)
    _validate_data_env(cfg, files)


def validate_policy(p: PolicyConfig, files: bool, prefix: str = "policy", scalar_head: bool = False,
                    width: Optional[tuple[str, int]] = None) -> None:
    """The policy section's own values (not its layout, which needs the world size); scalar_head: a reward
    model's; width: (key, value) of the longest row, if not `<prefix>.max_total_sequence_length`."""
    _choice(p.backend, f"{prefix}.backend", backend_names())
    _choice(p.precision, f"{prefix}.precision", PRECISIONS)
    _choice(p.optimizer.name, f"{prefix}.optimizer.name", ["adamw", "sgd"])
    _positive(p.optimizer.lr, f"{prefix}.optimizer.lr")
    _need(p.optimizer.warmup_steps >= 0, f"{prefix}.optimizer.warmup_steps", "must be >= 0")
    _positive(p.max_grad_norm, f"{prefix}.max_grad_norm", nullable=True)
    for key in ("train_global_batch_size", "train_micro_batch_size", "logprob_batch_size",
                "max_total_sequence_length"):
        _positive(getattr(p, key), f"{prefix}.{key}")
    if files:
        _need_model_dir(p.model_name, f"{prefix}.model_name", "a Hugging Face model directory or builtin:tiny-addition")
    check_degrees(p, prefix)
    _validate_dynamic_batching(p, prefix)
    _validate_sequence_packing(p, prefix)
    validate_lora(p.lora, scalar_head, prefix)
    validate_router_losses(p, prefix)
    _validate_context_parallel(p, prefix, width or (f"{prefix}.max_total_sequence_length",
                                                    p.max_total_sequence_length))
    for spec in all_specs():  # each back end's section, in use or not
        spec.validate(p, prefix)


def _validate_context_parallel(p: PolicyConfig, prefix: str, width: tuple[str, int]) -> None:
    """With context_parallel_size CP > 1 every row is cut into 2 x CP chunks (rank r holds chunks r and 2CP-1-r),
    each chunk split again over the TP ranks by sequence parallelism: the longest row (width: its key
    and value) and, with sequence packing or dynamic batching, the token budgets and sequence_length_round
    (filled in first by derive_token_budgets) must be multiples of that; then the back end's own CP rules."""
    spec = backend_spec(p.backend)
    cp = spec.degree(p, "cp")
    if cp == 1:
        return
    unit, why = 2 * cp, f"2 x {spec.key(prefix, spec.degree_keys['cp'])} {cp}"
    chunks = "context parallelism cuts every row into 2 x context_parallel_size equal chunks"
    split, split_why = spec.sequence_split(p)  # ranks that split each chunk again (sequence parallelism over tp)
    if split > 1:
        unit, why = unit * split, why + split_why
        chunks += ", each split over the tensor-parallel ranks by sequence parallelism"
    _need(width[1] % unit == 0, width[0], f"{width[1]} is not a multiple of {why} = {unit}: {chunks}")
    for section_name in ("sequence_packing", "dynamic_batching"):
        budgets = getattr(p, section_name)
        if budgets.enabled:
            for name in ("train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"):
                value = getattr(budgets, name)
                _need(value % unit == 0, f"{prefix}.{section_name}.{name}",
                      f"{value} is not a multiple of {why} = {unit}: {chunks}")
    spec.validate_context_parallel(p, prefix, cp)


def derive_token_budgets(p: PolicyConfig, section, key: str) -> None:
    """An unset train_mb_tokens / logprob_mb_tokens of policy.dynamic_batching or policy.sequence_packing (`key`,
    e.g. "policy.sequence_packing.") becomes what a fixed micro-batch may hold at worst: train_micro_batch_size
    (logprob_batch_size) x max_total_sequence_length; logged, so that switching either on is one key."""
    width = p.max_total_sequence_length
    for name, rows_key in (("train_mb_tokens", "train_micro_batch_size"), ("logprob_mb_tokens", "logprob_batch_size")):
        rows = getattr(p, rows_key)
        if getattr(section, name) is None:
            setattr(section, name, rows * width)
            log.info(f"{key}{name} not set: {rows * width} ({rows_key} {rows} x max_total_sequence_length {width})")


def _validate_token_budgets(section, key: str) -> None:
    """The budgets shared by policy.dynamic_batching and policy.sequence_packing are positive."""
    for name in ("train_mb_tokens", "logprob_mb_tokens", "sequence_length_round"):
        _positive(getattr(section, name), key + name)


def _validate_dynamic_batching(p: PolicyConfig, prefix: str) -> None:
    db, key = p.dynamic_batching, f"{prefix}.dynamic_batching."
    if not db.enabled:
        return
    derive_token_budgets(p, db, key)
    _validate_token_budgets(db, key)
    spec = backend_spec(p.backend)
    pp = spec.degree(p, "pp")
    pp_key = spec.key("policy", spec.degree_keys.get("pp", ""))  # pp is 1 where the back end has no pipeline
    _need(pp == 1, key + "enabled", f"not with pipeline parallelism yet ({pp_key}={pp}): the pipeline schedule "
          "needs micro-batches of equal shape; set one of them off")


def _validate_sequence_packing(p: PolicyConfig, prefix: str) -> None:
    sp, key = p.sequence_packing, f"{prefix}.sequence_packing."
    if not sp.enabled:
        return
    derive_token_budgets(p, sp, key)
    _validate_token_budgets(sp, key)
    _choice(sp.algorithm, key + "algorithm", sorted(PACKING_ALGORITHMS))
    _choice(sp.attention, key + "attention", PACKED_ATTENTION)
    _need(not p.dynamic_batching.enabled, key + "enabled",
          f"and {prefix}.dynamic_batching.enabled are both on; packing already groups rows by a token budget: "
          "set one of them off")


def validate_model_layout(p: PolicyConfig, model_path: str, prefix: str = "policy") -> None:
    """The model on the back end's layout (its sizes split over tp and pp, what the back end builds of it: its
    BackendSpec.validate_model), checked from its config.json before any worker starts; a ConfigError names the
    key and the sizes."""
    from transformers import AutoConfig  # here: ~1 s to import (see the module's note)

    try:
        hf = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as e:  # transformers' "Unrecognized model in ...", a config it cannot parse
        first = (str(e).strip().splitlines() or [""])[0]
        raise ConfigError(f"config key '{prefix}.model_name': {model_path} has no config transformers can read: "
                          f"{first}") from None
    backend_spec(p.backend).validate_model(p, hf, model_path, prefix)


def _validate_generation(g, greedy_ok: bool = False) -> None:
    """greedy_ok: temperature 0 means greedy decoding (evaluation); training samples need temperature > 0."""
    key = "policy.generation."
    _choice(g.backend, key + "backend", ["torch", "vllm"])
    _need(g.temperature > 0 or (greedy_ok and g.temperature == 0), key + "temperature",
          f"must be > 0{' (or 0: greedy)' if greedy_ok else ''}, got {g.temperature}")
    _need(0 < g.top_p <= 1, key + "top_p", f"must be in (0, 1], got {g.top_p}")
    _positive(g.top_k, key + "top_k", nullable=True)
    _positive(g.max_new_tokens, key + "max_new_tokens")
    _positive(g.refit_bucket_size_mb, key + "refit_bucket_size_mb")
    _positive(g.vllm_cfg.tensor_parallel_size, key + "vllm_cfg.tensor_parallel_size")
    if g.vllm_cfg.precision is not None:
        _choice(g.vllm_cfg.precision, key + "vllm_cfg.precision", PRECISIONS)
    _need(0 < g.vllm_cfg.gpu_memory_utilization <= 1, key + "vllm_cfg.gpu_memory_utilization",
          f"must be in (0, 1], got {g.vllm_cfg.gpu_memory_utilization}")
    for name in ("gpus_per_node", "num_nodes"):  # (on GPUs non-colocated generation needs both: refit.py checks)
        _positive(getattr(g.colocated.resources, name), f"{key}colocated.resources.{name}", nullable=True)


def _validate_cluster(cfg: MasterConfig) -> None:
    c = cfg.cluster
    for key in ("gpus_per_node", "num_nodes", "num_threads_per_worker", "gpu_memory_gib"):
        _positive(getattr(c, key), f"cluster.{key}")


def _validate_batches(cfg: MasterConfig, layout: ParallelLayout) -> None:
    p, g, dp = cfg.policy, cfg.grpo, layout.dp
    rollout = g.num_prompts_per_step * g.num_generations_per_prompt
    _need(rollout % p.train_global_batch_size == 0, "policy.train_global_batch_size",
          f"{p.train_global_batch_size} does not divide the rollout batch grpo.num_prompts_per_step "
          f"({g.num_prompts_per_step}) x grpo.num_generations_per_prompt ({g.num_generations_per_prompt}) = {rollout}")
    per_rank = p.train_global_batch_size // dp
    _need(p.train_global_batch_size % dp == 0, "policy.train_global_batch_size",
          f"{p.train_global_batch_size} is not divisible by the data-parallel size {dp} ({layout})")
    by_tokens = p.sequence_packing.enabled or p.dynamic_batching.enabled  # micro-batches cut by a token budget
    _need(by_tokens or per_rank % p.train_micro_batch_size == 0, "policy.train_micro_batch_size",
          f"{p.train_micro_batch_size} does not divide the per-rank batch train_global_batch_size / "
          f"data-parallel size = {p.train_global_batch_size} / {dp} = {per_rank}")


def _validate_loss(cfg: MasterConfig) -> None:
    _choice(cfg.loss_fn.name, "loss_fn.name", sorted(LOSSES))
    check_loss_config(cfg.loss_fn)


def _validate_grpo(cfg: MasterConfig) -> None:
    g = cfg.grpo
    for key in ("num_prompts_per_step", "num_generations_per_prompt", "max_num_steps", "max_num_epochs",
                "val_batch_size"):
        _positive(getattr(g, key), f"grpo.{key}")
    _need(not g.use_leave_one_out_baseline or g.num_generations_per_prompt >= 2, "grpo.use_leave_one_out_baseline",
          f"the leave-one-out baseline needs grpo.num_generations_per_prompt >= 2, got "
          f"{g.num_generations_per_prompt}: set grpo.num_generations_per_prompt >= 2, or "
          f"grpo.use_leave_one_out_baseline=false")
    _need(g.max_rollout_turns >= 1, "grpo.max_rollout_turns", "must be >= 1")
    _need(g.val_period >= 0, "grpo.val_period", "must be >= 0 (0 disables)")
    _need(g.max_val_samples >= 0, "grpo.max_val_samples", "must be >= 0")
    _need(g.dynamic_sampling_max_gen_batches >= 1, "grpo.dynamic_sampling_max_gen_batches", "must be >= 1")
    _need(g.batch_multiplier >= 1, "grpo.batch_multiplier", "must be >= 1")
    r = g.reward_scaling
    _need(r.source_max > r.source_min, "grpo.reward_scaling.source_max", "must be > source_min")
    _validate_advantages(cfg)
    _validate_reward_shaping(cfg)
    _validate_async(cfg)
    ck = cfg.checkpointing
    _positive(ck.save_period, "checkpointing.save_period")
    _positive(ck.keep_top_k, "checkpointing.keep_top_k", nullable=True)
    _need(cfg.logger.num_val_samples_to_print >= 0, "logger.num_val_samples_to_print", "must be >= 0")


def _validate_async(cfg: MasterConfig) -> None:
    a = cfg.grpo.async_grpo
    if not a.enabled:
        return
    _need(a.max_trajectory_age_steps >= 0, "grpo.async_grpo.max_trajectory_age_steps",
          f"must be >= 0, got {a.max_trajectory_age_steps}")
    _need(not cfg.policy.generation.colocated.enabled, "policy.generation.colocated.enabled",
          "must be false with grpo.async_grpo.enabled: generation runs on actors (and devices) of its own while "
          "the policy trains")
    _need(cfg.loss_fn.use_importance_sampling_correction, "loss_fn.use_importance_sampling_correction",
          "must be true with grpo.async_grpo.enabled: rollouts come from weights up to "
          f"grpo.async_grpo.max_trajectory_age_steps={a.max_trajectory_age_steps} steps old, and the loss must "
          "weight them by pi_old / pi_gen")


def _validate_advantages(cfg: MasterConfig) -> None:
    g, est = cfg.grpo, cfg.grpo.adv_estimator
    _choice(est.name, "grpo.adv_estimator.name", sorted(ESTIMATORS))
    lo, hi = g.advantage_clip_low, g.advantage_clip_high
    _need(lo is None or lo <= 0, "grpo.advantage_clip_low", f"must be <= 0 or null, got {lo}")
    _need(hi is None or hi >= 0, "grpo.advantage_clip_high", f"must be >= 0 or null, got {hi}")
    _need(est.reward_weights is None or est.name == "gdpo", "grpo.adv_estimator.reward_weights",
          f"weighs gdpo's reward components; grpo.adv_estimator.name is {est.name!r}")
    if est.name == "gdpo":
        _need(not g.reward_shaping.enabled, "grpo.reward_shaping.enabled",
              "gdpo normalises each reward component, so a penalty on the summed reward would be lost: "
              "return the penalty as a component of its own, or use grpo.adv_estimator.name=grpo")
        _need(not cfg.loss_fn.use_kl_in_reward, "loss_fn.use_kl_in_reward",
              "gdpo normalises each reward component; keep the KL in the loss (use_kl_in_reward=false)")


def _validate_reward_shaping(cfg: MasterConfig) -> None:
    r, key = cfg.grpo.reward_shaping, "grpo.reward_shaping."
    if not r.enabled:
        return
    overlong = (r.overlong_buffer_length, r.overlong_buffer_penalty)
    _need(r.stop_properly_penalty_coef is not None or r.overlong_buffer_length is not None, key + "enabled",
          "is true but neither stop_properly_penalty_coef nor overlong_buffer_length is set")
    _need(r.stop_properly_penalty_coef is None or 0 <= r.stop_properly_penalty_coef <= 1,
          key + "stop_properly_penalty_coef", f"must be in [0, 1], got {r.stop_properly_penalty_coef}")
    if any(v is not None for v in overlong):
        _need(all(v is not None for v in overlong), key + "overlong_buffer_length",
              "overlong_buffer_length and overlong_buffer_penalty go together: set both")
        limit = r.max_response_length or cfg.policy.generation.max_new_tokens * cfg.grpo.max_rollout_turns
        _need(0 < r.overlong_buffer_length <= limit, key + "overlong_buffer_length",
              f"must be in [1, max_response_length = {limit}], got {r.overlong_buffer_length}")
        _need(r.overlong_buffer_penalty >= 0, key + "overlong_buffer_penalty",
              f"must be >= 0, got {r.overlong_buffer_penalty}")


def _validate_dataset(ds: DatasetConfig, env: EnvConfig, section: str, files: bool) -> None:
    """One data set's environment (named, configured, enabled) and prompt files; `section` is its key
    ("data.train", or "data" for evaluation)."""
    _choice(ds.env_name, f"{section}.env_name", sorted(ENVIRONMENTS))
    env_cfg = getattr(env, ds.env_name, None)
    _need(env_cfg is not None and getattr(env_cfg, "active", True), f"env.{ds.env_name}",
          f"{section}.env_name is '{ds.env_name}' but env.{ds.env_name} is null or disabled")
    for key in ("prompt_file", "system_prompt_file"):
        path = getattr(ds, key)
        _need(path is None or not files or os.path.isfile(path), f"{section}.{key}", f"file not found: {path}")


def _validate_data_env(cfg: MasterConfig, files: bool) -> None:
    d = cfg.data
    _positive(d.max_input_seq_length, "data.max_input_seq_length")
    for split in ("train", "validation"):
        ds: Optional[DatasetConfig] = getattr(d, split)
        if ds is not None:
            _validate_dataset(ds, cfg.env, f"data.{split}", files)
    rm = cfg.env.reward_model
    if rm is not None and rm.active:
        _validate_reward_model(rm, plan_resources(cfg).placements["reward_model"].world_size, files)
    _validate_env_sections(cfg.env)
    validate_llm_judge(cfg.env.llm_judge, cfg.grpo.num_generations_per_prompt, "grpo.num_generations_per_prompt",
                       files, judged=d.train.env_name == "llm_judge")


def validate_llm_judge(j: Optional[LlmJudgeConfig], group_size: int, group_key: str, files: bool,
                       judged: bool = False) -> None:
    """env.llm_judge's own values, its template (when `files`) and where the judge runs; judged: the (training)
    data set is judged, in groups of `group_size` samples (its key `group_key`), which pairwise mode compares."""
    if j is None:
        return
    key = "env.llm_judge."
    _choice(j.mode, key + "mode", MODES)
    _choice(j.comparison_strategy, key + "comparison_strategy", STRATEGIES)
    _need(j.score_max > j.score_min, key + "score_max", f"{j.score_max} must be > score_min ({j.score_min})")
    _need(j.parse_retries >= 0, key + "parse_retries", f"must be >= 0, got {j.parse_retries}")
    if j.score_regex is not None:
        try:
            re.compile(j.score_regex)
        except re.error as e:
            raise ConfigError(f"config key '{key}score_regex': {j.score_regex!r} is not a regular expression: "
                              f"{e}") from None
    if j.score_labels is not None:
        _need(bool(j.score_labels) and all(label.strip() for label in j.score_labels), key + "score_labels",
              f"{j.score_labels} must map non-empty labels to scores, e.g. {{negative: 10, positive: 0}}")
        _need(j.score_regex is None, key + "score_labels", f"{j.score_labels} and {key}score_regex "
              f"{j.score_regex!r} are both set: a reply's score is read by one of them, set one")
    labels = (j.judge_equal_label, j.judge_not_equal_label)
    _need(all(labels) and labels[0] != labels[1], key + "judge_equal_label",
          f"{labels[0]!r} and judge_not_equal_label {labels[1]!r} must be two different, non-empty labels")
    _need(not (judged and j.mode == "pairwise" and group_size < 2), key + "comparison_strategy",
          f"{j.comparison_strategy} compares the samples of a prompt's group, but {group_key} is {group_size}: "
          f"set {group_key} >= 2, or env.llm_judge.mode=pointwise")
    if files:
        read_judge_template(j)
    _validate_judge_placement(j, files)


def read_judge_template(j: LlmJudgeConfig) -> str:
    """The text of env.llm_judge.judge_prompt_template_fpath, checked for its mode's placeholders; a ConfigError
    naming the key and the file when it is unset, unreadable or lacks a placeholder."""
    key, path = "env.llm_judge.judge_prompt_template_fpath", j.judge_prompt_template_fpath
    _need(bool(path), key, f"is required: a text file with the judge's prompt ({j.mode} mode)")
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config key '{key}': cannot read '{path}': {getattr(e, 'strerror', None) or e}") from None
    problem = template_problem(template, j.mode)
    _need(problem is None, key, f"'{path}' {problem}")
    return template


def _validate_judge_placement(j: LlmJudgeConfig, files: bool) -> None:
    """Exactly one of model_name (in the cluster) and base_url (over HTTP), with what each needs."""
    key = "env.llm_judge."
    where = ("model_name: a local HF directory the judge runs from in the cluster; base_url: an OpenAI-compatible "
             "server")
    _need(j.model_name is not None or j.base_url is not None, key + "model_name",
          f"neither it nor env.llm_judge.base_url is set: set one ({where})")
    _need(j.model_name is None or j.base_url is None, key + "model_name",
          f"'{j.model_name}' and env.llm_judge.base_url '{j.base_url}' are both set: set one ({where})")
    g = j.generation
    _positive(g.max_new_tokens, key + "generation.max_new_tokens")
    _need(g.temperature > 0, key + "generation.temperature", f"must be > 0 (the retries sample), got {g.temperature}")
    _need(0 < g.top_p <= 1, key + "generation.top_p", f"must be in (0, 1], got {g.top_p}")
    _positive(g.top_k, key + "generation.top_k", nullable=True)
    if j.in_cluster:
        if files:
            _need_model_dir(j.model_name, key + "model_name", "the judge's Hugging Face model directory")
        _choice(g.backend, key + "generation.backend", ["torch", "vllm"])
        _positive(g.vllm_cfg.tensor_parallel_size, key + "generation.vllm_cfg.tensor_parallel_size")
        return
    _need(bool(j.model), key + "model", f"is required with base_url ({j.base_url}): the served model's name")
    _positive(j.judge_endpoint_max_concurrency, key + "judge_endpoint_max_concurrency")
    _positive(j.timeout_s, key + "timeout_s")
    _need(j.max_retries >= 0, key + "max_retries", f"must be >= 0, got {j.max_retries}")
    _need(j.api_key_env is None or j.api_key_env in os.environ, key + "api_key_env",
          f"the environment variable {j.api_key_env} is not set")


def _validate_env_sections(env: EnvConfig) -> None:
    """The code and math environments' own values (the math judge fallback's env.llm_judge)."""
    if env.code is not None:
        c = env.code
        _positive(c.num_workers, "env.code.num_workers")
        _choice(c.reward_mode, "env.code.reward_mode", ["fraction", "all_or_nothing"])
        for key in ("timeout_s", "cpu_s", "memory_mb", "max_output_bytes"):
            _positive(getattr(c, key), f"env.code.{key}")
    if env.math is not None:
        _positive(env.math.num_workers, "env.math.num_workers")
        _positive(env.math.timeout_s, "env.math.timeout_s")
        f = env.math.judge_agreement_fraction
        _need(0 <= f <= 1, "env.math.judge_agreement_fraction", f"must be in [0, 1], got {f}")
        if env.math.judge_fallback:
            j = env.llm_judge
            _need(j is not None, "env.math.judge_fallback",
                  "is true but env.llm_judge is null: set env.llm_judge (mode equivalence), the judge that decides "
                  "the answers math-verify cannot parse")
            _need(j.mode == "equivalence", "env.llm_judge.mode",
                  f"is {j.mode}, but env.math.judge_fallback needs equivalence (the judge says whether an answer "
                  "equals the reference)")


def _validate_reward_model(r: RewardModelEnvConfig, world: int, files: bool = True,
                           prefix: str = "env.reward_model") -> None:
    """A reward model's section on its `world` devices."""
    key = prefix + "."
    if files:
        _need(os.path.isdir(r.model_name), key + "model_name",
              f"'{r.model_name}' is not a local directory (a Hugging Face *ForSequenceClassification model)")
        check_model_dir(r.model_name, key + "model_name")
    _choice(r.backend, key + "backend", backend_names())
    _choice(r.precision, key + "precision", PRECISIONS)
    _choice(r.reward_model_cfg.reward_model_type, key + "reward_model_cfg.reward_model_type", ["bradley_terry"])
    _positive(r.batch_size, key + "batch_size")
    _positive(r.max_model_len, key + "max_model_len")
    check_degrees(r, prefix)
    _validate_context_parallel(r.policy_config(), prefix, (key + "max_model_len", r.max_model_len))
    policy_layout(r, world, prefix, where=f"the reward model's {world} devices ({key}resources)")


# ----------------------------------------------------------------------------------------------- reward-model training
def validate_rm_train(cfg: RMTrainConfig) -> None:
    """Keys, files and batch shapes (whole pairs in every micro-batch and data-parallel shard)."""
    p = cfg.policy
    validate_policy(p, files=True, scalar_head=True, width=("data.max_seq_length", cfg.data.max_seq_length))
    _need(bool(cfg.data.train_data_path), "data.train_data_path", "is required (a JSONL of preference pairs)")
    _need_data_file(cfg.data.train_data_path, "data.train_data_path")
    _need_data_file(cfg.data.val_data_path, "data.val_data_path")
    c = cfg.cluster
    world = c.gpus_per_node * c.num_nodes
    dp = policy_layout(p, world, where=f"world size {world} (cluster.gpus_per_node {c.gpus_per_node} x "
                       f"cluster.num_nodes {c.num_nodes})").dp
    gbs, mbs = p.train_global_batch_size, p.train_micro_batch_size
    _need(gbs % (2 * dp) == 0, "policy.train_global_batch_size",
          f"{gbs} rows must split into whole (chosen, rejected) pairs on each of {dp} data-parallel ranks")
    _need(mbs % 2 == 0 and (gbs // dp) % mbs == 0, "policy.train_micro_batch_size",
          f"{mbs} must be even and divide the per-rank rows {gbs} / {dp} = {gbs // dp}")
    _positive(cfg.rm.max_num_steps, "rm.max_num_steps")
    _need(cfg.rm.val_period >= 0, "rm.val_period", "must be >= 0 (0: validate only at the end)")
    _need(cfg.data.max_seq_length > 1, "data.max_seq_length", "must be > 1")
    _positive(cfg.checkpointing.save_period, "checkpointing.save_period")


# ----------------------------------------------------------------------------------------------- evaluation
def load_eval_config(path: str | None = None, overrides: list[str] | None = None) -> EvalMasterConfig:
    cfg = read_config(path, overrides, schema=EvalMasterConfig)
    validate_eval(cfg)
    return cfg


def validate_eval(cfg: EvalMasterConfig, files: bool = True) -> None:
    """The eval keys, the model (an HF directory, builtin:..., or a checkpoint's step_N), generation, data."""
    e, p = cfg.eval, cfg.policy
    _choice(e.metric, "eval.metric", ["pass@k", "cons@k"])
    for key in ("num_tests_per_prompt", "k_value", "num_prompts_per_step", "max_rollout_turns"):
        _positive(getattr(e, key), f"eval.{key}")
    _positive(e.max_num_prompts, "eval.max_num_prompts", nullable=True)
    _need(e.k_value <= e.num_tests_per_prompt, "eval.k_value",
          f"{e.k_value} > eval.num_tests_per_prompt ({e.num_tests_per_prompt}): pass@k and cons@k take k of the "
          "samples of each prompt; raise eval.num_tests_per_prompt or lower eval.k_value")
    _need(bool(e.save_path), "eval.save_path", "is required (the directory for samples.jsonl and summary.json)")
    if files:
        _need_eval_model(p.model_name, "policy.model_name")
    _validate_generation(p.generation, greedy_ok=True)
    _positive(cfg.data.max_input_seq_length, "data.max_input_seq_length")
    total = cfg.data.max_input_seq_length + p.generation.max_new_tokens * e.max_rollout_turns
    _need(total <= p.max_total_sequence_length, "policy.max_total_sequence_length",
          f"{p.max_total_sequence_length} < data.max_input_seq_length ({cfg.data.max_input_seq_length}) + "
          f"policy.generation.max_new_tokens ({p.generation.max_new_tokens}) x eval.max_rollout_turns "
          f"({e.max_rollout_turns}) = {total}")
    _validate_dataset(cfg.data, cfg.env, "data", files)
    _need(cfg.data.env_name != "reward_model", "data.env_name", "the reward-model environment is not built for "
          "evaluation yet; use math or code")
    _need_data_file(None if cfg.data.dataset_name != "ResponseDataset" else cfg.data.data_path, "data.data_path")
    _validate_env_sections(cfg.env)
    validate_llm_judge(cfg.env.llm_judge, e.num_tests_per_prompt, "eval.num_tests_per_prompt", files,
                       judged=cfg.data.env_name == "llm_judge")
    for key in ("gpus_per_node", "num_nodes", "num_threads_per_worker"):
        _positive(getattr(cfg.cluster, key), f"cluster.{key}")


def _need_eval_model(path: str, key: str) -> None:
    """A model to evaluate: a training checkpoint's step_N (complete, with its policy and the run's config),
    or a model directory / builtin: name as training takes it."""
    if os.path.isfile(os.path.join(path, TRAINING_INFO)):
        _need(os.path.isdir(os.path.join(path, POLICY_DIR)), key,
              f"'{path}' is a training checkpoint without its policy ({POLICY_DIR}/ is missing)")
        _need(os.path.isfile(os.path.join(path, CONFIG_YAML)), key,
              f"'{path}' is a training checkpoint without {CONFIG_YAML} (the run's config, which says how to "
              "build its policy)")
        problem = checkpoint_problem(path)
        _need(problem is None, key, f"checkpoint '{path}' is damaged: {problem}")
        try:
            read_config(os.path.join(path, CONFIG_YAML))  # the run's policy is built from it to export the weights
        except ConfigError as e:
            raise ConfigError(f"config key '{key}': the run's config in checkpoint '{path}' cannot be read: "
                              f"{e}") from None
        return
    steps = sorted((n for n in (os.listdir(path) if os.path.isdir(path) else [])
                    if n.startswith(FINAL_PREFIX) and n[len(FINAL_PREFIX):].isdigit()),
                   key=lambda n: int(n[len(FINAL_PREFIX):]))
    _need(not steps or os.path.isfile(os.path.join(path, "config.json")), key,
          f"'{path}' is a checkpoint directory; name one of its checkpoints, e.g. {os.path.join(path, steps[-1])}"
          if steps else "")
    _need_model_dir(path, key, "a Hugging Face model directory, builtin:tiny-addition, or a training "
                    "checkpoint's step_N")
