"""The KL penalty's expected gradient is grad KL(pi || pi_ref), for k1, k2 and k3, with and without the
on-policy approximation: computed exactly on a small categorical distribution by enumerating every token."""

import pytest
import torch

from nemo_grpo.algorithms.kl import KL_TYPES, kl_penalty_per_token, score_weight

F64 = torch.float64
V = 7  # tokens of the categorical distribution


def _dists():
    """pi_theta (logits with grad), pi_ref, and the generation engine's mu: three different distributions."""
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(V, generator=g, dtype=F64).requires_grad_(True)
    ref = torch.log_softmax(torch.randn(V, generator=g, dtype=F64), -1)
    gen = torch.log_softmax(torch.randn(V, generator=g, dtype=F64), -1)
    return theta, ref, gen


def expected_penalty_gradient(kl_type: str, on_policy_approximation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(E_q[grad term(x)], grad KL(pi || pi_ref)) w.r.t. the logits, both [V], exactly.

    Every token x is one "sample" (a row of the [V, 1] batch); its gradient is weighted by the probability
    q(x) that the sampler draws it: q = pi itself without the approximation (on-policy samples), q = mu (the
    generation engine) with it.
    """
    theta, ref, gen = _dists()
    logp = torch.log_softmax(theta, -1)  # [V]
    term = kl_penalty_per_token(logp[:, None], ref[:, None], gen[:, None], kl_type, on_policy_approximation,
                                input_clamp=None, output_clamp=None)[:, 0]  # [V]: the term of each token
    q = (gen if on_policy_approximation else logp).exp().detach()
    (expected,) = torch.autograd.grad((q * term).sum(), theta, retain_graph=True)
    true_kl = (logp.exp() * (logp - ref)).sum()
    (true,) = torch.autograd.grad(true_kl, theta)
    return expected, true


@pytest.mark.parametrize("on_policy_approximation", [False, True], ids=["on_policy", "approx"])
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_expected_gradient_is_the_kl_gradient(kl_type, on_policy_approximation):
    expected, true = expected_penalty_gradient(kl_type, on_policy_approximation)
    assert true.abs().max() > 0.05  # a gradient worth comparing
    torch.testing.assert_close(expected, true, atol=1e-12, rtol=1e-10)


def test_output_clamp_bounds_the_weighted_term():
    """A large importance weight (logp - gen = 5) times a small KL must not escape the clamp."""
    logp = torch.tensor([[-1.0, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-2.0, -1.5]], dtype=F64)  # k1 = [1, 0.5]
    gen = torch.tensor([[-6.0, -1.0]], dtype=F64)  # w = [e^5, 1]
    term = kl_penalty_per_token(logp, ref, gen, "k1", True, input_clamp=20.0, output_clamp=2.0)
    torch.testing.assert_close(term, torch.tensor([[2.0, 0.5]], dtype=F64))
    (grad,) = torch.autograd.grad(term.sum(), logp)
    assert grad[0, 0] == 0 and grad[0, 1] == pytest.approx(1.5)  # clamped: no gradient; else w (k1 + 1)


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_input_clamp_keeps_gradients_finite(kl_type):
    """Log-ratios of 1000 (a token the policy all but ruled out, an engine far off) overflow exp without the
    clamp; with it, the term and its gradient stay finite."""
    logp = torch.tensor([[-1000.0, -0.5]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[0.0, -1000.0]], dtype=F64)
    gen = torch.tensor([[-0.1, -0.1]], dtype=F64)
    for approx in (False, True):
        term = kl_penalty_per_token(logp, ref, gen, kl_type, approx, input_clamp=20.0, output_clamp=None)
        (grad,) = torch.autograd.grad(term.sum(), logp)
        assert torch.isfinite(term).all() and torch.isfinite(grad).all(), (kl_type, approx)


def test_score_weight_is_zero_where_exp_overflows():
    log_w = torch.tensor([1000.0, float("nan"), 0.5], dtype=F64, requires_grad=True)
    w = score_weight(log_w, clamp=None)
    (grad,) = torch.autograd.grad(w.sum(), log_w)
    torch.testing.assert_close(w.detach(), torch.tensor([0.0, 0.0, 0.5], dtype=F64).exp() * torch.tensor([0, 0, 1]))
    assert torch.isfinite(grad).all() and grad[2] == pytest.approx(torch.tensor(0.5).exp().item())
