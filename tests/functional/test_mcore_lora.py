"""LoRA on the Megatron-Core back end against peft on the single-process HF model (lora_checks.py).

One train call (two optimizer steps) from the policy's initial adapters: adapters, metrics, log-probs, the reference
(base) log-probs and the merged export agree with peft's, at TP=2 with sequence parallelism (fused q/k/v and
gate/up adapters in Megatron's local layouts, r-wide TP communication, SP-partial gradients summed), at PP=2 with
a target subset on a tied model, at DP=2 with Megatron's distributed optimizer and full activation recompute, and
at TP=2 without SP with excluded modules. A checkpoint holds the adapters and their Adam moments only; it resumes
at TP=1 and at each layout. At most two worker processes.
"""

import peft
import pytest
import torch
from lora_checks import adapter_diff, check_lora_step, lora_policy_config, peft_model, sampled_vs_teacher
from policy_checks import CLUSTER, TokenPGLoss, check_checkpoint_resumes, hf_logprobs, load_hf, make_batch
from test_mcore_policy import LAYOUTS, MODELS

from nemo_grpo.config import ClusterConfig, PolicyConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.generation.torch_engine import TorchGeneration
from nemo_grpo.models import lora
from nemo_grpo.policy import Policy
from nemo_grpo.validation import validate_policy
from nemo_grpo.weights.refit import make_refitter

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def lora_policy(path: str, layout: str, init_reference: bool = False, **overrides) -> Policy:
    cluster, layout_overrides = LAYOUTS[layout]
    cfg = lora_policy_config(path, backend="megatron", **layout_overrides, **overrides)
    return Policy(cfg, cluster, path, init_reference=init_reference)


# ---------------------------------------------------------------------------------------------- TP=2 + SP
@pytest.fixture(scope="class")
def tp_qwen3(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen3", num_attention_heads=8, num_key_value_heads=4)
    policy = lora_policy(path, "tp2_sp", init_reference=True, train_micro_batch_size=2)
    yield policy, path
    policy.shutdown()


class TestTensorParallel:
    """tp=2 with sequence parallelism, qwen3 (GQA, 2 query heads per KV group, 2 groups per TP rank: the q, k, v
    adapters' rows interleave per group in linear_qkv's local layout), every linear layer adapted."""

    def test_step_matches_peft(self, tp_qwen3):
        check_lora_step(*tp_qwen3, make_batch(8, seed=1, t=11))  # odd t: SP pads a column

    def test_checkpoint_resumes_at_tp1(self, tp_qwen3, tmp_path):
        policy, path = tp_qwen3
        check_checkpoint_resumes(policy, lambda: lora_policy(path, "tp1", train_micro_batch_size=2),
                                 make_batch(4, seed=3), str(tmp_path / "ckpt"), state=Policy.adapter_state)

    def test_adapter_refit_into_the_torch_engine_samples_as_peft(self, tp_qwen3):
        """policy.lora.refit=adapters from Megatron (adapters gathered over TP to rank 0, written into the shared
        region): after a refit, a train call and a refit, the engine samples with peft's teacher-forced
        log-probs and each refit moved the adapters' bytes."""
        policy, path = tp_qwen3
        cluster = ClusterConfig(num_threads_per_worker=1)
        engine = TorchGeneration(policy.cfg.generation, path, cluster, lora_cfg=policy.cfg.lora)
        try:
            refitter = make_refitter(policy, engine, policy.cfg.generation)
            stats = [refitter.refit()]
            policy.train(make_batch(8, seed=6), TokenPGLoss())
            stats.append(refitter.refit())
            refitter.close()
            outs = engine.generate(PROMPTS, seed=4)
        finally:
            engine.shutdown()
        adapters = policy.adapter_state()
        assert [s["bytes"] for s in stats] == [sum(t.numel() for t in adapters.values()) * 4] * 2, stats
        reference = peft_model(path, adapters, policy.cfg.lora).eval()
        error = sampled_vs_teacher(PROMPTS, outs, reference, policy.cfg.generation.temperature)
        print(f"Megatron LoRA adapter refit: max |engine - peft| {error:.2e}")
        assert error <= 1e-4

    def test_adapter_directory_loads_in_peft(self, tp_qwen3, tmp_path):
        policy, path = tp_qwen3
        policy.save_adapter(str(tmp_path / "adapter"))
        model = peft.PeftModel.from_pretrained(load_hf(path), str(tmp_path / "adapter")).eval()
        batch = make_batch(3, seed=4)
        with torch.no_grad():
            assert (policy.get_logprobs(batch) - hf_logprobs(model, batch)).abs().max().item() <= 1e-5


# ---------------------------------------------------------------------------------------------- PP=2, DP=2
@pytest.mark.parametrize("arch,layout,overrides", [
    ("qwen2", "pp2", {"lora.target_modules": ["q_proj", "v_proj"]}),  # tied embedding frozen; qkv bias
    ("llama", "dp2_zero", {"megatron_cfg.activation_checkpointing": True}),
    ("llama", "tp2", {"lora.exclude_modules": ["q_proj", "up_proj"]}),  # TP without SP: all-reduced u
])
def test_step_matches_peft_and_resumes(ray_cluster, tiny_model_dir, tmp_path, arch, layout, overrides):
    """PP=2 (1F1B over 4 micro-batches) adapting q and v only (linear_qkv's k rows stay the base's); DP=2 with
    Megatron's DistributedDataParallel + DistributedOptimizer over the adapters only, every layer recomputed;
    TP=2 without sequence parallelism, k and v adapted in linear_qkv, gate only in linear_fc1.
    Then a checkpoint (adapters from both stages / Adam moments from the DP shards) restores the next step."""
    path = tiny_model_dir(arch, **MODELS[arch])
    batch, ckpt = make_batch(4, seed=6), str(tmp_path / "ckpt")
    with lora_policy(path, layout, init_reference=True, **overrides) as policy:
        check_lora_step(policy, path, make_batch(8, seed=5))
        targets = lora.target_modules(policy.cfg.lora)
        assert {k.split(".")[-3] for k in policy.adapter_state()} == set(targets)
        policy.save_checkpoint(ckpt)
        policy.train(batch, TokenPGLoss())
        after_lp, after_adapters = policy.get_logprobs(batch), policy.adapter_state()
        policy.train(batch, TokenPGLoss())
        policy.load_checkpoint(ckpt)
        policy.train(batch, TokenPGLoss())
        assert adapter_diff(policy.adapter_state(), after_adapters) <= 1e-6
        assert (policy.get_logprobs(batch) - after_lp).abs().max().item() <= 1e-6


def test_same_adapters_and_results_as_dtensor(ray_cluster, tiny_model_dir):
    """The same seed gives DTensor's peft adapters the same A (models/lora.py initial_a); one train call from
    there on DTensor (DP=2) and on Megatron (TP=2 + SP) lands on the same adapters and log-probs, within 1e-5."""
    path = tiny_model_dir("qwen3", num_attention_heads=8, num_key_value_heads=4)
    batch, results = make_batch(8, seed=7), {}
    for backend in ("dtensor", "megatron"):
        cfg = lora_policy_config(path, backend, **(LAYOUTS["tp2_sp"][1] if backend == "megatron" else {}))
        with Policy(cfg, CLUSTER, path) as policy:
            start = policy.adapter_state()
            policy.train(batch, TokenPGLoss())
            results[backend] = start, policy.adapter_state(), policy.get_logprobs(batch)
    (start_d, after_d, lp_d), (start_m, after_m, lp_m) = results["dtensor"], results["megatron"]
    assert adapter_diff(start_d, start_m) == 0.0
    errors = adapter_diff(after_d, after_m), (lp_d - lp_m).abs().max().item()
    print(f"Megatron TP=2+SP vs DTensor DP=2 after a LoRA train call: adapters {errors[0]:.1e}, log-probs "
          f"{errors[1]:.1e}")
    assert max(errors) <= 1e-5, errors


def test_transformer_engine_spec_is_rejected(tiny_model_dir):
    cfg: PolicyConfig = lora_policy_config(tiny_model_dir("qwen2"), backend="megatron",
                                           **{"megatron_cfg.layer_spec": "transformer_engine"})
    with pytest.raises(ConfigError, match="policy.megatron_cfg.layer_spec.*LoRA"):
        validate_policy(cfg, files=False)
