"""Policy-gradient losses over per-token log-probs, and the generation/training mismatch metrics.

A loss sees tensors only, never a model or a process group:

    loss, metrics = loss_fn(logprobs, mb, global_valid_seqs, global_valid_toks)

- logprobs [b, T]: current-policy log-probs of one micro-batch (with grad); logprobs[:, t] =
  log p(input_ids[:, t] | input_ids[:, :t]), column 0 and padding 0.
- mb: the matching rows of the batch dict: token_mask [b, T], sample_mask [b], advantages [b, T],
  prev_logprobs [b, T], generation_logprobs [b, T], and reference_policy_logprobs [b, T] when the KL
  penalty is on.
- global_valid_toks = sum(token_mask * sample_mask[:, None]) and global_valid_seqs = sum(sample_mask),
  both over the WHOLE global batch (every micro-batch on every data-parallel rank).

`loss` and every value in `metrics` are this micro-batch's additive CONTRIBUTIONS: summed over all
micro-batches and data-parallel ranks they give the global-batch value, so results do not depend on the
micro-batch size or the parallel layout (verl `core_algos.py::agg_loss`, NeMo RL `masked_mean` with a
global normalization factor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Union

import torch

from nemo_grpo.config import LossConfig

Number = Union[torch.Tensor, float, int]
KL_TYPES = ("k1", "k2", "k3")

# ----------------------------------------------------------------------------------------------- registry
LOSSES: dict[str, type] = {}


def register_loss(name: str) -> Callable[[type], type]:
    """Class decorator: make the loss buildable as make_loss(name, cfg)."""

    def register(cls: type) -> type:
        if name in LOSSES:
            raise ValueError(f"loss '{name}' is registered twice ({LOSSES[name].__name__}, {cls.__name__})")
        LOSSES[name] = cls
        return cls

    return register


def make_loss(name: str, cfg: LossConfig):
    """The registered loss `name` built from cfg; an unknown name lists the known ones."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss '{name}'; known losses: {', '.join(sorted(LOSSES))}")
    return LOSSES[name](cfg)


# ----------------------------------------------------------------------------------------------- helpers
def _safe_div(num: torch.Tensor, den: Number) -> torch.Tensor:
    """num / den, with 0 / 0 = 0 (a batch with no valid token contributes nothing instead of nan)."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return num / torch.where(den != 0, den, torch.ones_like(den))


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """sum(values * mask) over `dim` (all dims when None). Where mask is 0 the value is never read, so an
    inf or nan there does not leak into the sum."""
    weighted = torch.where(mask != 0, values * mask, torch.zeros_like(values))
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None,
                global_normalization_factor: Optional[Number] = None) -> torch.Tensor:
    """masked_sum / sum(mask) over `dim`, or / global_normalization_factor when given (then the result is a
    contribution to a global mean). An empty mask gives 0."""
    den = mask.sum() if dim is None else mask.sum(dim)
    if global_normalization_factor is not None:
        den = global_normalization_factor
    return _safe_div(masked_sum(values, mask, dim), den)


def aggregate_loss(values: torch.Tensor, token_mask: torch.Tensor, sample_mask: torch.Tensor,
                   global_valid_seqs: Number, global_valid_toks: Number, token_level: bool) -> torch.Tensor:
    """Reduce a per-token quantity values [b, T] to this micro-batch's scalar contribution.

    token_level: sum(values * token_mask * sample_mask) / global_valid_toks (every token weighs the same;
    DAPO's token-level loss). Otherwise (sequence level, the GRPO paper): the mean of each sample over its
    own valid tokens, then sum(that * sample_mask) / global_valid_seqs (every sample weighs the same).
    """
    if token_level:
        return _safe_div(masked_sum(values, token_mask * sample_mask[:, None]), global_valid_toks)
    per_sample = masked_mean(values, token_mask, dim=-1)  # [b]
    return _safe_div(masked_sum(per_sample, sample_mask), global_valid_seqs)


def _k3(x: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 term exp(x) - x - 1 (>= 0, 0 at x = 0)."""
    return torch.exp(x) - x - 1


def calculate_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str = "k3",
                 input_clamp: Optional[float] = 20.0, output_clamp: Optional[float] = 10.0) -> torch.Tensor:
    """Per-token estimate [b, T] of KL(pi || pi_ref) from samples of pi (Schulman 2020,
    http://joschu.net/blog/kl-approx.html), with logr = ref_logprobs - logprobs:

        k1 = -logr = logp - logr_ref          (unbiased, can be negative)
        k2 = logr^2 / 2                       (biased, low variance)
        k3 = exp(logr) - logr - 1             (unbiased, >= 0)

    input_clamp clamps logr to [-input_clamp, input_clamp] before the estimator, output_clamp clamps the
    result to [-output_clamp, output_clamp] (as NeMo RL's calculate_kl); None disables either.
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


def _finite_weights(log_w: torch.Tensor) -> torch.Tensor:
    """exp(log_w), detached; nan and +-inf become 0 (a token with an overflowing weight is dropped, as NeMo RL)."""
    return torch.nan_to_num(torch.exp(log_w.detach()), nan=0.0, posinf=0.0, neginf=0.0)


# ----------------------------------------------------------------------------------------------- clipped PG
@register_loss("clipped_pg")
@dataclass
class ClippedPGLoss:
    """Clipped policy-gradient loss with an optional KL penalty to a reference policy (NeMo RL's ClippedPGLossFn).

    PPO (Schulman et al. 2017, https://arxiv.org/abs/1707.06347) / GRPO (https://arxiv.org/abs/2402.03300),
    per valid token with ratio r = exp(logprobs - prev_logprobs) and advantage A:

        actor = max(-A * r, -A * clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max))
        loss  = aggregate(w * actor) + beta * aggregate(v * kl(logprobs, reference_policy_logprobs))

    - ratio_clip_min != ratio_clip_max is DAPO's clip-higher (https://arxiv.org/abs/2503.14476).
    - ratio_clip_c = c enables dual clipping (Ye et al. 2019, https://arxiv.org/abs/1912.09729): for A < 0,
      actor = min(actor, -A * c), which bounds the loss when r >> 1.
    - w = exp(prev_logprobs - generation_logprobs), detached, when use_importance_sampling_correction (corrects
      for the generation engine's probabilities differing from the trainer's), capped at
      truncated_importance_sampling_ratio (TIS) when set; else w = 1.
    - v = exp(logprobs - prev_logprobs), detached, when use_on_policy_kl_approximation (the KL estimator is
      meant for samples of the current policy; the samples come from the old one); else v = 1. Current
      NeMo RL code divides by generation_logprobs instead; we follow its guide's pi_theta / pi_theta_old.
    - aggregate: token- or sequence-level, see `aggregate_loss`.

    Metrics (contributions, see the module docstring): loss, actor_loss, kl_penalty (the aggregated KL
    before the factor beta, as NeMo RL), and per-token means over valid tokens: approx_entropy
    (-E[exp(logprobs - generation_logprobs) * logprobs], the entropy estimated from the generated samples),
    probs_ratio, probs_ratio_clamped, clip_fraction (tokens whose ratio term was clipped, dual clip included),
    and is_weight when the importance-sampling correction is on.

    Log-probs are computed in float32 at least. Positions outside token_mask * sample_mask are zeroed before
    any arithmetic, so whatever the back end left there (inf, nan) gives neither loss nor gradient.
    """

    cfg: LossConfig

    def __post_init__(self) -> None:
        c = self.cfg
        if c.reference_policy_kl_type not in KL_TYPES:
            raise ValueError(f"loss_fn.reference_policy_kl_type: got '{c.reference_policy_kl_type}'; "
                             f"known: {', '.join(KL_TYPES)}")
        if c.ratio_clip_c is not None and c.ratio_clip_c <= 1:
            raise ValueError(f"loss_fn.ratio_clip_c: dual-clip constant must be > 1, got {c.ratio_clip_c}")
        if c.truncated_importance_sampling_ratio is not None and not c.use_importance_sampling_correction:
            raise ValueError("loss_fn.truncated_importance_sampling_ratio is set but "
                             "loss_fn.use_importance_sampling_correction is false; enable the correction or "
                             "set the ratio to null")

    def __call__(self, logprobs: torch.Tensor, mb: dict[str, torch.Tensor], global_valid_seqs: Number,
                 global_valid_toks: Number) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        token_mask = mb["token_mask"].to(dtype)  # [b, T]
        sample_mask = mb["sample_mask"].to(dtype)  # [b]
        mask = token_mask * sample_mask[:, None]  # [b, T]

        def valid(x: torch.Tensor) -> torch.Tensor:  # [b, T], 0 outside trained tokens
            return torch.where(mask != 0, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))

        curr, prev, gen = valid(logprobs), valid(mb["prev_logprobs"]), valid(mb["generation_logprobs"])
        actor_tok, stats = self._actor_per_token(curr, prev, gen, valid(mb["advantages"]))  # [b, T]
        aggregate = partial(aggregate_loss, token_mask=token_mask, sample_mask=sample_mask,
                            global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
                            token_level=c.token_level_loss)
        actor_loss = aggregate(actor_tok)
        loss = actor_loss
        kl = torch.zeros((), dtype=dtype, device=logprobs.device)
        if c.reference_policy_kl_penalty > 0:
            if "reference_policy_logprobs" not in mb:
                raise KeyError("loss_fn.reference_policy_kl_penalty > 0 needs 'reference_policy_logprobs' in the batch")
            kl = aggregate(self._kl_per_token(curr, prev, valid(mb["reference_policy_logprobs"])))
            loss = actor_loss + c.reference_policy_kl_penalty * kl

        with torch.no_grad():
            def per_token(v: torch.Tensor) -> float:  # contribution to the mean over the global batch's tokens
                return _safe_div(masked_sum(v, mask), global_valid_toks).item()

            metrics = {
                "loss": loss.item(),
                "actor_loss": actor_loss.item(),
                "kl_penalty": kl.item(),
                "approx_entropy": per_token(-torch.exp(curr - gen) * curr),
                **{name: per_token(v) for name, v in stats.items()},
            }
        return loss, metrics

    def _actor_per_token(self, curr: torch.Tensor, prev: torch.Tensor, gen: torch.Tensor,
                         adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Clipped (and dual-clipped, IS-weighted) actor loss per token [b, T], and detached per-token stats."""
        c = self.cfg
        ratio = torch.exp(curr - prev)  # [b, T]
        clamped = ratio.clamp(1.0 - c.ratio_clip_min, 1.0 + c.ratio_clip_max)
        loss_unclipped, loss_clipped = -adv * ratio, -adv * clamped
        actor = torch.max(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped  # the max picked the clipped term: no gradient through r
        if c.ratio_clip_c is not None:
            loss_dual = -adv * c.ratio_clip_c
            dual = (adv < 0) & (loss_dual < actor)
            actor = torch.where(dual, loss_dual, actor)
            clipped = clipped | dual
        stats = {"probs_ratio": ratio.detach(), "probs_ratio_clamped": clamped.detach(),
                 "clip_fraction": clipped.to(curr.dtype)}
        if c.use_importance_sampling_correction:
            w = _finite_weights(prev - gen)  # [b, T]
            if c.truncated_importance_sampling_ratio is not None:
                w = w.clamp(max=c.truncated_importance_sampling_ratio)
            actor = actor * w
            stats["is_weight"] = w
        return actor, stats

    def _kl_per_token(self, curr: torch.Tensor, prev: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        """KL(pi || pi_ref) estimate per token [b, T], importance-weighted under the on-policy approximation."""
        c = self.cfg
        kl = calculate_kl(curr, ref, c.reference_policy_kl_type, c.kl_input_clamp_value, c.kl_output_clamp_value)
        if c.use_on_policy_kl_approximation:
            kl = kl * _finite_weights(curr - prev)
        return kl


# ----------------------------------------------------------------------------------------------- mismatch
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
