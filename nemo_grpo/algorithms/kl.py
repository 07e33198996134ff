"""KL estimators, the KL penalty whose gradient follows KL(pi || pi_ref), and the generation mismatch metrics.

Per-token estimators of KL(pi || pi_ref) from a token x sampled from pi (Schulman 2020,
http://joschu.net/blog/kl-approx.html), with logr = log pi_ref(x) - log pi(x):

    k1 = -logr                 E_pi[k1] = KL(pi || pi_ref)     unbiased, can be negative
    k2 = logr^2 / 2            E_pi[k2] != KL                  biased, low variance
    k3 = exp(logr) - logr - 1  E_pi[k3] = KL(pi || pi_ref)     unbiased, >= 0

The value of an estimator is not its gradient. The samples depend on theta, so
grad KL(pi_theta || pi_ref) = E_pi[(log pi - log pi_ref) * grad log pi]. Differentiating only through k
gives, in expectation: k1 -> 0 (E_pi[grad log pi] = 0), k3 -> grad KL(pi_ref || pi) (the reverse KL), and
k2 -> grad KL(pi || pi_ref), because grad k2 = (log pi - log pi_ref) grad log pi. So `kl_penalty_per_token`
adds the score-function term k * grad log pi to k1 and k3 (the per-token term is w * k with
w = exp(logp - stop_grad(logp)), value 1, gradient grad log pi), and leaves k2 as it is; every estimator's
expected gradient is then grad KL(pi || pi_ref) (Tang & Munos 2025, "On a few pitfalls in KL divergence
gradient estimation for RL").

Under the on-policy approximation the tokens come from the generation engine's policy mu, not pi; the
importance weight is then w = exp(logp - generation_logp) (its value pi/mu, gradient (pi/mu) grad log pi
for k1 and k3; detached for k2), so E_mu[...] is again grad KL(pi || pi_ref).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from nemo_grpo.algorithms.masked import masked_mean, masked_sum

KL_TYPES = ("k1", "k2", "k3")


def _k3(x: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 term exp(x) - x - 1 (>= 0, 0 at x = 0)."""
    return torch.exp(x) - x - 1


def calculate_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str = "k3",
                 input_clamp: Optional[float] = 20.0, output_clamp: Optional[float] = None) -> torch.Tensor:
    """The value [b, T] of the per-token estimator `kl_type` (see the module docstring).

    input_clamp clamps logr = ref_logprobs - logprobs to [-input_clamp, input_clamp] before the estimator (so
    exp(logr) and its gradient stay finite); output_clamp clamps the result to [-output_clamp, output_clamp];
    None disables either.
    """
    logr = ref_logprobs - logprobs  # [b, T]
    if input_clamp is not None:
        logr = logr.clamp(-input_clamp, input_clamp)
    if kl_type == "k1":
        kl = -logr
    elif kl_type == "k2":
        kl = logr.square() / 2
    elif kl_type == "k3":
        kl = _k3(logr)
    else:
        raise ValueError(f"unknown kl_type '{kl_type}'; known: {', '.join(KL_TYPES)}")
    if output_clamp is not None:
        kl = kl.clamp(-output_clamp, output_clamp)
    return kl


def score_weight(log_w: torch.Tensor, clamp: Optional[float]) -> torch.Tensor:
    """exp(log_w) [b, T] WITH its gradient exp(log_w) * grad log_w; log_w clamped to [-clamp, clamp] first
    (None: unclamped). Where exp overflows to inf (or log_w is nan) the weight is 0 and so is its gradient."""
    if clamp is not None:
        log_w = log_w.clamp(-clamp, clamp)
    finite = torch.isfinite(torch.exp(log_w.detach()))
    safe = torch.where(finite, log_w, torch.zeros_like(log_w))
    return torch.where(finite, torch.exp(safe), torch.zeros_like(safe))


def kl_penalty_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, generation_logprobs: torch.Tensor,
                         kl_type: str, on_policy_approximation: bool, input_clamp: Optional[float] = 20.0,
                         output_clamp: Optional[float] = 10.0) -> torch.Tensor:
    """Per-token KL penalty term [b, T] whose expected gradient is grad KL(pi || pi_ref) (module docstring).

    logprobs [b, T] (with grad), ref_logprobs and generation_logprobs [b, T]. The term is w * k with
    k = calculate_kl(logprobs, ref_logprobs, kl_type, input_clamp) and w the score or importance weight;
    output_clamp then bounds the weighted term w * k of each token (a large weight cannot escape it), and
    input_clamp also bounds log w, so every gradient is finite.
    """
    kl = calculate_kl(logprobs, ref_logprobs, kl_type, input_clamp)
    log_w = (logprobs - generation_logprobs) if on_policy_approximation else (logprobs - logprobs.detach())
    w = score_weight(log_w, input_clamp)
    term = kl * (w.detach() if kl_type == "k2" else w)
    if output_clamp is not None:
        term = term.clamp(-output_clamp, output_clamp)
    return term


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kl_type: str,
                input_clamp: Optional[float] = 20.0) -> torch.Tensor:
    """Per-sample KL estimate [b]: the sum over the sample's response tokens (mask [b, T]) of the per-token
    estimator, for loss_fn.use_kl_in_reward (the sequence's KL(pi || pi_ref) as a reward penalty)."""
    return masked_sum(calculate_kl(logprobs, ref_logprobs, kl_type, input_clamp), mask, dim=-1)


def generation_mismatch_metrics(policy_logprobs: torch.Tensor, generation_logprobs: torch.Tensor,
                                mask: torch.Tensor) -> dict[str, float]:
    """How far the generation engine's log-probs are from the trainer's, as full-batch masked means.

    policy_logprobs, generation_logprobs, mask: [B, T] (mask = token_mask * sample_mask). Names and formulas
    are NeMo RL's (docs/guides/grpo.md#metrics); with x = policy - generation and k3(x) = exp(x) - x - 1:

        token_mult_prob_error     mean exp(|x|)                       1.0 when they match
        gen_kl_error              mean k3(x)                          KL(P_gen || P_policy), gen as ground truth
        policy_kl_error           mean k3(-x)                         KL(P_policy || P_gen)
        js_divergence_error       mean (k3(policy - m) + k3(gen - m)) / 2, m = log((P_policy + P_gen) / 2)
        sampling_importance_ratio mean exp(x)                         1.0 when they match

    Worked example (NeMo RL guide): generation -5, policy -15 -> gen_kl_error ~ 9, policy_kl_error ~ 22015.
    """
    with torch.no_grad():
        dtype = torch.promote_types(policy_logprobs.dtype, torch.float32)
        mask = mask.to(dtype)
        zero = torch.zeros((), dtype=dtype, device=mask.device)
        p = torch.where(mask != 0, policy_logprobs.to(dtype), zero)  # [B, T]
        g = torch.where(mask != 0, generation_logprobs.to(dtype), zero)  # [B, T]
        x = p - g
        m = torch.logaddexp(p, g) - math.log(2.0)  # log of the mixture's probability

        def mean(v: torch.Tensor) -> float:
            return masked_mean(v, mask).item()

        return {
            "token_mult_prob_error": mean(torch.exp(x.abs())),
            "gen_kl_error": mean(_k3(x)),
            "policy_kl_error": mean(_k3(-x)),
            "js_divergence_error": mean(0.5 * (_k3(p - m) + _k3(g - m))),
            "sampling_importance_ratio": mean(torch.exp(x)),
        }
