"""The Megatron-Core back end through the Policy front: real Ray actors, gloo, Megatron's own schedules.

Every layout is compared with a single-process Hugging Face model (policy_checks.py): TP=2 with sequence
parallelism, PP=2 (1F1B over 4 micro-batches), DP=2, and TP=1 in one process; Llama (GQA, untied), Qwen2
(qkv bias, tied) and Qwen3 (GQA, q/k norms). At most two worker processes exist at a time.
"""

import os

import pytest
import torch
from policy_checks import (CLUSTER, TokenPGLoss, assert_logprobs_match_hf, assert_scores_match_hf, check_bf16_step,
                           check_checkpoint_resumes, check_on_policy_step, check_train_parity, export_state,
                           hf_logprobs, load_hf, make_batch, max_diff, policy_config, reference_train)

from nemo_grpo.config import ClusterConfig
from nemo_grpo.policy import Policy
from weight_io import export_weights

ONE = ClusterConfig(gpus_per_node=1, num_nodes=1, num_threads_per_worker=1)
MODELS = {"llama": dict(num_key_value_heads=2, tie_word_embeddings=False), "qwen2": {},
          "qwen3": dict(num_key_value_heads=2)}
LAYOUTS = {"tp1": (ONE, {}), "tp2": (CLUSTER, {"megatron_cfg.tensor_model_parallel_size": 2}),
           "tp2_sp": (CLUSTER, {"megatron_cfg.tensor_model_parallel_size": 2, "megatron_cfg.sequence_parallel": True}),
           "pp2": (CLUSTER, {"megatron_cfg.pipeline_model_parallel_size": 2}), "dp2": (CLUSTER, {}),
           "dp2_zero": (CLUSTER, {"megatron_cfg.use_distributed_optimizer": True})}


def megatron_policy(pool, path: str, layout: str, **kwargs):
    """`with megatron_policy(policy_pool, path, "tp2", ...) as policy:` (a started policy reset, or a new one);
    pool=None starts a policy of its own."""
    cluster, overrides = LAYOUTS[layout]
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("scalar_head", "init_reference")}
    cfg = policy_config(path, backend="megatron", **overrides, **extra)
    return Policy(cfg, cluster, path, **kwargs) if pool is None else pool.policy(cfg, cluster, path, **kwargs)


def assert_trained_logprobs_match(policy: Policy, path: str, batch: dict) -> None:
    """One train call; then the policy's log-probs equal those of the single-process reference step, within 3e-5:
    the trained weights agree to 1e-4 (check_train_parity: Adam steps of lr 1e-2 amplify the reductions'
    rounding), which moves log-probs by up to 1.5e-5 (measured at TP=2 with SP; a wrong gradient moves them by
    1e-2 or more)."""
    start = export_state(policy)
    check_train_parity(policy, path, batch)
    ref_state = reference_train(path, start, batch, policy.cfg)[0]
    with torch.no_grad():
        ref = hf_logprobs(load_hf(path, ref_state).eval(), batch)
    assert (policy.get_logprobs(batch) - ref).abs().max().item() <= 3e-5


# ---------------------------------------------------------------------------------------------- TP=2 + SP
@pytest.fixture(scope="class")
def tp_qwen3(ray_cluster, tiny_model_dir):
    path = tiny_model_dir("qwen3", **MODELS["qwen3"])
    policy = megatron_policy(None, path, "tp2_sp", init_reference=True, train_micro_batch_size=2,
                             logprob_batch_size=3)
    yield policy, path
    policy.shutdown()


class TestTensorParallel:
    """tp=2 with sequence parallelism, qwen3 (GQA, q/k norms under TP), 2 micro-batches per step."""

    def test_logprobs_match_hf(self, tp_qwen3):
        assert_logprobs_match_hf(*tp_qwen3, make_batch(5, seed=0))  # t=12 rounds to 12; lengths mixed

    def test_export_round_trip_is_exact(self, tp_qwen3):
        policy, path = tp_qwen3
        hf = load_hf(path).state_dict()
        buckets = list(export_weights(policy, 0.05))
        assert len(buckets) > 3
        merged = {k: v for b in buckets for k, v in b.items()}
        assert set(merged) == set(hf) and all(torch.equal(merged[k], hf[k]) for k in hf)

    def test_train_matches_single_process(self, tp_qwen3):
        policy, path = tp_qwen3
        assert_trained_logprobs_match(policy, path, make_batch(4, seed=1, t=11))  # odd t: SP pads a column

    def test_reference_logprobs_are_initial_weights(self, tp_qwen3):
        policy, path = tp_qwen3
        batch = make_batch(3, seed=2)
        with torch.no_grad():
            ref = hf_logprobs(load_hf(path).eval(), batch)
        assert (policy.get_reference_logprobs(batch) - ref).abs().max().item() <= 1e-5
        assert (policy.get_logprobs(batch) - ref).abs().max().item() > 1e-3  # trained, and swapped back

    def test_checkpoint_resumes_at_tp1(self, tp_qwen3, policy_pool, tmp_path):
        policy, path = tp_qwen3
        check_checkpoint_resumes(policy, lambda: megatron_policy(policy_pool, path, "tp1"),
                                 make_batch(4, seed=3), str(tmp_path / "ckpt"))

    def test_save_pretrained_loads_in_hf(self, tp_qwen3, tmp_path):
        policy, _ = tp_qwen3
        policy.save_pretrained(str(tmp_path / "hf"))
        model = load_hf(str(tmp_path / "hf")).eval()
        assert max_diff(model.state_dict(), export_state(policy)) == 0.0
        assert os.path.isfile(tmp_path / "hf" / "tokenizer.json")


# ---------------------------------------------------------------------------------------------- log-probs
@pytest.mark.parametrize("arch,layout", [("qwen3", "tp1"), ("llama", "tp1"), ("llama", "tp2"), ("llama", "pp2"),
                                         ("qwen2", "tp2"), ("qwen3", "pp2"), ("qwen2", "tp1")])
def test_logprobs_match_hf(policy_pool, tiny_model_dir, arch, layout):
    """5 rows in 3 log-prob micro-batches (the last one short). Ordered for the pool: qwen3 TP=1 is the policy
    the class above resumed its checkpoint on, qwen2 TP=1 the one the pad-token test below trains."""
    path = tiny_model_dir(arch, **MODELS[arch])
    with megatron_policy(policy_pool, path, layout) as policy:
        assert_logprobs_match_hf(policy, path, make_batch(5, seed=6))


# ---------------------------------------------------------------------------------------------- PP=2, DP=2
@pytest.mark.parametrize("layout", ["tp1", "tp2_sp"])
def test_pad_token_inside_the_text_gets_hf_gradients(policy_pool, tiny_model_dir, layout):
    """HF's embedding gives its pad_token_id row no gradient from the input lookup (nn.Embedding padding_idx);
    a model whose pad token is a real token (SmolLM2: pad = EOS = <|im_end|>) must train the same on Megatron,
    with or without sequence parallelism (the embedding output then holds this rank's chunk of the sequence)."""
    path = tiny_model_dir("qwen2")
    batch = make_batch(4, seed=6)
    pad = load_hf(path).config.pad_token_id
    batch["input_ids"][:, 1::2] = torch.where(batch["token_mask"][:, 1::2] > 0, pad, batch["input_ids"][:, 1::2])
    assert (batch["input_ids"] == pad)[batch["token_mask"] > 0].sum() > 4  # trained positions hold the pad token
    with megatron_policy(policy_pool, path, layout) as policy:
        check_train_parity(policy, path, batch)


@pytest.mark.parametrize("arch,layout,recompute", [("qwen2", "pp2", False), ("llama", "dp2", True)])
def test_train_matches_single_process(policy_pool, tiny_model_dir, arch, layout, recompute):
    """PP=2: 4 micro-batches per step through 1F1B, the tied embedding's gradient summed over both stages;
    DP=2 with activation checkpointing (every layer recomputed in the backward pass)."""
    path = tiny_model_dir(arch, **MODELS[arch])
    with megatron_policy(policy_pool, path, layout, **{"megatron_cfg.activation_checkpointing": recompute}) as policy:
        assert_logprobs_match_hf(policy, path, make_batch(5, seed=4))
        assert_trained_logprobs_match(policy, path, make_batch(4, seed=5))
        merged = export_state(policy)
        assert set(merged) == set(load_hf(path).state_dict())


@pytest.mark.parametrize("arch,layout", [("llama", "tp2"), ("qwen2", "pp2")])
def test_on_policy_step_equals_the_separate_logprob_pass(policy_pool, tiny_model_dir, arch, layout):
    """TP=2; PP=2 (the log-probs off the last stage, 4 micro-batches through 1F1B): policies the tests above
    started."""
    path = tiny_model_dir(arch, **MODELS[arch])
    with megatron_policy(policy_pool, path, layout) as policy:
        check_on_policy_step(policy, policy_pool.reset, make_batch(4, seed=6))


# ---------------------------------------------------------------------------------------------- distributed optimizer
FOUR = ClusterConfig(gpus_per_node=4, num_nodes=1, num_threads_per_worker=1)
DISTOPT = {"megatron_cfg.use_distributed_optimizer": True}  # distributed_data_parallel_config.overlap_grad_reduce on


def test_distributed_optimizer_step_and_checkpoint(policy_pool, tiny_model_dir, tmp_path):
    """Megatron-Core's DistributedDataParallel (gradient buckets reduce-scattered over DP while the backward runs)
    and DistributedOptimizer (main weights and Adam moments of each DP rank's shard) at TP=2 with SP x DP=2 on
    Qwen3 (q/k norms and SP norms summed over TP): the single-process step; its checkpoint (moments gathered from
    the shards) resumes at TP=1 in one process and takes the same next step."""
    path = tiny_model_dir("qwen3", **MODELS["qwen3"])
    batch, ckpt = make_batch(4, seed=9), str(tmp_path / "ckpt")
    overrides = {"megatron_cfg.tensor_model_parallel_size": 2, "megatron_cfg.sequence_parallel": True, **DISTOPT}
    with policy_pool.policy(policy_config(path, backend="megatron", **overrides), FOUR, path) as policy:
        assert_trained_logprobs_match(policy, path, batch)
        policy.save_checkpoint(ckpt)
        saved_lp = policy.get_logprobs(batch)
        policy.train(batch, TokenPGLoss())
        after_lp = policy.get_logprobs(batch)
    with megatron_policy(policy_pool, path, "tp1") as single:
        single.load_checkpoint(ckpt)
        assert (single.get_logprobs(batch) - saved_lp).abs().max().item() <= 1e-5
        single.train(batch, TokenPGLoss())
        assert (single.get_logprobs(batch) - after_lp).abs().max().item() <= 1e-5


def test_distributed_optimizer_bf16_pipeline(policy_pool, tiny_model_dir):
    """bf16 parameters with the distributed optimizer's fp32 main shards, made from the checkpoint's fp32
    tensors (exported exactly), at PP=2 x DP=2 (1F1B, the DP reduction started after the last micro-batch)."""
    path = tiny_model_dir("llama", **MODELS["llama"])
    overrides = {"megatron_cfg.pipeline_model_parallel_size": 2, "precision": "bfloat16", **DISTOPT}
    with policy_pool.policy(policy_config(path, backend="megatron", **overrides), FOUR, path) as policy:
        assert max_diff(export_state(policy), load_hf(path).state_dict()) == 0.0
        check_bf16_step(policy, path, make_batch(4, seed=10))


def test_step_matches_dtensor(policy_pool, tiny_model_dir):
    """The same weights and batch, one step on each back end (Megatron TP=2, DTensor FSDP2 dp=2)."""
    path = tiny_model_dir("qwen3", **MODELS["qwen3"])
    batch = make_batch(4, seed=7)
    with policy_pool.policy(policy_config(path), CLUSTER, path) as dtensor:
        dtensor.train(batch, TokenPGLoss())
        dtensor_lp = dtensor.get_logprobs(batch)
    with megatron_policy(policy_pool, path, "tp2") as megatron:
        megatron.train(batch, TokenPGLoss())
        megatron_lp = megatron.get_logprobs(batch)
    assert (megatron_lp - dtensor_lp).abs().max().item() <= 1e-5


@pytest.mark.parametrize("layout", ["tp1", "tp2_sp", "pp2"])
def test_score_matches_sequence_classifier(policy_pool, tiny_model_dir, layout):
    path = tiny_model_dir("qwen3", scalar_head=True, **MODELS["qwen3"])
    batch = make_batch(5, seed=8)  # right-padded, mixed lengths; no real token is the pad id
    with megatron_policy(policy_pool, path, layout, scalar_head=True) as policy:
        assert_scores_match_hf(policy, path, batch)


@pytest.mark.parametrize("layout", ["tp2_sp", "pp2"])
def test_bf16_step_stays_close_to_fp32(policy_pool, tiny_model_dir, layout):
    """bf16 parameters and activations (pipeline p2p in bf16 under PP), fp32 masters and gradient accumulation."""
    path = tiny_model_dir("qwen2")
    with megatron_policy(policy_pool, path, layout, precision="bfloat16") as policy:
        check_bf16_step(policy, path, make_batch(4, seed=9))


def test_bad_layout_fails_before_start(tiny_model_dir):
    path = tiny_model_dir("qwen2")
    with pytest.raises(ValueError, match="policy.megatron_cfg.tensor_model_parallel_size"):
        megatron_policy(None, path, "tp2", **{"megatron_cfg.pipeline_model_parallel_size": 2})
