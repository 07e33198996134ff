"""The objectives and options of the loss family against hand computations (GSPO, CISPO, REINFORCE, forced
on-policy ratio, truncated importance sampling, Dr.GRPO aggregation, KL in reward), their micro-batch and
data-parallel invariance, and the combinations rejected at config time."""

import math
from dataclasses import replace

import pytest
import torch
from test_losses import PLAIN, _close, _random_batch, _run, _split_loss, _two_samples, with_loss_mask

from nemo_grpo.algorithms.kl import sequence_kl
from nemo_grpo.algorithms.losses import ClippedPGLoss, make_loss
from nemo_grpo.algorithms.objectives import OBJECTIVE_FLAGS, OBJECTIVES, ActorTerm, register_objective
from nemo_grpo.errors import ConfigError
from nemo_grpo.validation import load_config

F64 = torch.float64
LN = math.log


def _batch(ratios, adv, prev=-1.0, gen=None):
    """Samples of equal length: column 0 a masked prompt token, then one response token per entry.
    ratios, adv [b][n]: logprobs = prev + ln(ratio); gen [b][n] or None (= prev). Returns (logprobs leaf, mb)."""
    b, n = len(ratios), len(ratios[0])
    lp = torch.tensor([[0.0] + [prev + LN(r) for r in row] for row in ratios], dtype=F64)
    mb = {
        "token_mask": torch.tensor([[0.0] + [1.0] * n] * b, dtype=F64),
        "sample_mask": torch.ones(b, dtype=F64),
        "advantages": torch.tensor([[0.0] + list(row) for row in adv], dtype=F64),
        "prev_logprobs": torch.full((b, n + 1), prev, dtype=F64),
        "generation_logprobs": torch.tensor([[0.0] + list(row) for row in gen], dtype=F64) if gen else
        torch.full((b, n + 1), prev, dtype=F64),
    }
    return lp.requires_grad_(True), mb


def _with(**kw):
    return replace(PLAIN, **kw)


# ----------------------------------------------------------------------------------------------- objectives
def test_gspo_clips_the_length_normalised_sequence_ratio():
    cfg = _with(sequence_level_importance_ratios=True, token_level_loss=False)
    # sample 0: token ratios 1.1, 1.0 -> s = sqrt(1.1) = 1.0488, inside [0.8, 1.2]: loss -s, d(-s)/dlogp_t = -s/2
    # sample 1: token ratios 2, 1.5 -> s = sqrt(3) = 1.732, A = +1: clipped to 1.2, no gradient
    logprobs, mb = _batch([[1.1, 1.0], [2.0, 1.5]], [[1.0, 1.0], [1.0, 1.0]])
    loss, grad, m = _run(cfg, logprobs, mb)
    s = math.sqrt(1.1)
    assert loss == pytest.approx((-s - 1.2) / 2)
    _close(grad, [[0.0, -s / 4, -s / 4], [0.0, 0.0, 0.0]])
    assert m["clip_fraction"] == pytest.approx(0.5)  # both tokens of sample 1
    assert m["probs_ratio"] == pytest.approx((2 * s + 2 * math.sqrt(3)) / 4)


def test_cispo_keeps_a_gradient_on_clipped_tokens():
    cfg = _with(use_cispo=True)
    # ratio, A -> w = stop_grad(clip(r, 0.8, 1.2)), loss = -A w logp:  1.5,+1 -> w 1.2;  0.5,+1 -> 0.8;  1.1,-1 -> 1.1
    logprobs, mb = _batch([[1.5, 0.5, 1.1]], [[1.0, 1.0, -1.0]])
    loss, grad, m = _run(cfg, logprobs, mb)
    lp = [-1 + LN(1.5), -1 + LN(0.5), -1 + LN(1.1)]
    assert loss == pytest.approx((-1.2 * lp[0] - 0.8 * lp[1] + 1.1 * lp[2]) / 3)
    _close(grad, [[0.0, -1.2 / 3, -0.8 / 3, 1.1 / 3]])  # PPO would give 0 on the two clipped tokens
    assert m["clip_fraction"] == pytest.approx(2 / 3)


def test_disable_ppo_ratio_is_reinforce():
    cfg = _with(disable_ppo_ratio=True)
    logprobs, mb = _batch([[1.5, 0.5]], [[2.0, -1.0]])  # ratios far outside the clip range: ignored
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx((-2.0 * (-1 + LN(1.5)) + (-1 + LN(0.5))) / 2)
    _close(grad, [[0.0, -1.0, 0.5]])  # -A / n on every token
    assert m["probs_ratio"] == 1.0 and m["clip_fraction"] == 0.0


def test_force_on_policy_ratio_is_one_with_the_gradient_of_logp():
    cfg = _with(force_on_policy_ratio=True)
    logprobs, mb = _batch([[1.5, 0.5]], [[1.0, -1.0]])  # prev_logprobs are not used
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx(0.0)  # (-1 + 1) / 2 with ratio 1
    _close(grad, [[0.0, -0.5, 0.5]])  # neither clipped nor scaled by the stale ratio
    assert m["probs_ratio"] == 1.0 and m["clip_fraction"] == 0.0


# ----------------------------------------------------------------------------------------------- by name
@pytest.mark.parametrize("name,flags", [
    ("gspo", dict(sequence_level_importance_ratios=True, token_level_loss=False, use_importance_sampling_correction=True)),
    ("cispo", dict(use_cispo=True)),
    ("reinforce", dict(disable_ppo_ratio=True)),
])
def test_objective_by_name_is_the_nemo_rl_flag(name, flags):
    """loss_fn.objective=<name> and NeMo RL's flag are one objective: the same loss, gradient and metrics."""
    logprobs, mb = _random_batch(seed=3)
    logprobs.requires_grad_(True)
    by_flag = _run(_with(**flags), logprobs, mb)
    options = {k: v for k, v in flags.items() if k not in OBJECTIVE_FLAGS}
    by_name = _run(_with(objective=name, **options), logprobs, mb)
    assert by_name[0] == pytest.approx(by_flag[0], abs=1e-12) and by_name[2] == pytest.approx(by_flag[2])
    torch.testing.assert_close(by_name[1], by_flag[1], atol=1e-12, rtol=0)
    assert by_flag[1].abs().sum() > 0


def test_a_registered_objective_is_reachable_by_name():
    """A new objective is one registered function: loss_fn.objective names it, the loss composes it with the
    aggregation and the importance-sampling correction like any other."""
    @register_objective("test_half_reinforce")
    def half_reinforce(curr, prev, adv, token_mask, c):
        ones = torch.ones_like(curr)
        return ActorTerm(-0.5 * adv * curr, ones, ones, torch.zeros_like(curr, dtype=torch.bool))

    try:
        logprobs, mb = _batch([[1.5, 0.5]], [[2.0, -1.0]])
        _, grad, _ = _run(_with(objective="test_half_reinforce"), logprobs, mb)
        _close(grad, [[0.0, -0.5, 0.25]])  # half of REINFORCE's -A / n
    finally:
        del OBJECTIVES["test_half_reinforce"]


# ----------------------------------------------------------------------------------------------- truncated IS
# w = exp(prev - gen) = [3, 0.5, 1, 0.2]; ratio 1 and A = 1: actor per token = -w
GEN = [[-1.0 - LN(w) for w in (3.0, 0.5, 1.0, 0.2)]]


@pytest.mark.parametrize("kind,lo,weights,oob", [
    (None, None, [2.0, 0.5, 1.0, 0.2], 1 / 4),  # a ratio without a type: tis, lower bound 0
    ("tis", None, [2.0, 0.5, 1.0, 0.2], 1 / 4),
    ("tis", 0.4, [2.0, 0.5, 1.0, 0.4], 2 / 4),  # clamped into [0.4, 2]
    ("icepop", 0.4, [0.0, 0.5, 1.0, 0.0], 2 / 4),  # outside [0.4, 2]: dropped
])
def test_truncated_importance_sampling(kind, lo, weights, oob):
    cfg = _with(use_importance_sampling_correction=True, truncated_importance_sampling_type=kind,
                truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_ratio_min=lo)
    logprobs, mb = _batch([[1.0] * 4], [[1.0] * 4], gen=GEN)
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx(-sum(weights) / 4)
    _close(grad, [[0.0] + [-w / 4 for w in weights]])
    assert m["is_weight"] == pytest.approx(sum(weights) / 4) and m["is_oob_ratio"] == pytest.approx(oob)


def test_seq_mask_tis_drops_whole_samples_by_geometric_mean():
    cfg = _with(use_importance_sampling_correction=True, truncated_importance_sampling_type="seq-mask-tis",
                truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_ratio_min=0.4)
    # sample 0: w = [3, 0.5], geometric mean sqrt(1.5) = 1.22: kept, token weights unchanged (3 is not capped)
    # sample 1: w = [0.2, 0.2], geometric mean 0.2 < 0.4: masked
    gen = [[-1.0 - LN(3.0), -1.0 - LN(0.5)], [-1.0 - LN(0.2)] * 2]
    logprobs, mb = _batch([[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]], gen=gen)
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx(-(3.0 + 0.5) / 4)
    _close(grad, [[0.0, -3.0 / 4, -0.5 / 4], [0.0, 0.0, 0.0]])
    assert m["is_oob_ratio"] == pytest.approx(2 / 4)  # per token: both tokens of sample 1


def test_gspo_importance_weight_is_per_sequence():
    cfg = _with(sequence_level_importance_ratios=True, token_level_loss=False, use_importance_sampling_correction=True)
    # w = exp(sum(prev - gen)) over the sample = 3 * 0.5 = 1.5 on every token; ratio 1, A = 1
    logprobs, mb = _batch([[1.0, 1.0]], [[1.0, 1.0]], gen=[[-1.0 - LN(3.0), -1.0 - LN(0.5)]])
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx(-1.5) and m["is_weight"] == pytest.approx(1.5)


# ----------------------------------------------------------------------------------------------- aggregation
def test_dr_grpo_sums_each_sequence_over_a_constant():
    """Sample 0: one token (A = 4); sample 1: three (A = 1, 2, 3); per-token loss -A; normalizer L = 4."""
    logprobs, mb = _two_samples()
    loss_fn = ClippedPGLoss(_with(loss_aggregation="seq_mean_token_sum_norm"), max_sequence_length=4)
    mb = with_loss_mask(mb)
    loss, _ = loss_fn(logprobs, mb, mb["sample_mask"].sum(), mb["loss_mask"].sum())
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert loss.item() == pytest.approx((-4 / 4 + -6 / 4) / 2)
    # every token weighs 1 / (L x sequences), whatever the length of its answer
    _close(grad, [[0, -4 / 8, 0, 0], [0, -1 / 8, -2 / 8, -3 / 8], [0, 0, 0, 0]])


def test_dr_grpo_needs_its_normalizer():
    logprobs, mb = _two_samples()
    with pytest.raises(ValueError, match="max_total_sequence_length"):
        _run(_with(loss_aggregation="seq_mean_token_sum_norm"), logprobs, mb)


# ----------------------------------------------------------------------------------------------- KL in reward
def test_kl_in_reward_leaves_the_loss_and_sums_over_tokens():
    cfg = _with(reference_policy_kl_penalty=0.5, reference_policy_kl_type="k1", use_kl_in_reward=True)
    logprobs, mb = _batch([[1.0, 1.0]], [[1.0, 1.0]])
    mb["reference_policy_logprobs"] = torch.tensor([[0.0, -3.0, -2.0]], dtype=F64)
    loss, _, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx(-1.0) and m["kl_penalty"] == 0.0  # the actor term only
    kl = sequence_kl(mb["prev_logprobs"], mb["reference_policy_logprobs"], mb["token_mask"], "k1")
    _close(kl, [(-1 + 3) + (-1 + 2)])  # k1 = logp - ref, summed over the response tokens


# ----------------------------------------------------------------------------------------------- invariance
VARIANTS = {
    "gspo": _with(sequence_level_importance_ratios=True, token_level_loss=False, use_importance_sampling_correction=True,
                  truncated_importance_sampling_type="icepop", truncated_importance_sampling_ratio=1.5,
                  truncated_importance_sampling_ratio_min=0.6),
    "cispo": _with(use_cispo=True, ratio_clip_max=0.28, reference_policy_kl_penalty=0.1, reference_policy_kl_type="k1"),
    "reinforce": _with(disable_ppo_ratio=True, reference_policy_kl_penalty=0.1, use_on_policy_kl_approximation=True),
    "force_on_policy": _with(force_on_policy_ratio=True, use_importance_sampling_correction=True,
                             truncated_importance_sampling_type="seq-mask-tis", truncated_importance_sampling_ratio=1.3,
                             truncated_importance_sampling_ratio_min=0.7),
    "dr_grpo": _with(loss_aggregation="seq_mean_token_sum_norm", reference_policy_kl_penalty=0.1,
                     reference_policy_kl_type="k2"),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_variants_are_invariant_to_micro_batches_and_data_parallel(name):
    loss_fn = make_loss("clipped_pg", VARIANTS[name], max_sequence_length=9)
    logprobs, mb = _random_batch(seed=5)
    whole, grad_whole, m_whole = _split_loss(loss_fn, logprobs, mb, [(0, 8)])
    assert grad_whole.abs().sum() > 0
    for bounds in ([(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 3), (3, 4), (4, 8)], [(0, 1), (1, 4), (4, 7), (7, 8)]):
        loss, grad, metrics = _split_loss(loss_fn, logprobs, mb, bounds)
        assert loss == pytest.approx(whole, abs=1e-9), bounds
        torch.testing.assert_close(grad, grad_whole, atol=1e-9, rtol=0)
        for k in metrics:
            assert metrics[k] == pytest.approx(m_whole[k], abs=1e-9), (bounds, k)


# ----------------------------------------------------------------------------------------------- config checks
@pytest.mark.parametrize("overrides,key,words", [
    (["loss_fn.use_cispo=true", "loss_fn.disable_ppo_ratio=true"], "loss_fn.use_cispo", "disable_ppo_ratio"),
    (["loss_fn.use_cispo=true", "loss_fn.token_level_loss=false"], "loss_fn.use_cispo", "token_level_loss=true"),
    (["loss_fn.use_cispo=true", "loss_fn.ratio_clip_c=3"], "loss_fn.use_cispo", "ratio_clip_c=null"),
    (["loss_fn.sequence_level_importance_ratios=true"], "loss_fn.sequence_level_importance_ratios",
     "token_level_loss=false"),
    (["loss_fn.disable_ppo_ratio=true", "loss_fn.force_on_policy_ratio=true"], "loss_fn.force_on_policy_ratio",
     "disable_ppo_ratio"),
    (["loss_fn.objective=gspo", "loss_fn.use_cispo=true"], "loss_fn.use_cispo", "loss_fn.objective names 'gspo'"),
    (["loss_fn.objective=dpo"], "loss_fn.objective", "cispo, gspo, ppo_clip, reinforce"),
    (["loss_fn.objective=cispo", "loss_fn.token_level_loss=false"], "loss_fn.objective", "token_level_loss=true"),
    (["loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.truncated_importance_sampling_ratio=2"],
     "loss_fn.truncated_importance_sampling_type", "use_importance_sampling_correction=true"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=icepop",
      "loss_fn.truncated_importance_sampling_ratio=2"], "loss_fn.truncated_importance_sampling_ratio_min",
     "lower bound"),
    (["loss_fn.use_importance_sampling_correction=true", "loss_fn.truncated_importance_sampling_type=clip"],
     "loss_fn.truncated_importance_sampling_type", "tis, icepop, seq-mask-tis"),
    (["loss_fn.use_kl_in_reward=true"], "loss_fn.use_kl_in_reward", "reference_policy_kl_penalty > 0"),
    (["loss_fn.loss_aggregation=seq_sum"], "loss_fn.loss_aggregation", "seq_mean_token_sum_norm"),
    (["loss_fn.name=dpo"], "loss_fn.name", "clipped_pg"),
    (["grpo.adv_estimator.name=gae"], "grpo.adv_estimator.name", "gdpo, grpo, reinforce_plus_plus"),
    (["grpo.adv_estimator.reward_weights=[1,2]"], "grpo.adv_estimator.reward_weights", "gdpo"),
    (["grpo.advantage_clip_low=0.5"], "grpo.advantage_clip_low", "<= 0"),
    (["grpo.reward_shaping.enabled=true"], "grpo.reward_shaping.enabled", "neither"),
    (["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.overlong_buffer_length=2"],
     "grpo.reward_shaping.overlong_buffer_length", "set both"),
    (["grpo.reward_shaping.enabled=true", "grpo.reward_shaping.stop_properly_penalty_coef=2"],
     "grpo.reward_shaping.stop_properly_penalty_coef", "[0, 1]"),
    (["grpo.adv_estimator.name=gdpo", "grpo.reward_shaping.enabled=true",
      "grpo.reward_shaping.stop_properly_penalty_coef=0"], "grpo.reward_shaping.enabled", "component"),
])
def test_nonsense_is_rejected_at_config_time(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides, files=False)
    assert f"'{key}'" in str(err.value) and words in str(err.value)
