"""`python -m nemo_grpo.eval`'s bad input: one line on stderr naming the config key, exit status 2, before Ray or
any model starts (tests/unit/conftest.py refuses them). Run in this process as the user would (`main(argv)`)."""

import json
import os

import pytest
from test_bad_input import ROOT, one_error_line

from nemo_grpo.validation import load_eval_config


@pytest.fixture
def evaluate(tmp_path, capsys, monkeypatch, user_console):
    """evaluate(*overrides) -> the one error line of `python -m nemo_grpo.eval ...` (outputs under tmp_path)."""
    from nemo_grpo.eval import main

    monkeypatch.setenv("NEMO_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.chdir(ROOT)

    def run(*overrides) -> str:
        capsys.readouterr()
        return one_error_line(main([f"eval.save_path={tmp_path}/eval", *overrides]), capsys)

    return run


def checkpoint(root, step: int, policy: bool = True):
    """A finalized-looking step_N: training_info.json, config.yaml, policy/ (empty), no manifest (old format)."""
    path = root / f"step_{step}"
    path.mkdir(parents=True)
    (path / "training_info.json").write_text(json.dumps({"step": step}))
    (path / "config.yaml").write_text("policy: {model_name: 'builtin:tiny-addition'}\n")
    if policy:
        (path / "policy").mkdir()
    return str(path)


def test_missing_model_names_the_key(evaluate, tmp_path):
    line = evaluate(f"policy.model_name={tmp_path}/nope")
    assert line.startswith("error: config key 'policy.model_name':") and f"{tmp_path}/nope" in line


def test_checkpoint_without_policy_names_the_key(evaluate, tmp_path):
    path = checkpoint(tmp_path / "ckpt", 5, policy=False)
    line = evaluate(f"policy.model_name={path}")
    assert line == (f"error: config key 'policy.model_name': '{path}' is a training checkpoint without its policy "
                    "(policy/ is missing)")


def test_checkpoint_whose_config_is_not_a_run_config_names_the_key(evaluate, tmp_path):
    path = checkpoint(tmp_path / "ckpt", 5)
    with open(os.path.join(path, "config.yaml"), "a") as f:
        f.write("grpo: {no_such_key: 1}\n")
    line = evaluate(f"policy.model_name={path}")
    assert line.startswith(f"error: config key 'policy.model_name': the run's config in checkpoint '{path}'")
    assert "grpo.no_such_key" in line


def test_checkpoint_directory_asks_for_one_of_its_steps(evaluate, tmp_path):
    for step in (20, 100):
        checkpoint(tmp_path / "ckpt", step)
    line = evaluate(f"policy.model_name={tmp_path}/ckpt")
    assert "config key 'policy.model_name'" in line and line.endswith(f"e.g. {tmp_path}/ckpt/step_100")


def test_complete_checkpoint_passes_validation(tmp_path):
    path = checkpoint(tmp_path / "ckpt", 7)
    assert load_eval_config(None, [f"policy.model_name={path}"]).policy.model_name == path


def test_k_above_num_tests_per_prompt_names_the_key(evaluate):
    line = evaluate("eval.num_tests_per_prompt=2", "eval.k_value=4")
    assert line.startswith("error: config key 'eval.k_value': 4 > eval.num_tests_per_prompt (2)")


def test_empty_dataset_names_the_key(evaluate, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    line = evaluate("data.dataset_name=ResponseDataset", f"data.data_path={empty}")
    assert "config key 'data.data_path'" in line and "no rows" in line and str(empty) in line


@pytest.mark.parametrize("override, key", [
    ("eval.metric=avg@k", "eval.metric"),  # lists pass@k, cons@k
    ("policy.generation.temperature=-1", "policy.generation.temperature"),
    ("eval.num_tests_per_prompt=0", "eval.num_tests_per_prompt"),
    ("data.env_name=nope", "data.env_name"),
    ("policy.generation.max_new_tokens=64", "policy.max_total_sequence_length"),
])
def test_bad_keys_are_named(evaluate, override, key):
    assert evaluate(override).startswith(f"error: config key '{key}'")


def test_defaults_are_nemo_rl_s_and_greedy():
    cfg = load_eval_config()
    e = cfg.eval
    assert (e.metric, e.num_tests_per_prompt, e.k_value, e.seed) == ("pass@k", 1, 1, 42)
    assert cfg.policy.generation.temperature == 0.0  # greedy, as NeMo RL's eval.yaml
    assert os.path.isfile(os.path.join(ROOT, "configs", "eval_tiny_cpu.yaml"))
    assert load_eval_config(os.path.join(ROOT, "configs", "eval_tiny_cpu.yaml")).eval.k_value >= 1


def test_eval_runs_an_engine_replica_per_tp_group_of_every_cluster_device():
    from nemo_grpo.build import eval_replicas
    from nemo_grpo.config import ConfigError

    path = os.path.join(ROOT, "configs", "eval_tiny_cpu.yaml")
    assert eval_replicas(load_eval_config(path, [])) == 1
    assert eval_replicas(load_eval_config(path, ["cluster.gpus_per_node=8", "cluster.num_nodes=2",
                                                 "policy.generation.vllm_cfg.tensor_parallel_size=4"])) == 4
    with pytest.raises(ConfigError, match=r"'policy.generation.vllm_cfg.tensor_parallel_size': 3 does not divide the "
                                          r"8 devices per node of the cluster \(cluster.gpus_per_node\)"):
        eval_replicas(load_eval_config(path, ["cluster.gpus_per_node=8",
                                              "policy.generation.vllm_cfg.tensor_parallel_size=3"]))
    assert eval_replicas(load_eval_config(path, ["cluster.gpus_per_node=8", "policy.generation.num_replicas=2"])) == 2
    with pytest.raises(ConfigError, match=r"'policy.generation.num_replicas': 9 > the 8 replicas"):
        eval_replicas(load_eval_config(path, ["cluster.gpus_per_node=8", "policy.generation.num_replicas=9"]))
