"""Config loading: defaults, YAML recipes, dotted overrides, and errors that name the offending key."""

import glob
import os

import pytest
from omegaconf import OmegaConf

from nemo_grpo.config import ConfigError
from nemo_grpo.validation import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_defaults_are_the_tiny_recipe():
    cfg = load_config()
    recipe = load_config(os.path.join(ROOT, "configs", "grpo_tiny_cpu.yaml"))
    assert cfg == recipe
    assert cfg.policy.backend == "dtensor" and cfg.cluster.gpus_per_node == 2


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["grpo.max_num_steps=7", "policy.optimizer.lr=1e-3",
                             "policy.generation.stop_strings=[\"\\n\"]", "grpo.use_leave_one_out_baseline=true"])
    assert cfg.grpo.max_num_steps == 7 and cfg.policy.optimizer.lr == 1e-3
    assert cfg.policy.generation.stop_strings == ["\n"] and cfg.grpo.use_leave_one_out_baseline is True


def test_recipe_inherits_from_defaults_file(tmp_path):
    (tmp_path / "base.yaml").write_text("grpo:\n  max_num_steps: 11\n  seed: 3\n")
    (tmp_path / "child.yaml").write_text("defaults: base.yaml\ngrpo:\n  seed: 5\n")
    cfg = load_config(str(tmp_path / "child.yaml"))
    assert (cfg.grpo.max_num_steps, cfg.grpo.seed) == (11, 5)


PACKING = ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=64",
           "policy.sequence_packing.logprob_mb_tokens=64"]
ASYNC = ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"]
BAD = [
    (["grpo.num_prompt_per_step=4"], "grpo.num_prompt_per_step"),  # typo: unknown key
    (["policy.optimizer.lr=fast"], "policy.optimizer.lr"),  # wrong type
    (["policy.backend=jax"], "policy.backend"),
    (["policy.train_global_batch_size=100"], "policy.train_global_batch_size"),  # does not divide 16 x 8
    (["policy.train_micro_batch_size=48"], "policy.train_micro_batch_size"),  # does not divide 128 / 2
    (["policy.dtensor_cfg.tensor_parallel_size=3"], "policy.dtensor_cfg.tensor_parallel_size"),  # world 2
    (["policy.dtensor_cfg.data_parallel_size=2", "policy.dtensor_cfg.tensor_parallel_size=2"],
     "policy.dtensor_cfg.data_parallel_size"),  # tp x dp != world size
    (["loss_fn.reference_policy_kl_type=k4"], "loss_fn.reference_policy_kl_type"),
    (["loss_fn.ratio_clip_c=0.5"], "loss_fn.ratio_clip_c"),
    (["policy.generation.temperature=0"], "policy.generation.temperature"),
    (["policy.generation.top_p=1.5"], "policy.generation.top_p"),
    (["policy.max_total_sequence_length=10"], "policy.max_total_sequence_length"),  # < 8 prompt + 4 new
    (["policy.model_name=/nonexistent/model"], "policy.model_name"),
    (["data.train.env_name=chess"], "data.train.env_name"),
    (["grpo.num_generations_per_prompt=1", "grpo.use_leave_one_out_baseline=true",
      "policy.train_global_batch_size=16", "policy.train_micro_batch_size=8"], "grpo.use_leave_one_out_baseline"),
    (["policy.precision=fp8"], "policy.precision"),
    (["loss_fn.truncated_importance_sampling_ratio=2.0"], "loss_fn.truncated_importance_sampling_ratio"),
    (["data.train.prompt_file=/no/such/prompt.txt"], "data.train.prompt_file"),
    (["env.math=null"], "env.math"),
    (["cluster.gpus_per_node=0"], "cluster.gpus_per_node"),
    (["policy.generation.colocated.resources.num_nodes=0"], "policy.generation.colocated.resources.num_nodes"),
    (["grpo.max_num_steps"], "grpo.max_num_steps"),  # no '=': not an override
    (["policy.backend=megatron", "policy.megatron_cfg.tensor_model_parallel_size=2",
      "policy.megatron_cfg.pipeline_model_parallel_size=2"], "policy.megatron_cfg.tensor_model_parallel_size"),
    (["policy.backend=megatron", "policy.megatron_cfg.layer_spec=fast"], "policy.megatron_cfg.layer_spec"),
    (["policy.backend=megatron", "policy.megatron_cfg.layer_spec=transformer_engine"],
     "policy.megatron_cfg.layer_spec"),  # Transformer Engine is not installed on the CPU stack
    (["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=0"],
     "policy.sequence_packing.train_mb_tokens"),
    (["policy.sequence_packing.enabled=true", "policy.sequence_packing.attention=flash"],
     "policy.sequence_packing.attention"),
    (PACKING + ["policy.sequence_packing.algorithm=best_fit"], "policy.sequence_packing.algorithm"),
    (PACKING + ["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=64",
                "policy.dynamic_batching.logprob_mb_tokens=64"], "policy.sequence_packing.enabled"),  # both
    (["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.logprob_mb_tokens=-1"],
     "policy.dynamic_batching.logprob_mb_tokens"),
    (["policy.backend=megatron", "policy.megatron_cfg.pipeline_model_parallel_size=2",
      "policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=64",
      "policy.dynamic_batching.logprob_mb_tokens=64"], "policy.dynamic_batching.enabled"),  # PP
    (ASYNC, "policy.generation.colocated.enabled"),  # async generation needs actors of its own
    (ASYNC[:1] + ["policy.generation.colocated.enabled=false"], "loss_fn.use_importance_sampling_correction"),
    (ASYNC + ["policy.generation.colocated.enabled=false", "grpo.async_grpo.max_trajectory_age_steps=-1"],
     "grpo.async_grpo.max_trajectory_age_steps"),
]


@pytest.mark.parametrize("section", ["sequence_packing", "dynamic_batching"])
def test_one_key_switches_token_budgets_on(section, caplog):
    """enabled=true alone: the unset budgets become micro-batch rows x max_total_sequence_length, logged; a set
    one is kept."""
    key = f"policy.{section}"
    with caplog.at_level("INFO", logger="nemo_grpo.validation"):
        cfg = load_config(None, [f"{key}.enabled=true", "policy.max_total_sequence_length=24",
                                 "policy.train_micro_batch_size=8", "policy.logprob_batch_size=16"])
    budgets = getattr(cfg.policy, section)
    assert (budgets.train_mb_tokens, budgets.logprob_mb_tokens) == (8 * 24, 16 * 24)
    assert f"{key}.train_mb_tokens not set: 192 (train_micro_batch_size 8 x max_total_sequence_length 24)" \
        in caplog.text
    assert f"{key}.logprob_mb_tokens not set: 384" in caplog.text
    cfg = load_config(None, [f"{key}.enabled=true", f"{key}.logprob_mb_tokens=100"])
    assert getattr(cfg.policy, section).logprob_mb_tokens == 100
    assert getattr(cfg.policy, section).train_mb_tokens == cfg.policy.train_micro_batch_size * 16


@pytest.mark.parametrize("overrides,key", BAD, ids=[k for _, k in BAD])
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert key in str(e.value)


def _merged_yaml(recipe: str):
    """A recipe with its `defaults:` chain merged (no schema)."""
    import yaml

    with open(recipe) as f:
        data = yaml.safe_load(f) or {}
    parent = data.pop("defaults", None)
    base = _merged_yaml(os.path.join(os.path.dirname(recipe), parent)) if parent else OmegaConf.create({})
    return OmegaConf.merge(base, data)


@pytest.mark.parametrize("recipe", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))),
                         ids=os.path.basename)
def test_every_recipe_validates(recipe, tiny_model_dir, tmp_path):
    """Every recipe loads and validates; model directories a recipe expects to be made first (a reward model
    that train_rm writes) are stood in for by a tiny model."""
    if os.path.basename(recipe).startswith("rm_"):
        from nemo_grpo.validation import load_rm_train_config

        cfg = load_rm_train_config(recipe)
        assert cfg.data.train_data_path
        return
    if os.path.basename(recipe).startswith("eval_"):
        from nemo_grpo.validation import load_eval_config

        data = OmegaConf.select(_merged_yaml(recipe), "data.data_path")
        stand_in = tmp_path / "data.jsonl"  # a data file the recipe's user writes first (word_problems)
        stand_in.write_text('{"input": "1+1=", "output": "2"}\n')
        cfg = load_eval_config(recipe, [] if data is None or os.path.isfile(data) else [f"data.data_path={stand_in}"])
        assert cfg.eval.k_value <= cfg.eval.num_tests_per_prompt
        return
    overrides = []
    for key, model in (("policy.model_name", tiny_model_dir("qwen2")),
                       ("env.reward_model.model_name", tiny_model_dir("qwen2", scalar_head=True))):
        value = OmegaConf.select(_merged_yaml(recipe), key)
        if value is not None and not str(value).startswith("builtin:") and not os.path.isdir(value):
            overrides.append(f"{key}={model}")  # a model the recipe's user downloads (or train_rm makes) first
    cfg = load_config(recipe, overrides)
    assert cfg.policy.backend in ("dtensor", "megatron")


def test_megatron_layout_error_shows_the_arithmetic():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["policy.backend=megatron", "policy.megatron_cfg.tensor_model_parallel_size=2",
                           "policy.megatron_cfg.pipeline_model_parallel_size=2"])
    assert "tensor_model_parallel_size 2 x pipeline_model_parallel_size 2 x context_parallel_size 1 = 4 does not " \
           "divide world size 2" in str(e.value)


def test_layout_error_shows_the_arithmetic():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["policy.dtensor_cfg.data_parallel_size=2", "policy.dtensor_cfg.tensor_parallel_size=2"])
    assert "2 x tensor_parallel_size 2 x context_parallel_size 1 = 4 != world size 2" in str(e.value)


def test_missing_or_bad_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("trainer:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match="trainer"):
        load_config(str(unknown))


def test_cli_reports_config_error_without_traceback(capsys):
    from nemo_grpo.train import main

    assert main(["policy.optimizer.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert "policy.optimizer.lr" in err and "Traceback" not in err


@pytest.mark.parametrize("override,key", [
    ("policy.megatron_cfg.pipeline_model_parallel_size=0", "policy.megatron_cfg.pipeline_model_parallel_size"),
    ("policy.dtensor_cfg.tensor_parallel_size=0", "policy.dtensor_cfg.tensor_parallel_size"),
])
def test_keys_of_the_inactive_back_end_are_validated(override, key):
    backend = "dtensor" if "megatron_cfg" in override else "megatron"
    with pytest.raises(ConfigError, match=f"'{key}': .* must be >= 1, got 0"):
        load_config(None, [f"policy.backend={backend}", override])


def test_a_negative_prompt_count_is_named_as_itself():
    with pytest.raises(ConfigError, match="'grpo.num_prompts_per_step': must be > 0, got -1"):
        load_config(None, ["grpo.num_prompts_per_step=-1"])


def test_reward_model_switch_of_nemo_rl_is_honoured(tiny_model_dir):
    rm = tiny_model_dir("qwen2", scalar_head=True)
    base = [f"env.reward_model.model_name={rm}", "env.reward_model.resources.gpus_per_node=1",
            "cluster.gpus_per_node=2", "data.train.env_name=reward_model"]
    assert load_config(None, base).env.reward_model.active
    with pytest.raises(ConfigError, match="'env.reward_model': data.train.env_name is 'reward_model' but "
                                          "env.reward_model is null or disabled"):
        load_config(None, base + ["env.reward_model.reward_model_cfg.enabled=false"])


def test_non_utf8_recipe_is_named_with_its_line(tmp_path):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("grpo:\n  max_num_steps: 3\n# caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"--config: {recipe}:3: not UTF-8 text"):
        load_config(str(recipe))


def test_overlapped_reduction_of_a_tied_embedding_over_stages_is_rejected(tiny_model_dir):
    """The tied embedding's gradient is summed over the first and last stages before the distributed optimizer's
    data-parallel reduce-scatter, which overlap_grad_reduce would already have started."""
    from nemo_grpo.config import PolicyConfig
    from nemo_grpo.validation import validate_model_layout

    path = tiny_model_dir("qwen2")  # tied embeddings
    p = PolicyConfig(model_name=path, backend="megatron")
    p.megatron_cfg.pipeline_model_parallel_size, p.megatron_cfg.use_distributed_optimizer = 2, True
    with pytest.raises(ConfigError, match="distributed_data_parallel_config.overlap_grad_reduce': the model ties"):
        validate_model_layout(p, path)
    p.megatron_cfg.distributed_data_parallel_config.overlap_grad_reduce = False
    validate_model_layout(p, path)


# ---------------------------------------------------------------------------------------------- context parallelism
MCP = ["policy.backend=megatron", "policy.megatron_cfg.context_parallel_size=2"]
DCP = ["policy.dtensor_cfg.context_parallel_size=2"]
CHUNKS = "context parallelism cuts every row into 2 x context_parallel_size equal chunks"
CP_BAD = [
    (MCP + ["policy.max_total_sequence_length=18", "data.max_input_seq_length=8"],
     "config key 'policy.max_total_sequence_length': 18 is not a multiple of 2 x "
     f"policy.megatron_cfg.context_parallel_size 2 = 4: {CHUNKS}"),
    (DCP + ["policy.max_total_sequence_length=18", "data.max_input_seq_length=8"],
     "config key 'policy.max_total_sequence_length': 18 is not a multiple of 2 x "
     f"policy.dtensor_cfg.context_parallel_size 2 = 4: {CHUNKS}"),
    (MCP + ["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=true",
            "policy.max_total_sequence_length=20", "cluster.gpus_per_node=4"],
     "config key 'policy.max_total_sequence_length': 20 is not a multiple of 2 x "
     "policy.megatron_cfg.context_parallel_size 2 x tensor_model_parallel_size 2 (sequence_parallel) = 8: "
     f"{CHUNKS}, each split over the tensor-parallel ranks by sequence parallelism"),
    (MCP + ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=66"],
     "config key 'policy.sequence_packing.train_mb_tokens': 66 is not a multiple of 2 x "
     f"policy.megatron_cfg.context_parallel_size 2 = 4: {CHUNKS}"),
    (MCP + ["policy.sequence_packing.enabled=true", "policy.sequence_packing.logprob_mb_tokens=66"],
     "config key 'policy.sequence_packing.logprob_mb_tokens': 66 is not a multiple of 2 x "
     f"policy.megatron_cfg.context_parallel_size 2 = 4: {CHUNKS}"),
    (DCP + ["policy.sequence_packing.enabled=true", "policy.sequence_packing.sequence_length_round=6"],
     "config key 'policy.sequence_packing.sequence_length_round': 6 is not a multiple of 2 x "
     f"policy.dtensor_cfg.context_parallel_size 2 = 4: {CHUNKS}"),
    (DCP + ["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=66"],
     "config key 'policy.dynamic_batching.train_mb_tokens': 66 is not a multiple of 2 x "
     f"policy.dtensor_cfg.context_parallel_size 2 = 4: {CHUNKS}"),
    (DCP + ["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.logprob_mb_tokens=66"],
     "config key 'policy.dynamic_batching.logprob_mb_tokens': 66 is not a multiple of 2 x "
     f"policy.dtensor_cfg.context_parallel_size 2 = 4: {CHUNKS}"),
    (MCP + ["policy.dynamic_batching.enabled=true", "policy.dynamic_batching.sequence_length_round=2"],
     "config key 'policy.dynamic_batching.sequence_length_round': 2 is not a multiple of 2 x "
     f"policy.megatron_cfg.context_parallel_size 2 = 4: {CHUNKS}"),
    (MCP + ["policy.megatron_cfg.attention_backend=unfused"],
     "config key 'policy.megatron_cfg.attention_backend': 'unfused' with policy.megatron_cfg.context_parallel_size "
     "2: context parallelism is built in the SDPA core attention only; use sdpa"),
    (MCP + ["policy.megatron_cfg.layer_spec=transformer_engine"],
     "config key 'policy.megatron_cfg.layer_spec': 'transformer_engine' with "
     "policy.megatron_cfg.context_parallel_size 2: Transformer Engine's own context parallelism is not wired; "
     "use local"),
    (["policy.backend=megatron", "policy.megatron_cfg.context_parallel_size=4"],  # 4 ranks do not fit in 2
     "config key 'policy.megatron_cfg.context_parallel_size': tensor_model_parallel_size 1 x "
     "pipeline_model_parallel_size 1 x context_parallel_size 4 = 4 does not divide world size 2"),
    (["policy.dtensor_cfg.context_parallel_size=4"],
     "config key 'policy.dtensor_cfg.context_parallel_size': tensor_parallel_size 1 x context_parallel_size 4 = "
     "4 does not divide world size 2"),
    (DCP + ["policy.dtensor_cfg.data_parallel_size=2"],
     "config key 'policy.dtensor_cfg.data_parallel_size': data_parallel_size 2 x tensor_parallel_size 1 x "
     "context_parallel_size 2 = 4 != world size 2"),
]


@pytest.mark.parametrize("overrides,message", CP_BAD, ids=[m.split("'")[1] + "-" + o[-1] for o, m in CP_BAD])
def test_context_parallel_rules_name_the_keys_and_numbers(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message)


@pytest.mark.parametrize("cp", [MCP, DCP], ids=["megatron", "dtensor"])
def test_context_parallel_of_2_fits_the_tiny_recipe_with_derived_budgets(cp):
    """CP 2 on the tiny recipe's 2 ranks: max_total_sequence_length 16 = 4 chunks of 4; packing's unset budgets
    are derived (rows x 16) before they are checked, and sequence_length_round is set to a multiple of 4."""
    cfg = load_config(None, cp + ["policy.sequence_packing.enabled=true",
                                  "policy.sequence_packing.sequence_length_round=8"])
    sp = cfg.policy.sequence_packing
    assert (sp.train_mb_tokens, sp.logprob_mb_tokens) == (cfg.policy.train_micro_batch_size * 16,
                                                          cfg.policy.logprob_batch_size * 16)
    from nemo_grpo.validation import layout_of

    assert (layout_of(cfg).cp, layout_of(cfg).dp) == (2, 1)


def test_context_parallel_of_an_inactive_back_end_is_not_checked_against_the_rows():
    """The DTensor back end's CP rules are not applied to a Megatron run (and the other way round)."""
    load_config(None, ["policy.backend=megatron", "policy.dtensor_cfg.context_parallel_size=2",
                       "policy.max_total_sequence_length=18", "data.max_input_seq_length=8"])
    with pytest.raises(ConfigError, match="'policy.dtensor_cfg.context_parallel_size': the context parallel size "
                                          "must be >= 1, got 0"):
        load_config(None, ["policy.backend=megatron", "policy.dtensor_cfg.context_parallel_size=0"])


def test_reward_model_context_parallel_checks_its_max_model_len():
    recipe = os.path.join(ROOT, "configs", "grpo_rm_tiny_cpu.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(recipe, ["env.reward_model.dtensor_cfg.context_parallel_size=2",
                             "env.reward_model.max_model_len=18"], files=False)
    assert str(e.value) == ("config key 'env.reward_model.max_model_len': 18 is not a multiple of 2 x "
                            f"env.reward_model.dtensor_cfg.context_parallel_size 2 = 4: {CHUNKS}")
    with pytest.raises(ConfigError, match="'env.reward_model.dtensor_cfg.context_parallel_size': tensor_parallel_size "
                                          "1 x context_parallel_size 2 = 2 does not divide the reward model's 1 "
                                          "devices"):
        load_config(recipe, ["env.reward_model.dtensor_cfg.context_parallel_size=2"], files=False)
