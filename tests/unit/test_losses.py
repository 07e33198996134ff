"""Clipped PG loss, KL estimators and mismatch metrics against hand computations; micro-batch and DP invariance."""

import math
import pickle
from dataclasses import replace

import pytest
import torch

from nemo_grpo.algorithms.kl import calculate_kl, generation_mismatch_metrics
from nemo_grpo.algorithms.losses import LOSSES, ClippedPGLoss, aggregate_loss, make_loss, masked_mean
from nemo_grpo.batch import loss_mask
from nemo_grpo.config import LossConfig

F64 = torch.float64
LN = math.log
PLAIN = LossConfig(reference_policy_kl_penalty=0.0, ratio_clip_min=0.2, ratio_clip_max=0.2)


def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def _close(actual, expected, tol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), _t(expected), atol=tol, rtol=0)


def _row(ratios, adv, prev=-1.0, gen=None, ref=None):
    """One sample: column 0 is a prompt token (masked, with absurd values that must be ignored), then one
    response token per entry. Returns (logprobs leaf [1, T], mb)."""
    n = len(ratios)
    prev_row = [-50.0] + [prev] * n
    mb = {
        "token_mask": _t([[0.0] + [1.0] * n]),
        "sample_mask": _t([1.0]),
        "advantages": _t([[100.0] + list(adv)]),
        "prev_logprobs": _t([prev_row]),
        "generation_logprobs": _t([[float("-inf")] + ([prev] * n if gen is None else list(gen))]),
    }
    if ref is not None:
        mb["reference_policy_logprobs"] = _t([[7.0] + list(ref)])
    logprobs = _t([[30.0] + [prev + LN(r) for r in ratios]]).requires_grad_(True)
    return logprobs, mb


def with_loss_mask(mb):
    """mb and its loss mask, as a StepBatch's rows carry it (nemo_grpo/batch.py)."""
    return {**mb, "loss_mask": loss_mask(mb["token_mask"], mb["sample_mask"])}


def _run(cfg, logprobs, mb):
    mb = with_loss_mask(mb)
    loss, metrics = ClippedPGLoss(cfg)(logprobs, mb, mb["sample_mask"].sum(), mb["loss_mask"].sum())
    (grad,) = torch.autograd.grad(loss, logprobs)
    return loss.item(), grad, metrics


# ----------------------------------------------------------------------------------------------- clipping
def test_plain_clip():
    # ratio, A -> max(-A r, -A clip(r, 0.8, 1.2)):  1.5,+1 -> -1.2 (clipped);  0.5,+1 -> -0.5;
    #                                               1.1,-1 -> 1.1;              0.5,-1 -> 0.8 (clipped)
    logprobs, mb = _row([1.5, 0.5, 1.1, 0.5], [1.0, 1.0, -1.0, -1.0])
    loss, grad, m = _run(PLAIN, logprobs, mb)
    assert loss == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8) / 4)
    # d(-A r)/d logp = -A r on unclipped tokens, 0 on clipped ones and on the prompt column
    _close(grad, [[0.0, 0.0, -0.5 / 4, 1.1 / 4, 0.0]])
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["probs_ratio"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5) / 4)
    assert m["probs_ratio_clamped"] == pytest.approx((1.2 + 0.8 + 1.1 + 0.8) / 4)
    assert m["loss"] == pytest.approx(loss) and m["actor_loss"] == pytest.approx(loss)
    assert m["kl_penalty"] == 0.0 and "is_weight" not in m


def test_asymmetric_clip():
    cfg = replace(PLAIN, ratio_clip_min=0.1, ratio_clip_max=0.3)  # ratio clipped to [0.9, 1.3]
    # 1.5,+1 -> -1.3;  1.25,+1 -> -1.25 (inside, though 0.2/0.2 would clip it);  0.5,-1 -> 0.9
    logprobs, mb = _row([1.5, 1.25, 0.5], [1.0, 1.0, -1.0])
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx((-1.3 - 1.25 + 0.9) / 3)
    _close(grad, [[0.0, 0.0, -1.25 / 3, 0.0]])
    assert m["clip_fraction"] == pytest.approx(2 / 3)


def test_dual_clip():
    cfg = replace(PLAIN, ratio_clip_c=3.0)
    # 5,-1: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual);  2,-1: 2 < 3 stays;  5,+1: -1.2, dual clip is for A < 0 only
    logprobs, mb = _row([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    _close(grad, [[0.0, 0.0, 2.0 / 3, 0.0]])
    assert m["clip_fraction"] == pytest.approx(2 / 3)
    loss_no_dual, _, _ = _run(PLAIN, *_row([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0]))
    assert loss_no_dual == pytest.approx((5.0 + 2.0 - 1.2) / 3)


# ----------------------------------------------------------------------------------------------- KL
# d = logp - logp_ref = [1, -2]; logr = -d = [-1, 2]
@pytest.mark.parametrize("kl_type,input_clamp,output_clamp,expected", [
    ("k1", None, None, [1.0, -2.0]),
    ("k2", None, None, [0.5, 2.0]),
    ("k3", None, None, [0.3678794, 4.3890561]),  # exp(logr) - logr - 1: e^-1; e^2 - 3
    ("k1", 1.5, None, [1.0, -1.5]),
    ("k2", 1.5, None, [0.5, 1.125]),
    ("k3", 1.5, None, [0.3678794, 1.9816891]),  # e^1.5 - 2.5
    ("k1", None, 1.0, [1.0, -1.0]),
    ("k2", None, 1.0, [0.5, 1.0]),
    ("k3", None, 1.0, [0.3678794, 1.0]),
    ("k3", 1.5, 1.0, [0.3678794, 1.0]),
])
def test_calculate_kl(kl_type, input_clamp, output_clamp, expected):
    logp = _t([[-1.0, -3.0]])
    ref = _t([[-2.0, -1.0]])
    _close(calculate_kl(logp, ref, kl_type, input_clamp, output_clamp), [expected])


def test_calculate_kl_rejects_unknown_type():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        calculate_kl(_t([0.0]), _t([0.0]), "k4")


@pytest.mark.parametrize("kl_type,input_clamp,output_clamp,kl_tokens,grad_tokens", [
    # per token kl and d(term)/d logp, with d = logp - logp_ref = [1, -2]; term = w * k, w = exp(logp - sg(logp))
    ("k1", None, None, [1.0, -2.0], [2.0, -1.0]),  # k1 + dk1/dlogp = d + 1 (the score term k1 included)
    ("k2", None, None, [0.5, 2.0], [1.0, -2.0]),  # dk2/dlogp = d, no score term
    ("k2", 1.5, None, [0.5, 1.125], [1.0, 0.0]),  # the clamped token has no gradient
    ("k3", None, None, [0.3678794, 4.3890561], [1.0, -2.0]),  # k3 + 1 - exp(-d) = d
    ("k3", None, 1.0, [0.3678794, 1.0], [1.0, 0.0]),  # the output clamp bounds the weighted term
])
def test_kl_penalty_in_loss(kl_type, input_clamp, output_clamp, kl_tokens, grad_tokens):
    beta = 0.5
    cfg = replace(PLAIN, reference_policy_kl_penalty=beta, reference_policy_kl_type=kl_type,
                  kl_input_clamp_value=input_clamp, kl_output_clamp_value=output_clamp)
    # ratio 1 and A = 0: the actor term is 0, the loss is beta * mean kl
    logprobs, mb = _row([1.0, 1.0], [0.0, 0.0], prev=-2.0, ref=[-3.0, 0.0])
    loss, grad, m = _run(cfg, logprobs, mb)
    assert m["kl_penalty"] == pytest.approx(sum(kl_tokens) / 2)  # reported before the factor beta
    assert loss == pytest.approx(beta * sum(kl_tokens) / 2) and m["actor_loss"] == 0.0
    _close(grad, [[0.0] + [beta * g / 2 for g in grad_tokens]])


@pytest.mark.parametrize("kl_type", ["k1", "k2"])
def test_on_policy_kl_approximation_weights_by_pi_over_generation(kl_type):
    cfg = replace(PLAIN, reference_policy_kl_penalty=1.0, reference_policy_kl_type=kl_type,
                  use_on_policy_kl_approximation=True)
    # logp - prev = ln [2, 0.5] (A = 0), d = logp - ref = [1, -2]. The samples come from the generation engine
    # (gen = -3), so the weight is w = exp(logp - gen) = [2e, e / 2], not exp(logp - prev) = [2, 0.5].
    ref = [-2.0 + LN(2.0) - 1.0, -2.0 + LN(0.5) + 2.0]
    row = lambda: _row([2.0, 0.5], [0.0, 0.0], prev=-2.0, gen=[-3.0, -3.0], ref=ref)  # noqa: E731
    w, d, e = [2 * math.e, math.e / 2], [1.0, -2.0], math.e
    loss, grad, _ = _run(cfg, *row())
    k = d if kl_type == "k1" else [x * x / 2 for x in d]
    assert loss == pytest.approx((w[0] * k[0] + w[1] * k[1]) / 2)
    if kl_type == "k1":  # the weight carries the score term: d(w k1)/dlogp = w (k1 + 1)
        _close(grad, [[0.0, 2 * e, -e / 4]])
    else:  # k2's own gradient is the KL's: weight detached, d(w k2)/dlogp = w d
        _close(grad, [[0.0, e, -e / 2]])
    loss_off, grad_off, _ = _run(replace(cfg, use_on_policy_kl_approximation=False), *row())
    assert loss_off == pytest.approx(sum(k) / 2)
    _close(grad_off, [[0.0, 1.0, -0.5]] if kl_type == "k1" else [[0.0, 0.5, -1.0]])


def test_kl_needs_reference_logprobs():
    cfg = replace(PLAIN, reference_policy_kl_penalty=0.1)
    logprobs, mb = _row([1.0], [1.0])
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        _run(cfg, logprobs, mb)


# ----------------------------------------------------------------------------------------------- IS correction
@pytest.mark.parametrize("cap,weights", [(None, [3.0, 0.5]), (2.0, [2.0, 0.5])])
def test_importance_sampling_correction(cap, weights):
    cfg = replace(PLAIN, use_importance_sampling_correction=True, truncated_importance_sampling_ratio=cap)
    # w = exp(prev - gen) = [3, 0.5], capped at 2; ratio 1 and A = 1: actor per token = -w
    logprobs, mb = _row([1.0, 1.0], [1.0, 1.0], prev=-1.0, gen=[-1.0 - LN(3.0), -1.0 - LN(0.5)])
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx(-sum(weights) / 2)
    assert m["is_weight"] == pytest.approx(sum(weights) / 2)
    _close(grad, [[0.0] + [-w / 2 for w in weights]])


def test_truncation_without_correction_is_an_error():
    with pytest.raises(ValueError, match="use_importance_sampling_correction"):
        make_loss("clipped_pg", replace(PLAIN, truncated_importance_sampling_ratio=2.0))


def test_approx_entropy():
    # -exp(logp - gen) * logp: logp = ln 0.5, gen = ln 0.25 -> 2 ln 2; logp = gen = ln 0.5 -> ln 2
    logprobs, mb = _row([1.0, 1.0], [0.0, 0.0], prev=LN(0.5), gen=[LN(0.25), LN(0.5)])
    _, _, m = _run(PLAIN, logprobs, mb)
    assert m["approx_entropy"] == pytest.approx((2 * LN(2.0) + LN(2.0)) / 2)


# ----------------------------------------------------------------------------------------------- aggregation
def _two_samples():
    """Sample 0: one response token (A = 4); sample 1: three (A = 1, 2, 3); sample 2 dropped by sample_mask.
    ratio 1 everywhere, so the per-token loss is -A."""
    mb = {
        "token_mask": _t([[0, 1, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]]),
        "sample_mask": _t([1.0, 1.0, 0.0]),
        "advantages": _t([[0, 4, 0, 0], [0, 1, 2, 3], [9, 9, 9, 9]]),
        "prev_logprobs": torch.full((3, 4), -1.0, dtype=F64),
        "generation_logprobs": torch.full((3, 4), -1.0, dtype=F64),
    }
    logprobs = torch.full((3, 4), -1.0, dtype=F64)
    logprobs[2] = 5.0
    return logprobs.requires_grad_(True), mb


def test_token_level_loss():
    logprobs, mb = _two_samples()
    loss, grad, m = _run(PLAIN, logprobs, mb)
    assert loss == pytest.approx((-4 - 1 - 2 - 3) / 4)  # every token weighs the same
    _close(grad, [[0, -1, 0, 0], [0, -0.25, -0.5, -0.75], [0, 0, 0, 0]])


def test_sequence_level_loss():
    logprobs, mb = _two_samples()
    loss, grad, m = _run(replace(PLAIN, token_level_loss=False), logprobs, mb)
    assert loss == pytest.approx((-4 + (-1 - 2 - 3) / 3) / 2)  # every sample weighs the same
    _close(grad, [[0, -2, 0, 0], [0, -1 / 6, -2 / 6, -3 / 6], [0, 0, 0, 0]])


def test_masked_positions_never_leak():
    logprobs, mb = _two_samples()
    with torch.no_grad():
        logprobs[2] = float("nan")
        logprobs[0, 0] = float("inf")
    mb["prev_logprobs"][0, 2] = float("-inf")
    mb["generation_logprobs"][1, 0] = float("nan")
    cfg = replace(PLAIN, use_importance_sampling_correction=True, reference_policy_kl_penalty=0.1,
                  use_on_policy_kl_approximation=True, kl_input_clamp_value=None, kl_output_clamp_value=None)
    mb["reference_policy_logprobs"] = torch.full((3, 4), -1.0, dtype=F64)
    mb["reference_policy_logprobs"][2, 1] = float("inf")
    loss, grad, m = _run(cfg, logprobs, mb)
    assert loss == pytest.approx(-10 / 4)
    assert torch.isfinite(grad).all() and grad[2].abs().sum() == 0 and grad[0, 0] == 0
    assert all(math.isfinite(v) for v in m.values())


def test_aggregate_with_no_valid_token_is_zero():
    zero = aggregate_loss(torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2), 0.0, 0.0, mode="token_mean")
    assert zero.item() == 0.0
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0


# ----------------------------------------------------------------------------------------------- invariance
def _random_batch(B=8, T=9, seed=0):
    """Uneven prompts and responses per sample, one sample dropped, ratios spread wide enough to clip."""
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(B, T, dtype=F64)
    for i in range(B):
        start = 1 + i % 3
        token_mask[i, start : start + 1 + (5 * i) % (T - start)] = 1.0
    sample_mask = torch.ones(B, dtype=F64)
    sample_mask[3] = 0.0

    def rand(scale: float) -> torch.Tensor:
        return scale * torch.randn(B, T, generator=g, dtype=F64)

    prev = -1.5 + rand(0.5)
    mb = {
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": rand(1.0)[:, :1] * token_mask,
        "prev_logprobs": prev,
        "generation_logprobs": prev + rand(0.3),
        "reference_policy_logprobs": prev + rand(0.5),
    }
    return prev + rand(0.4), mb


def _split_loss(loss_fn, logprobs, mb, bounds):
    """Sum of contributions over row ranges [a, b): value, metrics summed, gradient w.r.t. the whole logprobs."""
    mb = with_loss_mask(mb)
    gvs, gvt = mb["sample_mask"].sum(), mb["loss_mask"].sum()  # over the whole global batch
    leaf = logprobs.detach().clone().requires_grad_(True)
    total, metrics = 0.0, {}
    for a, b in bounds:
        loss, m = loss_fn(leaf[a:b], {k: v[a:b] for k, v in mb.items()}, gvs, gvt)
        loss.backward()
        total += loss.item()
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v
    return total, leaf.grad, metrics


ALL_ON = LossConfig(reference_policy_kl_penalty=0.1, reference_policy_kl_type="k3", ratio_clip_max=0.28,
                    ratio_clip_c=3.0, use_on_policy_kl_approximation=True, use_importance_sampling_correction=True,
                    truncated_importance_sampling_ratio=1.2)


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("base", [PLAIN, ALL_ON], ids=["plain", "all_options"])
def test_micro_batches_and_data_parallel_give_identical_loss_and_grad(token_level, base):
    loss_fn = make_loss("clipped_pg", replace(base, token_level_loss=token_level))
    logprobs, mb = _random_batch()
    whole, grad_whole, m_whole = _split_loss(loss_fn, logprobs, mb, [(0, 8)])
    layouts = {
        "4 micro-batches": [(0, 2), (2, 4), (4, 6), (6, 8)],
        "uneven micro-batches": [(0, 3), (3, 4), (4, 8)],
        # DP = 2: rank 0 holds rows 0-3, rank 1 rows 4-7, each in two micro-batches; normalizers stay global
        "dp=2 x 2 micro-batches": [(0, 1), (1, 4)] + [(4, 7), (7, 8)],
    }
    assert m_whole["clip_fraction"] > 0 and grad_whole.abs().sum() > 0  # the clipping paths are exercised
    for name, bounds in layouts.items():
        loss, grad, metrics = _split_loss(loss_fn, logprobs, mb, bounds)
        assert loss == pytest.approx(whole, abs=1e-6), name
        torch.testing.assert_close(grad, grad_whole, atol=1e-6, rtol=0, msg=name)
        assert metrics.keys() == m_whole.keys()
        for k in metrics:
            assert metrics[k] == pytest.approx(m_whole[k], abs=1e-6), (name, k)


def test_dp_shards_sum_to_the_global_loss():
    """Each DP rank computes its shard with the global normalizers; the sum is the single-rank loss."""
    loss_fn = make_loss("clipped_pg", replace(ALL_ON, token_level_loss=False))
    logprobs, mb = _random_batch(seed=3)
    whole, grad_whole, _ = _split_loss(loss_fn, logprobs, mb, [(0, 8)])
    shards = [_split_loss(loss_fn, logprobs, mb, [bounds]) for bounds in [(0, 4), (4, 8)]]
    assert shards[0][0] + shards[1][0] == pytest.approx(whole, abs=1e-6)
    torch.testing.assert_close(shards[0][1] + shards[1][1], grad_whole, atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------------------------- registry
def test_registry_and_pickling():
    assert LOSSES["clipped_pg"] is ClippedPGLoss
    with pytest.raises(ValueError, match="unknown loss 'ppo'.*clipped_pg"):
        make_loss("ppo", PLAIN)
    loss_fn = make_loss("clipped_pg", ALL_ON)
    clone = pickle.loads(pickle.dumps(loss_fn))
    logprobs, mb = _random_batch(seed=1)
    assert _split_loss(clone, logprobs, mb, [(0, 8)])[0] == _split_loss(loss_fn, logprobs, mb, [(0, 8)])[0]


def test_float32_inputs_give_float32_loss():
    logprobs, mb = _random_batch(seed=2)
    mb32 = with_loss_mask({k: v.float() for k, v in mb.items()})
    lp = logprobs.float().requires_grad_(True)
    loss, _ = make_loss("clipped_pg", ALL_ON)(lp, mb32, mb32["sample_mask"].sum(), mb32["loss_mask"].sum())
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(_split_loss(make_loss("clipped_pg", ALL_ON), logprobs, mb, [(0, 8)])[0],
                                        abs=1e-5)


# ----------------------------------------------------------------------------------------------- mismatch
def test_mismatch_metrics_nemo_rl_worked_example():
    # NeMo RL guide: generation -5, policy -15. A second, masked token must not count.
    policy, gen = _t([[-15.0, 0.0]]), _t([[-5.0, -40.0]])
    m = generation_mismatch_metrics(policy, gen, _t([[1.0, 0.0]]))
    assert m["gen_kl_error"] == pytest.approx(9.0000454, abs=1e-6)  # exp(-10) + 10 - 1
    assert m["policy_kl_error"] == pytest.approx(22015.4658, abs=1e-3)  # exp(10) - 10 - 1
    assert m["token_mult_prob_error"] == pytest.approx(22026.4658, abs=1e-3)  # exp(10)
    assert m["sampling_importance_ratio"] == pytest.approx(4.539993e-5, abs=1e-10)  # exp(-10)
    # m = log((e^-15 + e^-5) / 2); 0.5 * (k3(-15 - m) + k3(-5 - m))
    assert m["js_divergence_error"] == pytest.approx(4.3068982, abs=1e-6)


def test_mismatch_metrics_average_over_masked_tokens():
    # token 1: policy ln 0.5, gen ln 0.25 (x = ln 2); token 2: identical. Row 2 is masked out.
    policy = _t([[LN(0.5), -1.0], [3.0, 3.0]])
    gen = _t([[LN(0.25), -1.0], [-9.0, -9.0]])
    m = generation_mismatch_metrics(policy, gen, _t([[1.0, 1.0], [0.0, 0.0]]))
    assert m["token_mult_prob_error"] == pytest.approx((2.0 + 1.0) / 2)
    assert m["sampling_importance_ratio"] == pytest.approx((2.0 + 1.0) / 2)
    assert m["gen_kl_error"] == pytest.approx((2.0 - LN(2.0) - 1.0) / 2)  # k3(ln 2) = 1 - ln 2
    assert m["policy_kl_error"] == pytest.approx((0.5 + LN(2.0) - 1.0) / 2)  # k3(-ln 2) = ln 2 - 0.5


def test_mismatch_metrics_identical_inputs():
    lp = _t([[-0.1, -2.0, -7.5], [-3.0, -0.5, 0.0]])
    m = generation_mismatch_metrics(lp, lp.clone(), _t([[1, 1, 1], [1, 1, 0]]))
    assert m == {"token_mult_prob_error": 1.0, "gen_kl_error": 0.0, "policy_kl_error": 0.0,
                 "js_divergence_error": pytest.approx(0.0, abs=1e-12), "sampling_importance_ratio": 1.0}
