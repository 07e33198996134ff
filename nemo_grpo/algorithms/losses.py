"""Policy-gradient losses over per-token log-probs: the loss registry and the GRPO family's loss, composed of
the registered parts of algorithms/objectives.py (an objective, an aggregation, a truncation of the
importance-sampling weights) and the KL penalty of algorithms/kl.py.

A loss sees tensors only, never a model or a process group:

    loss, metrics = loss_fn(logprobs, mb, global_valid_seqs, global_valid_toks)

- logprobs [b, T]: current-policy log-probs of one micro-batch (with grad); logprobs[:, t] =
  log p(input_ids[:, t] | input_ids[:, :t]), column 0 and padding 0.
- mb: the matching rows of the StepBatch (nemo_grpo/batch.py): token_mask [b, T], sample_mask [b], loss_mask
  [b, T] (token_mask * sample_mask, built once by the StepBatch), advantages [b] (or [b, T] for per-token
  advantages), prev_logprobs [b, T], generation_logprobs [b, T], and reference_policy_logprobs [b, T] when the
  KL penalty is on.
- global_valid_toks = sum(loss_mask) and global_valid_seqs = sum(sample_mask), both over the WHOLE global batch
  (every micro-batch on every data-parallel rank).

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
from nemo_grpo.algorithms.masked import Number, masked_mean, masked_sum, safe_div  # noqa: F401 (masked_mean: API)
from nemo_grpo.algorithms.objectives import (AGGREGATIONS, NEEDS_LOWER_BOUND, TRUNCATIONS, Objective,
                                             aggregate_loss, aggregation_of, objective_of, truncate_is_weights)
from nemo_grpo.config import LossConfig
from nemo_grpo.errors import ConfigError, require, require_choice
from nemo_grpo.utils.registry import registrar

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


# ----------------------------------------------------------------------------------------------- config checks
def check_loss_config(c: LossConfig) -> Objective:
    """Reject, naming the key, a loss_fn value or combination that makes no sense (ConfigError); returns the
    objective the config names."""
    key = "loss_fn."
    require_choice(c.reference_policy_kl_type, key + "reference_policy_kl_type", KL_TYPES)
    require(c.reference_policy_kl_penalty >= 0, key + "reference_policy_kl_penalty", "must be >= 0")
    require(0 <= c.ratio_clip_min < 1, key + "ratio_clip_min", f"must be in [0, 1), got {c.ratio_clip_min}")
    require(c.ratio_clip_max >= 0, key + "ratio_clip_max", f"must be >= 0, got {c.ratio_clip_max}")
    require(c.ratio_clip_c is None or c.ratio_clip_c > 1, key + "ratio_clip_c",
            f"the dual-clip constant must be > 1 (usually 3) or null, got {c.ratio_clip_c}")
    if c.loss_aggregation is not None:
        require_choice(c.loss_aggregation, key + "loss_aggregation", list(AGGREGATIONS))
    require(not c.use_kl_in_reward or c.reference_policy_kl_penalty > 0, key + "use_kl_in_reward",
            "needs loss_fn.reference_policy_kl_penalty > 0 (the KL coefficient)")
    objective, objective_key = objective_of(c)
    require(not c.force_on_policy_ratio or objective.name == "ppo_clip", key + "force_on_policy_ratio",
            f"fixes ppo_clip's ratio at 1, but {objective_key} chose the objective '{objective.name}'; set one")
    if objective.check is not None:
        objective.check(c, aggregation_of(c), objective_key)
    _check_truncated_is(c, objective.sequence_level)
    return objective


def _check_truncated_is(c: LossConfig, sequence_level: bool) -> None:
    kind, hi, lo = (c.truncated_importance_sampling_type, c.truncated_importance_sampling_ratio,
                    c.truncated_importance_sampling_ratio_min)
    key = "loss_fn.truncated_importance_sampling_"
    if kind is None and hi is None:
        require(lo is None, key + "ratio_min", "is set but loss_fn.truncated_importance_sampling_ratio is null")
        return
    if kind is not None:
        require_choice(kind, key + "type", list(TRUNCATIONS))
    require(c.use_importance_sampling_correction, key + ("type" if kind else "ratio"),
            "needs loss_fn.use_importance_sampling_correction=true (it truncates that correction's weights)")
    require(hi is not None and hi > 0, key + "ratio", f"the upper bound must be > 0, got {hi}")
    if kind in NEEDS_LOWER_BOUND:
        require(lo is not None, key + "ratio_min", f"truncated_importance_sampling_type={kind} needs a lower bound")
    require(lo is None or 0 <= lo <= hi, key + "ratio_min", f"must be in [0, {hi}], got {lo}")
    require(kind != "seq-mask-tis" or not sequence_level, key + "type",
            "seq-mask-tis masks sequences by their token weights; with GSPO (a ratio per sequence) use tis or icepop")


# ----------------------------------------------------------------------------------------------- clipped PG
@register_loss("clipped_pg")
@dataclass
class ClippedPGLoss:
    """The GRPO family's loss (NeMo RL's ClippedPGLossFn): an actor term and an optional KL penalty.

        loss = aggregate(w * actor(logprobs, prev_logprobs, A)) + beta * aggregate(kl_term)

    actor: the objective the config names (`objectives.objective_of`: loss_fn.objective, or NeMo RL's flags):
    ppo_clip (default; DAPO clip-higher, dual clip, force_on_policy_ratio), gspo
    (sequence_level_importance_ratios), cispo (use_cispo), reinforce (disable_ppo_ratio).
    w = exp(prev_logprobs - generation_logprobs), detached, when use_importance_sampling_correction (the
    engine's probabilities differ from the trainer's), per sequence (exp of the summed log-ratio) under a
    sequence-level objective (GSPO); truncated by the registered truncation when a type or ratio is set; else 1.
    kl_term: `kl.kl_penalty_per_token`, whose expected gradient is grad KL(pi || pi_ref) for k1, k2 and k3
    (not a loss term when use_kl_in_reward: the trainer takes the KL off the rewards instead).
    aggregate: the registered aggregation `aggregation_of(cfg)`.

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
        self.objective = check_loss_config(self.cfg)
        self.aggregation = aggregation_of(self.cfg)

    def __call__(self, logprobs: torch.Tensor, mb: dict[str, torch.Tensor], global_valid_seqs: Number,
                 global_valid_toks: Number) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.cfg
        dtype = torch.promote_types(logprobs.dtype, torch.float32)
        token_mask = mb["token_mask"].to(dtype)  # [b, T]
        sample_mask = mb["sample_mask"].to(dtype)  # [b]
        mask = mb["loss_mask"].to(dtype)  # [b, T]

        def valid(x: torch.Tensor) -> torch.Tensor:  # [b, T], 0 outside trained tokens
            return torch.where(mask != 0, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))

        curr, prev, gen = valid(logprobs), valid(mb["prev_logprobs"]), valid(mb["generation_logprobs"])
        adv = mb["advantages"]  # [b] (a sequence's, on each of its tokens) or [b, T]
        adv = valid((adv[:, None] if adv.dim() == 1 else adv).expand_as(curr))
        actor_tok, stats = self._actor_per_token(curr, prev, adv, token_mask)  # [b, T]
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
        term = self.objective.fn(curr, prev, adv, token_mask, self.cfg)
        return term.loss, {"probs_ratio": term.ratio.detach(), "probs_ratio_clamped": term.clamped.detach(),
                           "clip_fraction": term.clipped.to(curr.dtype)}

    def _is_weights(self, prev: torch.Tensor, gen: torch.Tensor,
                    token_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Detached importance weights pi_old / pi_gen [b, T] (per sequence under a sequence-level objective),
        truncated as configured."""
        c = self.cfg
        if self.objective.sequence_level:
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
