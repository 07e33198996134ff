"""Group advantages, reward scaling and the dynamic-sampling filter against hand computations and a loop."""

import statistics

import pytest
import torch

from nemo_grpo.algorithms.advantages import compute_advantages, dynamic_sampling_keep, scale_rewards
from nemo_grpo.config import RewardScalingConfig

F64 = torch.float64


def _close(actual: torch.Tensor, expected: list[float], tol: float = 1e-6) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def test_mean_baseline_without_normalization():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0], dtype=F64)
    adv, baseline, std = compute_advantages(rewards, 4, use_leave_one_out_baseline=False, normalize_rewards=False)
    _close(baseline, [0.5] * 4 + [5.0] * 4)
    _close(adv, [0.5, -0.5, -0.5, 0.5, -3.0, -1.0, 1.0, 3.0])
    # unbiased std: sqrt(4 * 0.25 / 3) and sqrt((9 + 1 + 1 + 9) / 3)
    _close(std, [0.5773503] * 4 + [2.5819889] * 4)


def test_mean_baseline_normalized():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0], dtype=F64)
    adv, _, _ = compute_advantages(rewards, 4, use_leave_one_out_baseline=False, normalize_rewards=True, eps=0.0)
    # 0.5 / 0.5773503 and [-3, -1, 1, 3] / 2.5819889
    _close(adv, [0.8660254, -0.8660254, -0.8660254, 0.8660254, -1.1618950, -0.3872983, 0.3872983, 1.1618950])


def test_eps_is_added_to_std():
    adv, _, _ = compute_advantages(torch.tensor([0.0, 2.0], dtype=F64), 2, False, True, eps=0.5)
    # mean 1, std sqrt(2) -> -1 / (1.4142136 + 0.5)
    _close(adv, [-0.5224077, 0.5224077])


def test_leave_one_out_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    adv, baseline, std = compute_advantages(rewards, 4, use_leave_one_out_baseline=True, normalize_rewards=False)
    # sample 0: others [0, 0, 1] -> mean 1/3; sample 1: others [1, 0, 1] -> mean 2/3
    _close(baseline, [1 / 3, 2 / 3, 2 / 3, 1 / 3])
    _close(adv, [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    # std of the others, unbiased: [0, 0, 1] -> sqrt((1/9 + 1/9 + 4/9) / 2) = sqrt(1/3); same for [1, 0, 1]
    _close(std, [0.5773503] * 4)
    adv_n, _, _ = compute_advantages(rewards, 4, use_leave_one_out_baseline=True, normalize_rewards=True, eps=0.0)
    _close(adv_n, [1.1547005, -1.1547005, -1.1547005, 1.1547005])


def test_leave_one_out_sample_whose_others_agree_is_not_divided():
    # group [1, 0, 0]: sample 0's others [0, 0] have std 0 -> raw advantage 1 - 0 (not 1 / eps);
    # samples 1, 2: others [1, 0] -> mean 0.5, std 0.7071068 -> (0 - 0.5) / 0.7071068
    adv, baseline, std = compute_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, True, True)
    assert std[0].item() == 0.0
    _close(adv, [1.0, -0.7071058, -0.7071058])  # eps = 1e-6 in the denominator
    _close(baseline, [0.0, 0.5, 0.5])



def test_leave_one_out_std_of_equal_others_is_exactly_zero():
    # float32: the leave-one-out mean of three 0.9s rounds, leaving a std of ~7e-8 that would turn sample 0's
    # advantage 0.1 into 0.1 / (7e-8 + 1e-6) ~ 9e4
    adv, _, std = compute_advantages(torch.tensor([1.0, 0.9, 0.9, 0.9]), 4, True, True)
    assert std[0].item() == 0.0
    # samples 1-3: others [1, 0.9, 0.9] -> mean 0.9333333, std 0.0577350 -> -0.0333333 / 0.0577350
    _close(adv, [0.1, -0.5773403, -0.5773403, -0.5773403], tol=2e-5)

@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("normalize", [False, True])
def test_constant_group_gets_exactly_zero(loo, normalize):
    # 0.1 is not exact in binary: mean and leave-one-out mean do not round-trip to 0.1 exactly
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 0.3, 0.0, 0.7, 0.2, 0.9])
    adv, _, std = compute_advantages(rewards, 7, loo, normalize)
    assert torch.equal(adv[:7], torch.zeros(7)) and torch.equal(std[:7], torch.zeros(7))
    assert (adv[7:].abs() > 0.01).all()  # the other group still learns
    adv, _, std = compute_advantages(torch.full((8,), 0.1), 8, loo, normalize)  # float32 std here: ~8e-9
    assert torch.equal(adv, torch.zeros(8)) and torch.equal(std, torch.zeros(8))


def test_group_of_one_has_zero_std_and_advantage():
    adv, baseline, std = compute_advantages(torch.tensor([0.3, 0.8]), 1, False, True)
    assert torch.equal(adv, torch.zeros(2)) and torch.equal(std, torch.zeros(2))
    _close(baseline, [0.3, 0.8])


def _loop_leave_one_out(rewards: list[float], G: int, normalize: bool, eps: float) -> list[float]:
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start : start + G]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            a = r - sum(others) / len(others)
            sd = 0.0 if len(set(others)) == 1 else statistics.stdev(others)
            if normalize and sd > 0:
                a = a / (sd + eps)
            out.append(0.0 if len(set(group)) == 1 else a)
    return out


@pytest.mark.parametrize("G", [2, 3, 5])
@pytest.mark.parametrize("normalize", [False, True])
def test_leave_one_out_vectorized_matches_loop(G, normalize):
    gen = torch.Generator().manual_seed(G)
    n = 9
    rewards = torch.randint(0, 3, (n * G,), generator=gen).to(F64)  # ties, constant groups and "others agree"
    rewards[: 2 * G] += torch.rand(2 * G, generator=gen, dtype=F64)  # and some continuous rewards
    rewards[-G:] = 1.0
    adv, _, _ = compute_advantages(rewards, G, True, normalize, eps=1e-6)
    _close(adv, _loop_leave_one_out(rewards.tolist(), G, normalize, 1e-6), tol=1e-9)


def test_bad_layouts_are_rejected():
    with pytest.raises(ValueError, match="groups of group_size=3"):
        compute_advantages(torch.zeros(7), 3, False, True)
    with pytest.raises(ValueError, match="group_size >= 2"):
        compute_advantages(torch.zeros(4), 1, True, True)
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(torch.zeros(2, 4), 4, False, True)


def test_integer_rewards_are_accepted():
    adv, _, _ = compute_advantages(torch.tensor([1, 0]), 2, False, False)
    _close(adv, [0.5, -0.5])


# ----------------------------------------------------------------------------------------------- scaling
def test_reward_scaling_clamps_then_maps_linearly():
    cfg = RewardScalingConfig(enabled=True, source_min=0.0, source_max=10.0, target_min=-1.0, target_max=1.0)
    out = scale_rewards(torch.tensor([-5.0, 0.0, 2.5, 10.0, 20.0]), cfg)
    _close(out, [-1.0, -1.0, -0.5, 1.0, 1.0])


def test_reward_scaling_disabled_is_identity():
    rewards = torch.tensor([-5.0, 0.5, 20.0])
    cfg = RewardScalingConfig(enabled=False, source_min=0.0, source_max=10.0, target_min=-1.0, target_max=1.0)
    assert scale_rewards(rewards, cfg) is rewards


# ----------------------------------------------------------------------------------------------- DAPO filter
def test_dynamic_sampling_keeps_groups_with_differing_rewards():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.2, 0.2, 0.2, 0.0, 0.0, 0.5])
    keep = dynamic_sampling_keep(rewards, 3)
    assert keep.dtype == torch.bool and keep.tolist() == [False, True, False, True]

