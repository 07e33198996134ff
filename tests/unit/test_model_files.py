"""A model directory that is not a model (no config.json, no weights, a safetensors file cut short, a shard
missing) is a ConfigError naming the key, the directory and the flaw, raised while the config is validated."""

import json
import os
import shutil

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from nemo_grpo.config import PolicyConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.models.files import check_model_dir, model_dir_problem
from nemo_grpo.validation import load_config, load_rm_eval_config, load_rm_train_config, validate_model_layout


@pytest.fixture
def model_dir(tiny_model_dir, tmp_path):
    """A copy of the session's tiny model that a test may damage: config.json, model.safetensors, tokenizer."""
    return shutil.copytree(tiny_model_dir("qwen2"), tmp_path / "model")


@pytest.fixture
def sharded_dir(tiny_model_dir, tmp_path):
    """config.json, model.safetensors.index.json and two shards (what save_pretrained writes for a big model)."""
    path = tmp_path / "sharded"
    path.mkdir()
    shutil.copy(os.path.join(tiny_model_dir("qwen2"), "config.json"), path)
    weight_map = {}
    for i, names in enumerate((["a", "b"], ["c"]), 1):
        shard = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: torch.full((4, 4), float(i)) for n in names}, str(path / shard))
        weight_map.update({n: shard for n in names})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _truncate(path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def test_a_whole_model_directory_passes(model_dir, sharded_dir):
    assert model_dir_problem(str(model_dir)) is None and model_dir_problem(str(sharded_dir)) is None
    check_model_dir(str(model_dir), "policy.model_name")


def test_a_directory_without_config_json_names_key_and_directory(model_dir):
    os.remove(model_dir / "config.json")
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"policy.model_name={model_dir}"])
    assert str(e.value) == (f"config key 'policy.model_name': model directory {model_dir} has no config.json: "
                            "not a Hugging Face model directory")


def test_a_truncated_safetensors_file_is_found_from_its_header(model_dir):
    weights = model_dir / "model.safetensors"
    size = os.path.getsize(weights)
    _truncate(weights, size - 100)  # the data is cut short: the header still reads
    with pytest.raises(SafetensorError):  # what loading it would have raised
        safe_open(str(weights), framework="pt")
    with pytest.raises(ConfigError, match=rf"config key 'policy.model_name': model directory {model_dir}: "
                                          rf"model.safetensors: {size - 100} bytes, its header says {size} "):
        load_config(None, [f"policy.model_name={model_dir}"])
    _truncate(weights, 1000)  # cut inside the header: safetensors' "invalid header length"
    with pytest.raises(ConfigError, match=r"model.safetensors: 1000 bytes, its header alone claims \d+"):
        check_model_dir(str(model_dir), "policy.model_name")


def test_no_weights_or_a_config_that_is_not_json(model_dir):
    (model_dir / "config.json").write_text('{"model_type": "qw')
    assert model_dir_problem(str(model_dir)).startswith("config.json is not valid JSON")
    shutil.copy(model_dir / "tokenizer_config.json", model_dir / "config.json")
    os.remove(model_dir / "model.safetensors")
    assert model_dir_problem(str(model_dir)) == \
        "has no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"


def test_sharded_checkpoints_check_every_shard_the_index_names(sharded_dir):
    second = sharded_dir / "model-00002-of-00002.safetensors"
    _truncate(second, os.path.getsize(second) - 1)
    assert model_dir_problem(str(sharded_dir)).startswith("model-00002-of-00002.safetensors: ")
    os.remove(second)
    assert model_dir_problem(str(sharded_dir)) == \
        "model-00002-of-00002.safetensors is missing (named by model.safetensors.index.json)"
    index = sharded_dir / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    index.write_text(json.dumps({"weight_map": dict(weight_map, c="model-00001-of-00002.safetensors")}))
    assert model_dir_problem(str(sharded_dir)) == ("model-00001-of-00002.safetensors lacks 1 tensor(s) that "
                                                   "model.safetensors.index.json puts there, e.g. 'c'")


def test_the_reward_model_keys_are_named(tiny_model_dir, tmp_path):
    rm = shutil.copytree(tiny_model_dir("qwen2", scalar_head=True), tmp_path / "rm")
    os.remove(rm / "config.json")
    grpo = [f"env.reward_model.model_name={rm}", "env.reward_model.resources.gpus_per_node=1",
            "cluster.gpus_per_node=2", "data.train.env_name=reward_model"]
    with pytest.raises(ConfigError, match=f"config key 'env.reward_model.model_name': model directory {rm} has no "
                                          "config.json"):
        load_config(None, grpo)
    with pytest.raises(ConfigError, match=f"config key 'reward_model.model_name': model directory {rm} has no"):
        load_rm_eval_config(None, [f"reward_model.model_name={rm}", "data_path=builtin:addition"])
    with pytest.raises(ConfigError, match=f"config key 'policy.model_name': model directory {rm} has no"):
        load_rm_train_config(None, [f"policy.model_name={rm}", "data.train_data_path=builtin:addition"])


def test_a_config_transformers_cannot_read_names_the_key(model_dir):
    (model_dir / "config.json").write_text("{}")  # no model_type: transformers' "Unrecognized model in ..."
    with pytest.raises(ConfigError, match=f"config key 'policy.model_name': {model_dir} has no config "
                                          "transformers can read: Unrecognized model"):
        validate_model_layout(PolicyConfig(model_name=str(model_dir)), str(model_dir))
