"""Policy-gradient losses over per-token log-probs: the registry, the objectives (PPO/GRPO clip, GSPO, CISPO,
REINFORCE), truncated importance sampling and the loss aggregations.

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

from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch

from nemo_grpo.algorithms.kl import KL_TYPES, kl_penalty_per_token, score_weight
from nemo_grpo.algorithms.masked import Number, safe_div, masked_mean, masked_sum
from nemo_grpo.config import LossConfig
from nemo_grpo.errors import ConfigError, require, require_choice
from nemo_grpo.utils.registry import registrar

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
TRUNCATED_IS_TYPES = ("tis", "icepop", "seq-mask-tis")

# ----------------------------------------------------------------------------------------------- registry
LOSSES: dict[str, type] = {}


register_loss = registrar(LOSSES, "loss")  # @register_loss("name") on a loss class


def make_loss(name: str, cfg: LossConfig, max_sequence_length: Optional[int] = None):
    """The registered loss `name` built from cfg; an unknown name lists the known ones. max_sequence_length is
    Dr.GRPO's constant normalizer (policy.max_total_sequence_length)."""
    if name not in LOSSES:
        raise ConfigError(f"config key 'loss_fn.name': unknown loss '{name}'; known losses: "
                          f"{', '.join(sorted(LOSSES))}")
    return LOSSES[name](cfg, max_sequence_length)


# ----------------------------------------------------------------------------------------------- aggregation
def aggregation_of(cfg: LossConfig) -> str:
    """The loss aggregation in force: loss_fn.loss_aggregation, or the one token_level_loss names."""
    if cfg.loss_aggregation is not None:
        return cfg.loss_aggregation
    return "token_mean" if cfg.token_level_loss else "seq_mean_token_mean"


def aggregate_loss(values: torch.Tensor, token_mask: torch.Tensor, sample_mask: torch.Tensor,
                   global_valid_seqs: Number, global_valid_toks: Number, mode: str = "token_mean",
                   max_sequence_length: Optional[int] = None) -> torch.Tensor:
    """Reduce a per-token quantity values [b, T] to this micro-batch's scalar contribution.

    - token_mean: sum(values * token_mask * sample_mask) / global_valid_toks; every token weighs the same
      (DAPO's token-level loss, https://arxiv.org/abs/2503.14476).
    - seq_mean_token_mean: each sample's mean over its own valid tokens, then sum(that * sample_mask) /
      global_valid_seqs; every sample weighs the same (the GRPO paper).
    - seq_mean_token_sum_norm: each sample's SUM over its tokens / max_sequence_length, then as above
      (Dr.GRPO, https://arxiv.org/abs/2503.20783): a constant normalizer, so a token's weight does not depend
      on the length of its answer.
    """
    if mode == "token_mean":
        return safe_div(masked_sum(values, token_mask * sample_mask[:, None]), global_valid_toks)
    if mode == "seq_mean_token_mean":
        per_sample = masked_mean(values, token_mask, dim=-1)  # [b]
    elif mode == "seq_mean_token_sum_norm":
        if not max_sequence_length:
            raise ValueError("seq_mean_token_sum_norm needs max_sequence_length (policy.max_total_sequence_length)")
        per_sample = masked_sum(values, token_mask, dim=-1) / max_sequence_length  # [b]
    else:
        raise ValueError(f"unknown loss aggregation '{mode}'; known: {', '.join(AGGREGATIONS)}")
    return safe_div(masked_sum(per_sample, sample_mask), global_valid_seqs)


# ----------------------------------------------------------------------------------------------- objectives
def ppo_clip_objective(ratio: torch.Tensor, adv: torch.Tensor, clip_min: float, clip_max: float,
                       clip_c: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (https://arxiv.org/abs/1707.06347), as a loss.

    ratio, adv [b, T] (a GSPO sequence ratio broadcast over its tokens works the same):
    loss = max(-A r, -A clip(r, 1 - clip_min, 1 + clip_max)); clip_min != clip_max is DAPO's clip-higher.
    With clip_c (dual clip, https://arxiv.org/abs/1912.09729): for A < 0, loss = min(loss, -A c).
    Returns loss [b, T] and clipped [b, T] bool (the clipped or dual-clipped term was taken: no gradient).
    """
    clamped = ratio.clamp(1.0 - clip_min, 1.0 + clip_max)
    loss_unclipped, loss_clipped = -adv * ratio, -adv * clamped
    loss = torch.max(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if clip_c is not None:
        loss_dual = -adv * clip_c
        dual = (adv < 0) & (loss_dual < loss)
        loss = torch.where(dual, loss_dual, loss)
        clipped = clipped | dual
    return loss, clipped


def cispo_objective(ratio: torch.Tensor, logprobs: torch.Tensor, adv: torch.Tensor, clip_min: float,
                    clip_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): loss = -A * stop_grad(clip(r)) * logp per token.

    ratio, logprobs, adv [b, T]. The clipped importance weight scales the REINFORCE gradient instead of
    zeroing it, so every token keeps a gradient. Returns loss [b, T] and clipped [b, T] (the weight was clipped).
    """
    clamped = ratio.clamp(1.0 - clip_min, 1.0 + clip_max)
    return -adv * clamped.detach() * logprobs, (clamped != ratio)


def reinforce_objective(logprobs: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """REINFORCE (Williams 1992) per token: loss = -A * logp [b, T]; with the leave-one-out baseline it is
    RLOO (https://arxiv.org/abs/2402.14740). Unbiased only on-policy: one update per rollout batch."""
    return -adv * logprobs


def gspo_ratio(logprobs: torch.Tensor, prev_logprobs: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence ratio (https://arxiv.org/abs/2507.18071), broadcast to [b, T]:
    s_i = exp(mean over the sample's valid tokens of (logp - prev_logp)), the length-normalised likelihood ratio."""
    return torch.exp(masked_mean(logprobs - prev_logprobs, token_mask, dim=-1))[:, None].expand_as(logprobs)


def truncate_is_weights(w: torch.Tensor, kind: str, ratio_max: float, ratio_min: Optional[float],
                        token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling of detached weights w = pi_old / pi_gen [b, T] (token_mask [b, T]).

    - tis: clamp to [ratio_min or 0, ratio_max] (Yao et al. 2025, "Your efficient RL framework secretly
      brings you off-policy RL training").
    - icepop: zero the tokens whose weight is outside [ratio_min, ratio_max] (IcePop, Ring-1T / "The online
      IcePop solution for MoE models").
    - seq-mask-tis: zero whole samples whose geometric-mean weight exp(mean log w) is outside
      [ratio_min, ratio_max]; the kept samples keep their token weights.
    Returns the weights [b, T] and the out-of-bounds indicator, float [b, T] (per sample for seq-mask-tis).
    """
    if kind == "tis":
        low = 0.0 if ratio_min is None else ratio_min
        oob = (w > ratio_max) | (w < low)
        return w.clamp(low, ratio_max), oob.to(w.dtype)
    if kind == "icepop":
        keep = (w >= ratio_min) & (w <= ratio_max)
        return torch.where(keep, w, torch.zeros_like(w)), (~keep).to(w.dtype)
    if kind == "seq-mask-tis":
        log_w = torch.log(w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        geo = torch.exp(masked_mean(log_w, token_mask, dim=-1))[:, None]  # [b, 1]
        keep = (geo >= ratio_min) & (geo <= ratio_max)
        return w * keep.to(w.dtype), (~keep).to(w.dtype).expand_as(w)
    raise ValueError(f"unknown truncated importance sampling type '{kind}'; known: {', '.join(TRUNCATED_IS_TYPES)}")


# ----------------------------------------------------------------------------------------------- config checks
def check_loss_config(c: LossConfig) -> None:
    """Reject, naming the key, a loss_fn value or combination that makes no sense (ConfigError)."""
    key = "loss_fn."
    require_choice(c.reference_policy_kl_type, key + "reference_policy_kl_type", KL_TYPES)
    require(c.reference_policy_kl_penalty >= 0, key + "reference_policy_kl_penalty", "must be >= 0")
    require(0 <= c.ratio_clip_min < 1, key + "ratio_clip_min", f"must be in [0, 1), got {c.ratio_clip_min}")
    require(c.ratio_clip_max >= 0, key + "ratio_clip_max", f"must be >= 0, got {c.ratio_clip_max}")
    require(c.ratio_clip_c is None or c.ratio_clip_c > 1, key + "ratio_clip_c",
            f"the dual-clip constant must be > 1 (usually 3) or null, got {c.ratio_clip_c}")
    if c.loss_aggregation is not None:
        require_choice(c.loss_aggregation, key + "loss_aggregation", AGGREGATIONS)
    require(not c.use_kl_in_reward or c.reference_policy_kl_penalty > 0, key + "use_kl_in_reward",
            "needs loss_fn.reference_policy_kl_penalty > 0 (the KL coefficient)")
    require(not (c.disable_ppo_ratio and c.force_on_policy_ratio), key + "force_on_policy_ratio",
            "cannot be combined with loss_fn.disable_ppo_ratio (both remove the ratio); set one")
    _check_gspo_cispo(c, aggregation_of(c))
    _check_truncated_is(c)


def _check_gspo_cispo(c: LossConfig, aggregation: str) -> None:
    if c.sequence_level_importance_ratios:
        key = "loss_fn.sequence_level_importance_ratios"
        require(aggregation != "token_mean", key, "GSPO weighs sequences: set loss_fn.token_level_loss=false "
                "(or loss_fn.loss_aggregation to a seq_mean_* mode)")
        for other in ("disable_ppo_ratio", "force_on_policy_ratio"):
            require(not getattr(c, other), key, f"cannot be combined with loss_fn.{other} (GSPO needs the ratio)")
    if c.use_cispo:
        key = "loss_fn.use_cispo"
        for other, why in (("disable_ppo_ratio", "CISPO weighs by the ratio this removes"),
                           ("force_on_policy_ratio", "forcing ratio = 1 removes CISPO's clipped weight"),
                           ("sequence_level_importance_ratios", "CISPO weighs tokens, GSPO sequences")):
            require(not getattr(c, other), key, f"cannot be combined with loss_fn.{other}: {why}")
        require(c.ratio_clip_c is None, key, "cannot be combined with dual clipping: set loss_fn.ratio_clip_c=null")
        require(aggregation == "token_mean", key, "CISPO is a token-level loss: set loss_fn.token_level_loss=true "
                "and loss_fn.loss_aggregation=null or token_mean")


def _check_truncated_is(c: LossConfig) -> None:
    kind, hi, lo = (c.truncated_importance_sampling_type, c.truncated_importance_sampling_ratio,
                    c.truncated_importance_sampling_ratio_min)
    key = "loss_fn.truncated_importance_sampling_"
    if kind is None and hi is None:
        require(lo is None, key + "ratio_min", "is set but loss_fn.truncated_importance_sampling_ratio is null")
        return
    if kind is not None:
        require_choice(kind, key + "type", TRUNCATED_IS_TYPES)
    require(c.use_importance_sampling_correction, key + ("type" if kind else "ratio"),
            "needs loss_fn.use_importance_sampling_correction=true (it truncates that correction's weights)")
    require(hi is not None and hi > 0, key + "ratio", f"the upper bound must be > 0, got {hi}")
    if kind in ("icepop", "seq-mask-tis"):
        require(lo is not None, key + "ratio_min", f"truncated_importance_sampling_type={kind} needs a lower bound")
    require(lo is None or 0 <= lo <= hi, key + "ratio_min", f"must be in [0, {hi}], got {lo}")
    require(kind != "seq-mask-tis" or not c.sequence_level_importance_ratios, key + "type",
            "seq-mask-tis masks sequences by their token weights; with GSPO use tis or icepop")


# ----------------------------------------------------------------------------------------------- clipped PG
@register_loss("clipped_pg")
@dataclass
class ClippedPGLoss:
    """The GRPO family's loss (NeMo RL's ClippedPGLossFn): an actor term and an optional KL penalty.

        loss = aggregate(w * actor(logprobs, prev_logprobs, A)) + beta * aggregate(kl_term)

    actor, per token (ratio r = exp(logprobs - prev_logprobs)):
    - PPO/GRPO clip (default): `ppo_clip_objective`, with DAPO clip-higher and dual clip;
    - GSPO (sequence_level_importance_ratios): the same clip on `gspo_ratio`, per sequence;
    - CISPO (use_cispo): `cispo_objective`;
    - REINFORCE / RLOO (disable_ppo_ratio): `reinforce_objective`;
    - force_on_policy_ratio: r = exp(logp - stop_grad(logp)), value 1 (no clipping), gradient of logp.
    w = exp(prev_logprobs - generation_logprobs), detached, when use_importance_sampling_correction (the
    engine's probabilities differ from the trainer's), per sequence (exp of the summed log-ratio) under GSPO;
    truncated by `truncate_is_weights` when a truncated type or ratio is set; else w = 1.
    kl_term: `kl.kl_penalty_per_token`, whose expected gradient is grad KL(pi || pi_ref) for k1, k2 and k3
    (not a loss term when use_kl_in_reward: the trainer takes the KL off the rewards instead).
    aggregate: `aggregate_loss` with `aggregation_of(cfg)`.

    Metrics (contributions, see the module docstring): loss, actor_loss, kl_penalty (the aggregated KL term
    before the factor beta), and per-token means over valid tokens: approx_entropy (-E[exp(logprobs -
    generation_logprobs) * logprobs], the entropy estimated from the generated samples), probs_ratio,
    probs_ratio_clamped, clip_fraction, and is_weight (and is_oob_ratio when truncated) with the correction on.

    Log-probs are computed in float32 at least. Positions outside token_mask * sample_mask are zeroed before
    any arithmetic, so whatever the back end left there (inf, nan) gives neither loss nor gradient.
    """

    cfg: LossConfig
    max_sequence_length: Optional[int] = None  # Dr.GRPO's normalizer (policy.max_total_sequence_length)

    def __post_init__(self) -> None:
        check_loss_config(self.cfg)
        self.aggregation = aggregation_of(self.cfg)

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
        actor_tok, stats = self._actor_per_token(curr, prev, valid(mb["advantages"]), token_mask)  # [b, T]
        if c.use_importance_sampling_correction:
            w, is_stats = self._is_weights(prev, gen, token_mask)
            actor_tok, stats = actor_tok * w, {**stats, **is_stats}
        aggregate = partial(aggregate_loss, token_mask=token_mask, sample_mask=sample_mask,
                            global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
                            mode=self.aggregation, max_sequence_length=self.max_sequence_length)
        actor_loss = aggregate(actor_tok)
        loss = actor_loss
        kl = torch.zeros((), dtype=dtype, device=logprobs.device)
        if c.reference_policy_kl_penalty > 0 and not c.use_kl_in_reward:
            if "reference_policy_logprobs" not in mb:
                raise KeyError("loss_fn.reference_policy_kl_penalty > 0 needs 'reference_policy_logprobs' in the batch")
            kl = aggregate(kl_penalty_per_token(curr, valid(mb["reference_policy_logprobs"]), gen,
                                                c.reference_policy_kl_type, c.use_on_policy_kl_approximation,
                                                c.kl_input_clamp_value, c.kl_output_clamp_value))
            loss = actor_loss + c.reference_policy_kl_penalty * kl

        with torch.no_grad():
            def per_token(v: torch.Tensor) -> float:  # contribution to the mean over the global batch's tokens
                return safe_div(masked_sum(v, mask), global_valid_toks).item()

            metrics = {
                "loss": loss.item(),
                "actor_loss": actor_loss.item(),
                "kl_penalty": kl.item(),
                "approx_entropy": per_token(-torch.exp(curr - gen) * curr),
                **{name: per_token(v) for name, v in stats.items()},
            }
        return loss, metrics

    def _actor_per_token(self, curr: torch.Tensor, prev: torch.Tensor, adv: torch.Tensor,
                         token_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The actor loss per token [b, T] of the configured objective, and detached per-token stats."""
        c = self.cfg
        if c.disable_ppo_ratio:
            ones = torch.ones_like(curr)
            return reinforce_objective(curr, adv), {"probs_ratio": ones, "probs_ratio_clamped": ones,
                                                    "clip_fraction": torch.zeros_like(curr)}
        if c.force_on_policy_ratio:
            ratio = torch.exp(curr - curr.detach())  # value 1, gradient of logp
            actor, clipped = -adv * ratio, torch.zeros_like(curr, dtype=torch.bool)
        elif c.sequence_level_importance_ratios:
            ratio = gspo_ratio(curr, prev, token_mask)
            actor, clipped = ppo_clip_objective(ratio, adv, c.ratio_clip_min, c.ratio_clip_max, c.ratio_clip_c)
        else:
            ratio = torch.exp(curr - prev)
            if c.use_cispo:
                actor, clipped = cispo_objective(ratio, curr, adv, c.ratio_clip_min, c.ratio_clip_max)
            else:
                actor, clipped = ppo_clip_objective(ratio, adv, c.ratio_clip_min, c.ratio_clip_max, c.ratio_clip_c)
        clamped = ratio if c.force_on_policy_ratio else ratio.clamp(1.0 - c.ratio_clip_min, 1.0 + c.ratio_clip_max)
        return actor, {"probs_ratio": ratio.detach(), "probs_ratio_clamped": clamped.detach(),
                       "clip_fraction": clipped.to(curr.dtype)}

    def _is_weights(self, prev: torch.Tensor, gen: torch.Tensor,
                    token_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Detached importance weights pi_old / pi_gen [b, T] (per sequence under GSPO), truncated as configured."""
        c = self.cfg
        if c.sequence_level_importance_ratios:
            w = score_weight(masked_sum(prev - gen, token_mask, dim=-1).detach(), None)[:, None].expand_as(prev)
        else:
            w = score_weight((prev - gen).detach(), None)  # an overflowing weight is 0
        stats = {}
        kind = c.truncated_importance_sampling_type or ("tis" if c.truncated_importance_sampling_ratio else None)
        if kind is not None:
            w, oob = truncate_is_weights(w, kind, c.truncated_importance_sampling_ratio,
                                         c.truncated_importance_sampling_ratio_min, token_mask)
            stats["is_oob_ratio"] = oob
        return w, {"is_weight": w, **stats}
