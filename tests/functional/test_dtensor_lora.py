"""LoRA on the DTensor back end (peft's adapters under FSDP2 + TP) against peft on the single-process HF model;
the adapter directory and the merged export load in peft / transformers; checkpoints resume exactly."""

import peft
import pytest
import torch
from lora_checks import adapter_diff, check_lora_step, lora_policy_config
from policy_checks import CLUSTER, TokenPGLoss, hf_logprobs, load_hf, make_batch

from nemo_grpo.errors import ConfigError
from nemo_grpo.models import lora
from nemo_grpo.policy import Policy
from nemo_grpo.validation import validate_policy



def dtensor_lora_policy(path: str, cluster=CLUSTER, **overrides) -> Policy:
    return Policy(lora_policy_config(path, "dtensor", **overrides), cluster, path, init_reference=True)


LAYOUTS = {"dp2_recompute": {"dtensor_cfg.activation_checkpointing": True},
           "tp2": {"dtensor_cfg.tensor_parallel_size": 2}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dtensor_lora_step_matches_peft(ray_cluster, tiny_model_dir, layout):
    """Qwen3 (GQA, q/k norms): FSDP2 over 2 ranks with activation checkpointing, and TP=2."""
    path = tiny_model_dir("qwen3", num_key_value_heads=2)
    with dtensor_lora_policy(path, **LAYOUTS[layout]) as policy:
        check_lora_step(policy, path, make_batch(8, seed=3))


@pytest.fixture(scope="module")
def trained_lora(ray_cluster, tiny_model_dir):
    """A DP=2 LoRA policy (llama: GQA, untied) after one train call, with its model path and batch."""
    path = tiny_model_dir("llama", num_key_value_heads=2, tie_word_embeddings=False)
    batch = make_batch(8, seed=5)
    policy = dtensor_lora_policy(path)
    policy.train(batch, TokenPGLoss())
    yield policy, path, batch
    policy.shutdown()


def test_adapter_dir_loads_in_peft(trained_lora, tmp_path):
    policy, path, batch = trained_lora
    policy.save_adapter(str(tmp_path / "adapter"))
    model = peft.PeftModel.from_pretrained(load_hf(path), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want = hf_logprobs(model, batch)
    assert (policy.get_logprobs(batch) - want).abs().max().item() <= 1e-5
    with torch.no_grad():  # (the adapters are not zero: peft's model is not the base model)
        assert (hf_logprobs(load_hf(path).eval(), batch) - want).abs().max().item() > 1e-3


def test_merged_dir_loads_in_hf(trained_lora, tmp_path):
    policy, path, batch = trained_lora
    policy.save_pretrained(str(tmp_path / "hf"))
    with torch.no_grad():
        want = hf_logprobs(load_hf(str(tmp_path / "hf")).eval(), batch)
    assert (policy.get_logprobs(batch) - want).abs().max().item() <= 1e-5


def test_checkpoint_holds_adapters_and_resumes_exactly(trained_lora, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    policy, path, batch = trained_lora
    policy.save_checkpoint(str(tmp_path / "ckpt"))
    saved = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    assert any(".lora_A." in k for k in saved) and not any("base_layer" in k or "embed" in k for k in saved)
    policy.train(batch, TokenPGLoss())
    after_two = policy.adapter_state()
    policy.load_checkpoint(str(tmp_path / "ckpt"))
    policy.train(batch, TokenPGLoss())
    assert adapter_diff(policy.adapter_state(), after_two) == 0.0


@pytest.mark.parametrize("key, value, message", [
    ("target_modules", ["q_proj", "qkv_proj"], "'qkv_proj' matches no linear layer of the model; its linear "
                                                "layers are: q_proj, k_proj"),
    ("exclude_modules", list(lora.LINEAR_LAYERS), "excludes every target"),
    ("rank", 0, "must be > 0")])
def test_bad_lora_config_names_the_key(key, value, message):
    cfg = lora_policy_config("builtin:tiny-addition", **{f"lora.{key}": value})
    with pytest.raises(ConfigError, match=f"policy.lora.{key}'.*{message}"):
        validate_policy(cfg, files=False)
