"""SDPA core attention (policy.megatron_cfg.attention_backend=sdpa, the default) against Megatron's unfused
DotProductAttention, through the Policy: the same log-probs and the same gradient (one SGD step of lr 1 without
clipping: the step is the gradient) within 1e-5, on a GQA Llama (4 heads, 2 KV groups: 1 group per TP rank), on
padded rows (causal) and packed rows (the block-diagonal mask), under TP=2 with sequence parallelism and PP=2.
The rest of the Megatron suite runs SDPA against Hugging Face.
"""

import pytest
from policy_checks import TokenPGLoss, export_state, make_batch
from test_mcore_policy import MODELS, megatron_policy


def logprobs_and_gradient(path: str, layout: str, attention: str, batch: dict, packed: bool):
    """(log-probs [B, T], {name: gradient}) of one policy: w_before - w_after of an SGD step of lr 1."""
    extra = {"megatron_cfg.attention_backend": attention, "sequence_packing.enabled": packed,
             "optimizer.name": "sgd", "optimizer.lr": 1.0, "optimizer.warmup_steps": 0, "max_grad_norm": None}
    if packed:
        extra.update({"sequence_packing.train_mb_tokens": 64, "sequence_packing.logprob_mb_tokens": 64})
    with megatron_policy(None, path, layout, logprob_batch_size=4, **extra) as policy:
        lp = policy.get_logprobs(batch)
        before = export_state(policy)
        policy.train(batch, TokenPGLoss())
        after = export_state(policy)
    return lp, {k: before[k] - after[k] for k in before}


@pytest.mark.parametrize("layout,packed", [("tp2_sp", False), ("pp2", True)])
def test_sdpa_matches_unfused(ray_cluster, tiny_model_dir, layout, packed):
    path = tiny_model_dir("llama", **MODELS["llama"])
    batch = make_batch(4, seed=21, t=24)
    lp_sdpa, grad_sdpa = logprobs_and_gradient(path, layout, "sdpa", batch, packed)
    lp_unfused, grad_unfused = logprobs_and_gradient(path, layout, "unfused", batch, packed)
    lp_error = (lp_sdpa - lp_unfused).abs().max().item()
    grad_error = max((grad_sdpa[k] - grad_unfused[k]).abs().max().item() for k in grad_sdpa)
    print(f"SDPA vs unfused, {layout}{' packed' if packed else ''}: log-probs {lp_error:.1e}, "
          f"gradients {grad_error:.1e}")
    assert lp_error <= 1e-5
    assert max(grad_unfused[k].abs().max().item() for k in grad_unfused) > 1e-3  # a real gradient
    assert grad_error <= 1e-5
