"""Advantage estimators (GRPO, REINFORCE++, GDPO), advantage clipping, reward shaping and scaling, and the
dynamic-sampling filter against hand computations and a loop."""

import statistics

import pytest
import torch

from types import SimpleNamespace

from nemo_grpo.algorithms.advantages import (ESTIMATORS, compute_advantages, dynamic_sampling_keep,
                                             estimate_advantages, scale_rewards, shape_rewards)
from nemo_grpo.algorithms.rollout import _add_reward
from nemo_grpo.config import AdvEstimatorConfig, GRPOConfig, RewardScalingConfig, RewardShapingConfig
from nemo_grpo.errors import ConfigError

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
    with pytest.raises(ValueError, match="group_size >= 2.*grpo.use_leave_one_out_baseline=false"):
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



# ----------------------------------------------------------------------------------------------- estimators
def _grpo(name="grpo", **kw):
    est = {k: kw.pop(k) for k in ("minus_baseline", "reward_weights") if k in kw}
    return GRPOConfig(adv_estimator=AdvEstimatorConfig(name=name, **est), **kw)


REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=F64)  # two groups of 4


def test_estimators_are_registered_and_unknown_names_listed():
    assert set(ESTIMATORS) == {"grpo", "reinforce_plus_plus", "gdpo"}
    with pytest.raises(ConfigError, match="unknown estimator 'gae'; known: gdpo, grpo, reinforce_plus_plus"):
        estimate_advantages(REWARDS, 4, _grpo("gae"))


def test_grpo_estimator_is_the_group_advantage():
    cfg = _grpo(normalize_rewards=True, use_leave_one_out_baseline=True)
    _close(estimate_advantages(REWARDS, 4, cfg), compute_advantages(REWARDS, 4, True, True)[0].tolist())


def test_reinforce_plus_plus_normalises_over_the_batch_tokens():
    # minus the group mean (0.25, 0.75): a = [.75, -.25, -.25, -.25, .25, .25, .25, -.75]
    a = [0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]
    # samples weigh equally: mean 0, variance (0.75^2 + 3 x 0.25^2) x 2 / 8 = 0.1875
    _close(estimate_advantages(REWARDS, 4, _grpo("reinforce_plus_plus")), [x / 0.1875 ** 0.5 for x in a])
    # the last sample has 3 tokens: mean over 10 tokens = -1.5 / 10; variance over tokens
    counts = torch.tensor([1, 1, 1, 1, 1, 1, 1, 3], dtype=F64)
    mean = -0.15
    var = (0.9 ** 2 + 3 * 0.1 ** 2 + 3 * 0.4 ** 2 + 3 * 0.6 ** 2) / 10
    _close(estimate_advantages(REWARDS, 4, _grpo("reinforce_plus_plus"), token_counts=counts),
           [(x - mean) / var ** 0.5 for x in a])
    # without the baseline: the rewards themselves (mean 0.5, variance 0.25) -> +-1
    _close(estimate_advantages(REWARDS, 4, _grpo("reinforce_plus_plus", minus_baseline=False)),
           [1.0, -1, -1, -1, 1, 1, 1, -1])


def test_gdpo_normalises_each_component_in_its_groups_then_weighs_them():
    comps = {"b_format": torch.tensor([0.0, 0, 1, 1, 2, 0, 0, 0], dtype=F64), "a_correct": REWARDS}
    # a_correct per group (mean, unbiased std): (.25, .5) -> [1.5, -.5, -.5, -.5]; (.75, .5) -> [.5, .5, .5, -1.5]
    # b_format: (.5, sqrt(1/3)) -> +-sqrt(3)/2; (.5, 1) -> [1.5, -.5, -.5, -.5]. Weights 1 and 0.5 (sorted names).
    h = 3 ** 0.5 / 2
    total = [1.5 - h / 2, -0.5 - h / 2, -0.5 + h / 2, -0.5 + h / 2, 0.5 + 0.75, 0.5 - 0.25, 0.5 - 0.25, -1.5 - 0.25]
    mean = sum(total) / 8
    std = (sum((x - mean) ** 2 for x in total) / 7) ** 0.5  # the sample std (N - 1), as NeMo RL
    cfg = _grpo("gdpo", reward_weights=[1.0, 0.5], normalize_rewards=True)
    _close(estimate_advantages(REWARDS, 4, cfg, components=comps), [(x - mean) / std for x in total], tol=1e-5)


def test_gdpo_at_two_samples_divides_by_the_sample_std():
    """N = 2: the population std would give +-1; the sample std gives +-1/sqrt(2) (NeMo RL's figures)."""
    comps = {"a": torch.tensor([1.0, 0.0], dtype=F64), "b": torch.tensor([0.0, 0.0], dtype=F64)}
    cfg = _grpo("gdpo", normalize_rewards=True)
    _close(estimate_advantages(comps["a"], 2, cfg, components=comps), [0.5 ** 0.5, -(0.5 ** 0.5)])
    # equal sums: centred, not divided
    same = {"a": torch.tensor([1.0, 1.0], dtype=F64), "b": torch.tensor([0.0, 0.0], dtype=F64)}
    _close(estimate_advantages(same["a"], 2, cfg, components=same), [0.0, 0.0])


def test_gdpo_needs_several_components_and_one_weight_each():
    with pytest.raises(ConfigError, match="several reward components.*grpo.adv_estimator.name=grpo"):
        estimate_advantages(REWARDS, 4, _grpo("gdpo"), components={"only": REWARDS})
    with pytest.raises(ConfigError, match="reward_weights': 3 weights for 2 reward components"):
        estimate_advantages(REWARDS, 4, _grpo("gdpo", reward_weights=[1.0, 1.0, 1.0]),
                            components={"a": REWARDS, "b": REWARDS})


def test_advantages_are_clipped():
    cfg = _grpo(normalize_rewards=False, advantage_clip_low=-0.5, advantage_clip_high=0.6)
    # group advantages [.75, -.25, -.25, -.25, .25, .25, .25, -.75]
    _close(estimate_advantages(REWARDS, 4, cfg), [0.6, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.5])


def test_environment_reward_components_add_up():
    s = SimpleNamespace(reward=0.0, reward_components={})
    _add_reward(s, {"correct": torch.tensor([1.0, 0.0]), "format": torch.tensor([0.5, 0.25])}, 1)
    _add_reward(s, {"correct": torch.tensor([1.0, 1.0]), "format": torch.tensor([0.5, 0.25])}, 1)
    assert s.reward_components == {"correct": 1.0, "format": 0.5} and s.reward == 1.5
    plain = SimpleNamespace(reward=0.0, reward_components={})
    _add_reward(plain, torch.tensor([0.3, 0.7]), 0)
    assert plain.reward == pytest.approx(0.3) and plain.reward_components == {}


# ----------------------------------------------------------------------------------------------- shaping
def test_reward_shaping_stop_properly_then_dapo_overlong():
    cfg = RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.5, overlong_buffer_length=2,
                              overlong_buffer_penalty=1.0, max_response_length=4)
    lengths, truncated = torch.tensor([2, 3, 4, 6]), torch.tensor([False, False, True, True])
    # truncated x 0.5: [1, 1, .5, .5]; overlong past 4 - 2 = 2 tokens: -[0, .5, 1, 2] x penalty 1
    _close(shape_rewards(torch.ones(4, dtype=F64), lengths, truncated, cfg, max_response_length=99),
           [1.0, 0.5, -0.5, -1.5])
    # max_response_length null: the caller's (max_new_tokens x turns)
    cfg_default = RewardShapingConfig(enabled=True, overlong_buffer_length=2, overlong_buffer_penalty=1.0)
    _close(shape_rewards(torch.ones(4, dtype=F64), lengths, truncated, cfg_default, max_response_length=4),
           [1.0, 0.5, 0.0, -1.0])
    r = torch.ones(4)
    assert shape_rewards(r, lengths, truncated, RewardShapingConfig(), 4) is r
