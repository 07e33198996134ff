"""Build every component of a GRPO run (build_trainer) or of an evaluation (build_evaluator) from a validated
config (Ray actors included)."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import ray

from nemo_grpo.algorithms.evaluation import Evaluator
from nemo_grpo.algorithms.grpo import GRPOTrainer, RunActors
from nemo_grpo.config import EvalMasterConfig, MasterConfig, read_config, to_dict
from nemo_grpo.data.datasets import load_problems
from nemo_grpo.data.prompts import PromptLoader, build_prompts, read_prompt_files
from nemo_grpo.distributed.cluster import init_ray
from nemo_grpo.distributed.resource_plan import (check_num_replicas, engine_replicas, judge_replicas,
                                                 plan_resources, replicas_per_node, reserve)
from nemo_grpo.distributed.shared_storage import check_shared_directory
from nemo_grpo.envs import create_env
from nemo_grpo.errors import DataError
from nemo_grpo.generation import make_generation_engine
from nemo_grpo.models.builtin import resolve_model_path
from nemo_grpo.models.files import check_model_dir
from nemo_grpo.models.tokenizer import load_tokenizer as load_tokenizer_dir
from nemo_grpo.policy import Policy
from nemo_grpo.utils.checkpoint import CONFIG_YAML, POLICY_DIR, TRAINING_INFO, CheckpointManager
from nemo_grpo.utils.logger import Logger
from nemo_grpo.validation import read_judge_template, validate_model_layout

log = logging.getLogger(__name__)


def load_tokenizer(cfg: MasterConfig, model_path: str):
    tokenizer = load_tokenizer_dir(cfg.policy.tokenizer.name or model_path)
    if cfg.policy.tokenizer.chat_template is not None:
        tokenizer.chat_template = cfg.policy.tokenizer.chat_template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_datasets(cfg: MasterConfig) -> dict:
    """data.* split ("train", "validation") -> its raw problems: the data and prompt files are read (and their
    errors raised) before any model, tokenizer or actor is loaded."""
    problems = {}
    for split, ds in (("train", cfg.data.train), ("validation", cfg.data.validation)):
        if ds is not None:
            problems[split] = load_problems(ds, f"data.{split}")
            read_prompt_files(ds, f"data.{split}")
    return problems


def build_datasets(cfg: MasterConfig, tokenizer, problems: dict | None = None):
    """(train PromptLoader, validation datums) from data.* (or from load_datasets' `problems`)."""
    problems = load_datasets(cfg) if problems is None else problems
    n = cfg.data.max_input_seq_length
    train, _ = build_prompts(problems["train"], tokenizer, cfg.data.train, n, "data.train")
    val = []
    if cfg.data.validation is not None:
        val, _ = build_prompts(problems["validation"], tokenizer, cfg.data.validation, n, "data.validation")
    loader = PromptLoader(train, cfg.grpo.num_prompts_per_step, cfg.data.shuffle, cfg.grpo.seed)
    return loader, val


def build_environments(cfg: MasterConfig, plan=None, groups: dict | None = None) -> dict:
    """task name -> environment actor, one actor per environment named in data.*.env_name; the reward model
    and an in-cluster LLM judge start on their shares of the resource plan."""
    names = {ds.env_name for ds in (cfg.data.train, cfg.data.validation) if ds is not None}
    envs = {}
    for name in sorted(names):
        extra = {}
        if name == "reward_model" and plan is not None:
            extra = dict(placement=plan.placements["reward_model"], placement_group=(groups or {}).get(name))
        if judged(name, cfg.env):
            extra = env_judge_kwargs(name, cfg.env, cfg.cluster, plan, groups)
        envs[name] = create_env(name, getattr(cfg.env, name), **extra)
    return envs


def judged(name: str, env) -> bool:
    """Whether environment `name` asks env.llm_judge's judge: llm_judge itself, math with judge_fallback."""
    return name == "llm_judge" or (name == "math" and env.math is not None and env.math.judge_fallback)


def env_judge_kwargs(name: str, env, cluster, plan=None, groups: dict | None = None) -> dict:
    """The constructor kwargs of environment `name` when it asks the LLM judge (`judged`): the template, read here
    on the driver; an in-cluster judge's engine replicas on its share of the resource plan (none: one replica,
    anywhere); an HTTP judge's API key, read here from env.llm_judge.api_key_env (an argument, not the actor's
    runtime_env, which Ray's dashboard shows); the math environment also gets env.llm_judge itself."""
    j = env.llm_judge
    extra = dict(template=read_judge_template(j), num_threads=cluster.num_threads_per_worker)
    if j.in_cluster and plan is not None:
        extra["replicas"] = judge_replicas(plan, groups, j.generation.vllm_cfg.tensor_parallel_size)
    if j.api_key_env:
        extra["api_key"] = os.environ[j.api_key_env]
    if name == "math":
        extra["judge_cfg"] = j
    return extra


def check_judge_endpoint(env_names: list[str], env) -> None:
    """An HTTP judge's server answers (envs/judge_clients.py check_endpoint), when an environment named by a data
    set asks it (`judged`)."""
    j = env.llm_judge
    if any(judged(name, env) for name in env_names) and j is not None and not j.in_cluster:
        from nemo_grpo.envs.judge_clients import check_endpoint  # here: the openai package loads in ~1 s

        check_endpoint(j)


def start_actors(cfg: MasterConfig, model_path: str):
    """The run's actors (algorithms/grpo.py RunActors) on the resource plan's placement groups: the environments,
    then the policy with the generation engine starting beside it (each takes seconds: imports, the model
    build, vLLM's start-up), ready when this returns."""
    plan = plan_resources(cfg)
    log.info("resource plan:\n%s", plan.describe())
    groups = reserve(plan)
    envs = build_environments(cfg, plan, groups)
    a = cfg.grpo.async_grpo
    started = RunActors(None, None, envs, groups)
    try:
        with ThreadPoolExecutor(1) as pool:  # the engine's constructor waits for its workers: start it meanwhile
            engine = pool.submit(make_generation_engine, cfg.policy.generation, model_path, cfg.cluster,
                                 in_flight_updates=a.enabled and a.in_flight_weight_updates,
                                 replicas=engine_replicas(plan, groups), precision=cfg.policy.precision,
                                 lora_cfg=cfg.policy.lora)
            try:
                started.policy = Policy(
                    cfg.policy, plan.placements["policy"].as_cluster(cfg.cluster.num_threads_per_worker), model_path,
                    init_reference=cfg.loss_fn.reference_policy_kl_penalty > 0, seed=cfg.grpo.seed,
                    placement_group=groups["policy"])
            finally:
                started.engine = engine.result()
        ray.get([e.__ray_ready__.remote() for e in envs.values()])
    except BaseException:
        try:
            started.close()  # what did start
        except Exception:  # noqa: BLE001 -- the start's own error is the one to report
            log.debug("closing a failed start failed", exc_info=True)
        raise
    return started


def build_trainer(cfg: MasterConfig, *, log_to_driver: bool = True, start=start_actors):
    """The GRPOTrainer of a validated config. What the user's input can break is checked first, cheapest first
    (output directories, the checkpoint to resume, data files, that an HTTP LLM judge's server answers, then the
    model and its tokenizer), so a UserInputError comes before Ray or any actor starts; with Ray up, before any
    worker: that every node sees checkpointing.checkpoint_dir (shared_storage.py), then the resource plan against
    the cluster (`reserve`). log_to_driver=False leaves the Ray workers' output in Ray's session logs.
    start(cfg, model_path) -> RunActors gives the run its actors (`start_actors`; a caller running several runs in
    one process may hand back actors it kept, reset to their start)."""
    checkpointer = CheckpointManager(cfg.checkpointing)  # creates checkpoint_dir, checks that it is writable
    if cfg.checkpointing.enabled and cfg.checkpointing.resume:
        checkpointer.get_latest_checkpoint_path()  # file sizes only: a damaged newest warns, all damaged raises
    problems = load_datasets(cfg)
    check_judge_endpoint([ds.env_name for ds in (cfg.data.train, cfg.data.validation) if ds is not None], cfg.env)
    model_path = resolve_model_path(cfg.policy.model_name, seed=0)
    if model_path != cfg.policy.model_name:  # a builtin: model's cached build (a local one was checked already)
        check_model_dir(model_path, "policy.model_name")
    validate_model_layout(cfg.policy, model_path)
    tokenizer = load_tokenizer(cfg, model_path)
    loader, val = build_datasets(cfg, tokenizer, problems)
    logger = Logger(cfg.logger, to_dict(cfg))
    init_ray(log_to_driver=log_to_driver)
    if cfg.checkpointing.enabled:  # several nodes: each must see the directory its policy ranks write
        check_shared_directory(checkpointer.root, "checkpointing.checkpoint_dir")
    return GRPOTrainer(cfg, tokenizer=tokenizer, actors=start(cfg, model_path), loader=loader, val_datums=val,
                       logger=logger, checkpointer=checkpointer)


# ----------------------------------------------------------------------------------------------- evaluation
def export_checkpoint(path: str, out_dir: str) -> str:
    """A training checkpoint's step_N as a Hugging Face directory `out_dir`: the run's policy (its config.yaml:
    model, back end, layout, LoRA) starts on its share of the run's resource plan, loads the checkpoint and
    saves itself (Policy.save_pretrained: the tokenizer files come along). Ray must be running."""
    run = read_config(os.path.join(path, CONFIG_YAML))
    base = resolve_model_path(run.policy.model_name, seed=0)
    placement = plan_resources(run).placements["policy"]
    log.info("exporting checkpoint %s to %s (%d %s worker(s))", path, out_dir, placement.world_size,
             run.policy.backend)
    policy = Policy(run.policy, placement.as_cluster(run.cluster.num_threads_per_worker), base, seed=run.grpo.seed)
    try:
        policy.load_checkpoint(os.path.join(path, POLICY_DIR))
        policy.save_pretrained(out_dir)
    finally:
        policy.shutdown()
    return out_dir


def eval_problems(cfg: EvalMasterConfig) -> list:
    """The raw evaluation problems (data.*) and its prompt files read; an empty data set names data.data_path."""
    problems = load_problems(cfg.data, "data")
    read_prompt_files(cfg.data, "data")
    if not problems:
        raise DataError(f"config key 'data.data_path': the data set {cfg.data.data_path or cfg.data.dataset_name} "
                        "has no rows")
    return problems


def eval_replicas(cfg: EvalMasterConfig) -> int:
    """Engine replicas of an evaluation: every device of the cluster / the engine's TP (Ray places them: each
    asks for its TP devices on GPUs), or policy.generation.num_replicas of them."""
    tp, c, n = cfg.policy.generation.vllm_cfg.tensor_parallel_size, cfg.cluster, cfg.policy.generation.num_replicas
    every = c.num_nodes * replicas_per_node(c.gpus_per_node, tp, "the cluster (cluster.gpus_per_node)")
    check_num_replicas(n, every)
    return every if n is None else n


def build_evaluator(cfg: EvalMasterConfig, *, log_to_driver: bool = True) -> Evaluator:
    """The Evaluator of a validated eval config. The data set is read first (its errors come before Ray starts);
    a checkpoint's step_N is exported to <eval.save_path>/model; then the environment and the engine start.
    Prompts: the first eval.max_num_prompts that fit data.max_input_seq_length."""
    os.makedirs(cfg.eval.save_path, exist_ok=True)
    problems = eval_problems(cfg)
    name = cfg.policy.model_name
    if os.path.isfile(os.path.join(name, TRAINING_INFO)):  # a training checkpoint's step_N
        init_ray(log_to_driver=log_to_driver)
        model_path = export_checkpoint(name, os.path.join(cfg.eval.save_path, "model"))
    else:
        model_path = resolve_model_path(name, seed=0)
        check_model_dir(model_path, "policy.model_name")
    tokenizer = load_tokenizer(cfg, model_path)
    datums, _ = build_prompts(problems, tokenizer, cfg.data, cfg.data.max_input_seq_length, "data")
    check_judge_endpoint([cfg.data.env_name], cfg.env)
    init_ray(log_to_driver=log_to_driver)
    extra = env_judge_kwargs(cfg.data.env_name, cfg.env, cfg.cluster) if judged(cfg.data.env_name, cfg.env) else {}
    envs = {cfg.data.env_name: create_env(cfg.data.env_name, getattr(cfg.env, cfg.data.env_name), **extra)}
    engine = make_generation_engine(cfg.policy.generation, model_path, cfg.cluster,
                                    replicas=(None,) * eval_replicas(cfg), precision=cfg.policy.precision)
    ray.get([e.__ray_ready__.remote() for e in envs.values()])
    return Evaluator(cfg, tokenizer=tokenizer, engine=engine, envs=envs, datums=datums[: cfg.eval.max_num_prompts],
                     model_path=model_path)
