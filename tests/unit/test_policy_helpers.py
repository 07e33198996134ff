"""Pure helpers of the Policy front and the PolicyActor's rooms (no Ray, no process group)."""

import pytest
import torch
import torch.nn.functional as F

from nemo_grpo.backends.batching import (attention_mask_from_lengths, equalize_group_counts, slice_batch,
                                         split_sizes, take_rows, token_budget_groups, token_logprobs_from_logits)
from nemo_grpo.backends.dtensor.parallelize import grad_norm
from nemo_grpo.backends.optimizer import clip_coefficient, lr_warmup_factor
from nemo_grpo.config import ClusterConfig, PolicyConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.backends.registry import policy_layout
from nemo_grpo.layout import ParallelLayout
from nemo_grpo.policy import Policy, ShippedRows, dp_row_order
from nemo_grpo.weights.transfer import plan_buckets


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


def test_token_budget_groups_sort_by_length_and_respect_the_budget():
    lengths = [5, 30, 12, 64, 3, 33, 17, 9]
    # longest first: rows 3 5 1 6 2 7 0 4, rounded up to 16: 64 48 32 32 16 16 16 16; budget 96:
    # [64] | 48 x 2 | 32 x 3 | 16 x 2
    groups = token_budget_groups(lengths, budget=96, round_to=16)
    assert groups == [[3], [5, 1], [6, 2, 7], [0, 4]]
    for g in groups:  # rows x the longest row, rounded, within budget
        assert len(g) * max(-(-lengths[i] // 16) * 16 for i in g) <= 96
    assert token_budget_groups([200, 10], budget=64, round_to=1) == [[0], [1]]  # a row over budget: alone


def test_equalize_group_counts_splits_the_largest_groups():
    plan = equalize_group_counts([[[0, 1, 2, 3]], [[0], [1], [2, 3]]])
    assert plan == [[[0], [1], [2, 3]], [[0], [1], [2, 3]]]
    with pytest.raises(ValueError, match="cannot split 1 rows into 2"):
        equalize_group_counts([[[0]], [[0], [1]]])


def test_take_rows_in_the_given_order():
    batch = {"input_ids": torch.arange(8).view(4, 2), "text": ["a", "b", "c", "d"], "n": 4}
    out = take_rows(batch, [2, 0])
    assert out["input_ids"].tolist() == [[4, 5], [0, 1]] and out["text"] == ["c", "a"] and out["n"] == 4


def test_dp_row_order_is_trains_layout_when_global_batches_divide():
    order = dp_row_order(8, 2, 4)  # 2 global batches of 4, 2 ranks: 2 rows of each per rank
    assert [o.tolist() for o in order] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    order = dp_row_order(5, 2, 4)  # forward only: even split, the short rank padded with -1
    assert [o.tolist() for o in order] == [[0, 1, 2], [3, 4, -1]]


def test_shipped_rows_gather_back_in_batch_order_without_padding_rows():
    batch = {"input_ids": torch.zeros(5, 2, dtype=torch.long), "input_lengths": torch.tensor([1, 2, 3, 4, 5])}
    rows = ShippedRows("key", batch, order=dp_row_order(5, 2, 4))
    assert rows.lengths == [[1, 2, 3], [4, 5, 1]]  # the padding row is a copy of row 0
    per_dp = [torch.tensor([[10.0], [20.0], [30.0]]), torch.tensor([[40.0], [50.0], [-1.0]])]
    assert rows.gather(per_dp).view(-1).tolist() == [10.0, 20.0, 30.0, 40.0, 50.0]


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
def test_grad_norm_and_clip_coefficient_match_torch_on_plain_tensors(max_norm):
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    norm = grad_norm([p.grad for p in a])
    coef = clip_coefficient(norm, max_norm)
    torch._foreach_mul_([p.grad for p in a], coef)
    ref = torch.nn.utils.clip_grad_norm_(b, max_norm if max_norm is not None else float("inf"))
    assert norm == pytest.approx(float(ref), rel=1e-6)
    for p, q in zip(a, b):
        assert torch.allclose(p.grad, q.grad, atol=1e-7)


def test_non_finite_norm_means_skip():
    assert clip_coefficient(float("nan"), 1.0) is None and clip_coefficient(float("inf"), None) is None
    assert clip_coefficient(0.5, 1.0) == 1.0 and clip_coefficient(3.0, None) == 1.0
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1 / (4.0 + 1e-6))


def test_aggregate_sums_over_dp_and_averages_steps():
    nine = {"grad_norm": 9.0, "lr": 9.0, "skipped_steps": 9.0, "micro_batches": 9.0}  # rank 0's count, not these
    per_dp = [[{"loss": 1.0, **nine}, {"loss": 3.0, **nine}], [{"loss": 2.0, **nine}, {"loss": 4.0, **nine}]]
    rank0 = [{"loss": 1.0, "grad_norm": 2.0, "lr": 0.1, "skipped_steps": 1.0, "micro_batches": 2.0},
             {"loss": 3.0, "grad_norm": 4.0, "lr": 0.3, "skipped_steps": 1.0, "micro_batches": 1.0}]
    out = Policy._aggregate(per_dp, rank0)
    assert out == pytest.approx({"loss": 5.0, "grad_norm": 3.0, "lr": 0.2, "skipped_steps": 2.0,
                                 "micro_batches": 1.5})


def test_aggregate_sums_the_aux_loss_and_takes_rank0s_load_imbalance():
    """A Mixture-of-Experts step: moe/aux_loss is a per-rank contribution (summed over DP), moe/load_imbalance
    the global value every rank has (rank 0's, averaged over steps)."""
    base = {"grad_norm": 1.0, "lr": 0.1, "skipped_steps": 0.0, "micro_batches": 1.0}
    per_dp = [[{"moe/aux_loss": 1.0, "moe/load_imbalance": 2.0, **base}],
              [{"moe/aux_loss": 0.5, "moe/load_imbalance": 2.0, **base}]]
    out = Policy._aggregate(per_dp, per_dp[0])
    assert out["moe/aux_loss"] == pytest.approx(1.5) and out["moe/load_imbalance"] == pytest.approx(2.0)


def test_bad_layout_fails_before_anything_starts():
    cfg = PolicyConfig()
    cfg.dtensor_cfg.tensor_parallel_size = 3
    with pytest.raises(ConfigError, match="'policy.dtensor_cfg.tensor_parallel_size': tensor_parallel_size 3 x "
                                          "context_parallel_size 1 = 3 does not divide world size 2"):
        Policy(cfg, ClusterConfig(gpus_per_node=2), "/nonexistent")
    cfg.dtensor_cfg.tensor_parallel_size, cfg.dtensor_cfg.data_parallel_size = 1, 4
    with pytest.raises(ConfigError, match="'policy.dtensor_cfg.data_parallel_size': data_parallel_size 4 x "
                                          "tensor_parallel_size 1 x context_parallel_size 1 = 4 != world size 2"):
        policy_layout(cfg, 2)


def test_parallel_layout_names_each_degree():
    # the key named: the first degree that alone does not divide the world (pp 3 here), else tp's
    with pytest.raises(ConfigError, match="'policy.megatron_cfg.pipeline_model_parallel_size': "
                                          "tensor_model_parallel_size 2 x pipeline_model_parallel_size 3 x "
                                          "context_parallel_size 1 = 6 does not divide world size 4"):
        policy_layout(PolicyConfig(backend="megatron", megatron_cfg=dict_cfg(2, 3)), 4)
    with pytest.raises(ConfigError, match="'policy.megatron_cfg.pipeline_model_parallel_size': .* >= 1, got 0"):
        policy_layout(PolicyConfig(backend="megatron", megatron_cfg=dict_cfg(1, 0)), 4)
    layout = ParallelLayout.build(8, tp=2, pp=2)
    assert (layout.dp, layout.tp, layout.pp, layout.cp) == (2, 2, 2, 1)
    assert [layout.rank_coords(r) for r in (0, 1, 2, 5)] == [
        {"tp": 0, "cp": 0, "dp": 0, "pp": 0}, {"tp": 1, "cp": 0, "dp": 0, "pp": 0},
        {"tp": 0, "cp": 0, "dp": 1, "pp": 0}, {"tp": 1, "cp": 0, "dp": 0, "pp": 1}]
    layout = ParallelLayout.build(16, tp=2, cp=2, pp=2)  # tp fastest, then cp, then dp, then pp
    assert layout.dp == 2
    assert [layout.rank_coords(r) for r in (1, 2, 5, 9)] == [
        {"tp": 1, "cp": 0, "dp": 0, "pp": 0}, {"tp": 0, "cp": 1, "dp": 0, "pp": 0},
        {"tp": 1, "cp": 0, "dp": 1, "pp": 0}, {"tp": 1, "cp": 0, "dp": 0, "pp": 1}]
    with pytest.raises(ConfigError, match="'policy.megatron_cfg.context_parallel_size': tensor_model_parallel_size 2 "
                                          "x pipeline_model_parallel_size 1 x context_parallel_size 3 = 6 does not "
                                          "divide world size 8"):
        policy_layout(PolicyConfig(backend="megatron", megatron_cfg=dict_cfg(2, 1, cp=3)), 8)


def dict_cfg(tp: int, pp: int, cp: int = 1):
    from nemo_grpo.config import MegatronConfig

    return MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp)
