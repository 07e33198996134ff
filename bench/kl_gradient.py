"""Expected gradient of the KL penalty against the true grad KL(pi || pi_ref), exactly, before and after issue 14.

A categorical distribution over V tokens: pi = softmax(theta), pi_ref, the generation engine's mu and the
old policy pi_old all differ. Each token is one sample; its gradient is weighted by the probability that the
sampler draws it (pi without the on-policy approximation, mu with it). Prints, per estimator, the relative
error |E[grad] - grad KL| / |grad KL| and the cosine with grad KL(pi || pi_ref) and grad KL(pi_ref || pi).

    python bench/kl_gradient.py
"""

import argparse

import torch
from timing import machine_line  # bench/timing.py

from nemo_grpo.algorithms.kl import KL_TYPES, calculate_kl, kl_penalty_per_token

F64 = torch.float64


def penalty_before(logp, ref, gen, prev, kl_type, approx):
    """The per-token term as it was before issue 14: the estimator, times exp(logp - prev_logp) detached
    under the approximation; differentiated through the estimator only."""
    kl = calculate_kl(logp, ref, kl_type, input_clamp=None)
    return kl * torch.exp(logp - prev).detach() if approx else kl


def penalty_after(logp, ref, gen, prev, kl_type, approx):
    return kl_penalty_per_token(logp, ref, gen, kl_type, approx, input_clamp=None, output_clamp=None)


def expected_gradient(penalty, kl_type: str, approx: bool, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(vocab, generator=g, dtype=F64).requires_grad_(True)
    ref, gen, prev = (torch.log_softmax(torch.randn(vocab, generator=g, dtype=F64), -1) for _ in range(3))
    logp = torch.log_softmax(theta, -1)
    term = penalty(logp[:, None], ref[:, None], gen[:, None], prev[:, None], kl_type, approx)[:, 0]
    q = (gen if approx else logp).exp().detach()
    grads = [torch.autograd.grad(f, theta, retain_graph=True)[0] for f in (
        (q * term).sum(), (logp.exp() * (logp - ref)).sum(), (ref.exp() * (ref - logp)).sum())]
    return grads  # expected, grad KL(pi || ref), grad KL(ref || pi)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=7)
    ap.add_argument("--seeds", type=int, default=20)
    args = ap.parse_args()
    print(machine_line(), flush=True)
    cos = torch.nn.functional.cosine_similarity
    print(f"{'estimator':<10}{'sampler':<9}{'code':<8}{'rel. error':>12}{'cos fwd KL':>12}{'cos rev KL':>12}")
    for kl_type in KL_TYPES:
        for approx in (False, True):
            for name, penalty in (("before", penalty_before), ("after", penalty_after)):
                err, fwd, rev = 0.0, 0.0, 0.0
                for seed in range(args.seeds):
                    e, kl_fwd, kl_rev = expected_gradient(penalty, kl_type, approx, args.vocab, seed)
                    err += ((e - kl_fwd).norm() / kl_fwd.norm()).item() / args.seeds
                    fwd += cos(e, kl_fwd, dim=0).item() / args.seeds
                    rev += cos(e, kl_rev, dim=0).item() / args.seeds
                sampler = "mu" if approx else "pi"
                print(f"{kl_type:<10}{sampler:<9}{name:<8}{err:>12.2e}{fwd:>12.3f}{rev:>12.3f}")


if __name__ == "__main__":
    main()
