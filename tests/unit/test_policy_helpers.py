"""Pure helpers of the Policy front and the PolicyWorker base (no Ray, no process group)."""

import pytest
import torch
import torch.nn.functional as F

from nemo_grpo.backends.base import (attention_mask_from_lengths, lr_warmup_factor, plan_buckets, slice_batch,
                                     split_sizes, token_logprobs_from_logits)
from nemo_grpo.backends.dtensor.parallelize import clip_grad_norm_
from nemo_grpo.backends.dtensor.worker import DTensorPolicyWorker
from nemo_grpo.config import ClusterConfig, PolicyConfig
from nemo_grpo.policy import Policy, _pad_rows


def test_split_sizes_even_and_contiguous():
    assert split_sizes(5, 2) == [3, 2]
    assert split_sizes(1, 3) == [1, 0, 0]
    for n in range(12):
        sizes = split_sizes(n, 4)
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


def test_slice_batch_slices_per_sample_entries_only():
    batch = {"input_ids": torch.arange(12).view(4, 3), "text": list("abcd"), "scalar": torch.tensor(7.0),
             "other": 3, "rows_mismatch": torch.zeros(2)}
    out = slice_batch(batch, 1, 3)
    assert torch.equal(out["input_ids"], torch.tensor([[3, 4, 5], [6, 7, 8]]))
    assert out["text"] == ["b", "c"]
    assert out["scalar"] is batch["scalar"] and out["other"] == 3 and out["rows_mismatch"] is batch["rows_mismatch"]


def test_pad_rows_repeats_filler_row():
    shard = {"input_ids": torch.tensor([[5, 6]]), "input_lengths": torch.tensor([2])}
    filler = {"input_ids": torch.tensor([[1, 0]]), "input_lengths": torch.tensor([1])}
    out = _pad_rows(shard, 3, filler)
    assert out["input_ids"].tolist() == [[5, 6], [1, 0], [1, 0]] and out["input_lengths"].tolist() == [2, 1, 1]


def test_token_logprobs_match_cross_entropy():
    torch.manual_seed(0)
    B, T, V, temp = 3, 6, 11, 0.7
    logits, ids = torch.randn(B, T, V), torch.randint(0, V, (B, T))
    lengths = torch.tensor([6, 4, 1])
    mask = attention_mask_from_lengths(lengths, T)
    lp = token_logprobs_from_logits(logits, ids, mask, temp)
    ce = -F.cross_entropy((logits[:, :-1] / temp).reshape(-1, V), ids[:, 1:].reshape(-1), reduction="none")
    expected = torch.cat([torch.zeros(B, 1), ce.view(B, T - 1)], 1) * mask
    assert torch.allclose(lp, expected, atol=1e-6)
    assert (lp[:, 0] == 0).all() and (lp[1, 4:] == 0).all() and (lp[2] == 0).all()


def test_attention_mask_from_lengths():
    assert attention_mask_from_lengths(torch.tensor([2, 0, 3]), 3).tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]


def test_plan_buckets_respects_limit_and_order():
    sizes = [("a", 4), ("b", 4), ("c", 10), ("d", 1), ("e", 1)]
    assert plan_buckets(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]  # "c" alone exceeds the limit: own bucket
    assert plan_buckets(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert plan_buckets([], 8) == []


def test_lr_warmup_factor():
    f = lr_warmup_factor(4)
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_warmup_factor(0)(0) == 1.0


@pytest.mark.parametrize("max_norm", [None, 0.5, 100.0])
def test_clip_grad_norm_matches_torch_on_plain_tensors(max_norm):
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(a, max_norm)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm if max_norm is not None else float("inf"))
    assert norm == pytest.approx(float(ref), rel=1e-6)
    for p, q in zip(a, b):
        assert torch.allclose(p.grad, q.grad, atol=1e-7)


def test_aggregate_sums_over_dp_and_averages_steps():
    per_dp = [[{"loss": 1.0, "grad_norm": 9.0, "lr": 9.0}, {"loss": 3.0, "grad_norm": 9.0, "lr": 9.0}],
              [{"loss": 2.0, "grad_norm": 9.0, "lr": 9.0}, {"loss": 4.0, "grad_norm": 9.0, "lr": 9.0}]]
    rank0 = [{"loss": 1.0, "grad_norm": 2.0, "lr": 0.1}, {"loss": 3.0, "grad_norm": 4.0, "lr": 0.3}]
    out = Policy._aggregate(per_dp, rank0)
    assert out == pytest.approx({"loss": 5.0, "grad_norm": 3.0, "lr": 0.2})


def test_bad_layout_fails_before_anything_starts():
    cfg = PolicyConfig()
    cfg.dtensor_cfg.tensor_parallel_size = 3
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        Policy(cfg, ClusterConfig(gpus_per_node=2), "/nonexistent")
    cfg.dtensor_cfg.tensor_parallel_size, cfg.dtensor_cfg.data_parallel_size = 1, 4
    with pytest.raises(ValueError, match="data_parallel_size=4"):
        DTensorPolicyWorker.check_layout(cfg, 2)
