"""The parts a policy-gradient loss is composed of, each registered by name (algorithms/losses.py composes them):

- objectives (`OBJECTIVES`): the actor loss per token, from the current and old log-probs and the advantages:
  `ppo_clip` (PPO/GRPO, with DAPO's clip-higher, dual clip and the forced on-policy ratio), `gspo`, `cispo`,
  `reinforce`. A new objective is one function under `@register_objective("name")`; users pick it with
  `loss_fn.objective=name`, and where NeMo RL has a flag for it, one entry of `OBJECTIVE_FLAGS`.
- aggregations (`AGGREGATIONS`): per-token values [b, T] -> this micro-batch's contribution to the global-batch
  loss: `token_mean`, `seq_mean_token_mean`, `seq_mean_token_sum_norm` (Dr.GRPO).
- truncations of the importance-sampling weights (`TRUNCATIONS`): `tis`, `icepop`, `seq-mask-tis`.

Every part is a pure function of tensors: [b, T] per token (b samples of T positions), [b] per sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from nemo_grpo.algorithms.masked import Number, masked_mean, masked_sum, safe_div
from nemo_grpo.config import LossConfig
from nemo_grpo.errors import ConfigError, require
from nemo_grpo.utils.registry import registrar


# ----------------------------------------------------------------------------------------------- objectives
@dataclass(frozen=True)
class ActorTerm:
    """What an objective returns, all [b, T]: the actor loss per token, the importance ratio it used and that
    ratio clamped to the clip range (both for metrics), and where the clipped term was taken (bool)."""
    loss: torch.Tensor
    ratio: torch.Tensor
    clamped: torch.Tensor
    clipped: torch.Tensor


# (curr, prev, adv, token_mask, cfg) -> ActorTerm; curr: current log-probs [b, T] (with grad), prev: the
# rollout policy's [b, T], adv: advantages [b, T], token_mask [b, T]; 0 outside the trained tokens
ObjectiveFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossConfig], ActorTerm]


@dataclass(frozen=True)
class Objective:
    name: str
    fn: ObjectiveFn
    sequence_level: bool = False  # one ratio per sequence: the importance-sampling weight is per sequence too
    check: Optional[Callable[[LossConfig, str, str], None]] = None  # (cfg, aggregation, key): its config rules


OBJECTIVES: dict[str, Objective] = {}
# NeMo RL's flags that choose an objective (loss_fn.objective=null): the flag -> the objective it names
OBJECTIVE_FLAGS = {"disable_ppo_ratio": "reinforce", "sequence_level_importance_ratios": "gspo",
                   "use_cispo": "cispo"}


def register_objective(name: str, *, sequence_level: bool = False,
                       check: Optional[Callable[[LossConfig, str, str], None]] = None):
    """`@register_objective("name")` on an ObjectiveFn; `check(cfg, aggregation, key)` raises ConfigError
    (naming `key`, the config key that chose it) on options the objective cannot take."""
    def add(fn: ObjectiveFn) -> ObjectiveFn:
        if name in OBJECTIVES:
            raise ValueError(f"objective '{name}' is registered twice")
        OBJECTIVES[name] = Objective(name, fn, sequence_level, check)
        return fn
    return add


def objective_of(c: LossConfig) -> tuple[Objective, str]:
    """The objective the config names, and the key that names it: loss_fn.objective, else NeMo RL's flag
    (OBJECTIVE_FLAGS), else ppo_clip. Keys that name two objectives are a ConfigError on the later key."""
    named = [("loss_fn.objective", c.objective)] if c.objective is not None else []
    named += [(f"loss_fn.{flag}", name) for flag, name in OBJECTIVE_FLAGS.items() if getattr(c, flag)]
    for key, name in named[1:]:
        require(name == named[0][1], key, f"names the objective '{name}', but {named[0][0]} names "
                f"'{named[0][1]}': a loss has one objective; set one of them")
    key, name = named[0] if named else ("loss_fn.objective", "ppo_clip")
    if name not in OBJECTIVES:
        raise ConfigError(f"config key '{key}': unknown objective '{name}'; known: {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name], key


def clip_surrogate(ratio: torch.Tensor, adv: torch.Tensor, c: LossConfig) -> ActorTerm:
    """PPO's clipped surrogate (https://arxiv.org/abs/1707.06347) of ratio, adv [b, T], as a loss:
    max(-A r, -A clip(r, 1 - ratio_clip_min, 1 + ratio_clip_max)); ratio_clip_min != ratio_clip_max is DAPO's
    clip-higher. With ratio_clip_c (dual clip, https://arxiv.org/abs/1912.09729): for A < 0, min(that, -A c)."""
    clamped = ratio.clamp(1.0 - c.ratio_clip_min, 1.0 + c.ratio_clip_max)
    loss_unclipped, loss_clipped = -adv * ratio, -adv * clamped
    loss = torch.max(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if c.ratio_clip_c is not None:
        loss_dual = -adv * c.ratio_clip_c
        dual = (adv < 0) & (loss_dual < loss)
        loss = torch.where(dual, loss_dual, loss)
        clipped = clipped | dual
    return ActorTerm(loss, ratio, clamped, clipped)


@register_objective("ppo_clip")
def ppo_clip(curr, prev, adv, token_mask, c: LossConfig) -> ActorTerm:
    """PPO/GRPO: `clip_surrogate` of the token ratio r = exp(logp - prev_logp). loss_fn.force_on_policy_ratio
    fixes r at 1 in value, keeping the gradient of logp (r = exp(logp - stop_grad(logp))): nothing clips."""
    ratio = torch.exp(curr - curr.detach()) if c.force_on_policy_ratio else torch.exp(curr - prev)
    return clip_surrogate(ratio, adv, c)


def gspo_ratio(curr: torch.Tensor, prev: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence ratio (https://arxiv.org/abs/2507.18071), broadcast to [b, T]:
    s_i = exp(mean over the sample's valid tokens of (logp - prev_logp)), the length-normalised likelihood ratio."""
    return torch.exp(masked_mean(curr - prev, token_mask, dim=-1))[:, None].expand_as(curr)


def _check_gspo(c: LossConfig, aggregation: str, key: str) -> None:
    require(aggregation != "token_mean", key, "GSPO weighs sequences: set loss_fn.token_level_loss=false "
            "(or loss_fn.loss_aggregation to a seq_mean_* mode)")


@register_objective("gspo", sequence_level=True, check=_check_gspo)
def gspo(curr, prev, adv, token_mask, c: LossConfig) -> ActorTerm:
    """GSPO: `clip_surrogate` of `gspo_ratio`, one clip decision per sequence."""
    return clip_surrogate(gspo_ratio(curr, prev, token_mask), adv, c)


def _check_cispo(c: LossConfig, aggregation: str, key: str) -> None:
    require(c.ratio_clip_c is None, key, "cannot be combined with dual clipping: set loss_fn.ratio_clip_c=null")
    require(aggregation == "token_mean", key, "CISPO is a token-level loss: set loss_fn.token_level_loss=true "
            "and loss_fn.loss_aggregation=null or token_mean")


@register_objective("cispo", check=_check_cispo)
def cispo(curr, prev, adv, token_mask, c: LossConfig) -> ActorTerm:
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): loss = -A * stop_grad(clip(r)) * logp per token.
    The clipped importance weight scales the REINFORCE gradient instead of zeroing it: every token keeps one."""
    ratio = torch.exp(curr - prev)
    clamped = ratio.clamp(1.0 - c.ratio_clip_min, 1.0 + c.ratio_clip_max)
    return ActorTerm(-adv * clamped.detach() * curr, ratio, clamped, clamped != ratio)


@register_objective("reinforce")
def reinforce(curr, prev, adv, token_mask, c: LossConfig) -> ActorTerm:
    """REINFORCE (Williams 1992): loss = -A * logp per token, no ratio, no clip; with the leave-one-out baseline
    it is RLOO (https://arxiv.org/abs/2402.14740). Unbiased only on-policy: one update per rollout batch."""
    ones = torch.ones_like(curr)
    return ActorTerm(-adv * curr, ones, ones, torch.zeros_like(curr, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------- aggregations
AGGREGATIONS: dict[str, Callable] = {}
register_aggregation = registrar(AGGREGATIONS, "loss aggregation")  # @register_aggregation("name")


@register_aggregation("token_mean")
def token_mean(values, token_mask, sample_mask, global_valid_seqs, global_valid_toks, max_sequence_length):
    """sum(values * token_mask * sample_mask) / global_valid_toks: every token weighs the same (DAPO's
    token-level loss, https://arxiv.org/abs/2503.14476)."""
    per_sample = masked_sum(values, token_mask.to(values.dtype), dim=-1)  # [b]
    return safe_div(masked_sum(per_sample, sample_mask.to(values.dtype)), global_valid_toks)


@register_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(values, token_mask, sample_mask, global_valid_seqs, global_valid_toks, max_sequence_length):
    """Each sample's mean over its own valid tokens, then sum(that * sample_mask) / global_valid_seqs: every
    sample weighs the same (the GRPO paper)."""
    return safe_div(masked_sum(masked_mean(values, token_mask, dim=-1), sample_mask), global_valid_seqs)


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(values, token_mask, sample_mask, global_valid_seqs, global_valid_toks,
                            max_sequence_length):
    """Each sample's SUM over its tokens / max_sequence_length, then as seq_mean_token_mean (Dr.GRPO,
    https://arxiv.org/abs/2503.20783): a constant normalizer, so a token's weight does not depend on the length
    of its answer."""
    if not max_sequence_length:
        raise ValueError("seq_mean_token_sum_norm needs max_sequence_length (policy.max_total_sequence_length)")
    per_sample = masked_sum(values, token_mask, dim=-1) / max_sequence_length  # [b]
    return safe_div(masked_sum(per_sample, sample_mask), global_valid_seqs)


def aggregate_loss(values: torch.Tensor, token_mask: torch.Tensor, sample_mask: torch.Tensor,
                   global_valid_seqs: Number, global_valid_toks: Number, mode: str = "token_mean",
                   max_sequence_length: Optional[int] = None) -> torch.Tensor:
    """Reduce a per-token quantity values [b, T] to this micro-batch's scalar contribution, by the registered
    aggregation `mode` (token_mask [b, T], sample_mask [b]; the global counts are over the whole global batch)."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation '{mode}'; known: {', '.join(AGGREGATIONS)}")
    return AGGREGATIONS[mode](values, token_mask, sample_mask, global_valid_seqs, global_valid_toks,
                              max_sequence_length)


def aggregation_of(cfg: LossConfig) -> str:
    """The loss aggregation in force: loss_fn.loss_aggregation, or the one token_level_loss names."""
    if cfg.loss_aggregation is not None:
        return cfg.loss_aggregation
    return "token_mean" if cfg.token_level_loss else "seq_mean_token_mean"


# ----------------------------------------------------------------------------------------------- truncations
# Truncations of detached importance weights w = pi_old / pi_gen [b, T]: (w, ratio_max, ratio_min, token_mask)
# -> (weights [b, T], out-of-bounds indicator, float [b, T]).
TRUNCATIONS: dict[str, Callable] = {}
register_truncation = registrar(TRUNCATIONS, "truncated importance sampling type")
NEEDS_LOWER_BOUND = ("icepop", "seq-mask-tis")


@register_truncation("tis")
def tis(w, ratio_max, ratio_min, token_mask):
    """Clamp to [ratio_min or 0, ratio_max] (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training")."""
    low = 0.0 if ratio_min is None else ratio_min
    return w.clamp(low, ratio_max), ((w > ratio_max) | (w < low)).to(w.dtype)


@register_truncation("icepop")
def icepop(w, ratio_max, ratio_min, token_mask):
    """Zero the tokens whose weight is outside [ratio_min, ratio_max] (IcePop, Ring-1T)."""
    keep = (w >= ratio_min) & (w <= ratio_max)
    return torch.where(keep, w, torch.zeros_like(w)), (~keep).to(w.dtype)


@register_truncation("seq-mask-tis")
def seq_mask_tis(w, ratio_max, ratio_min, token_mask):
    """Zero whole samples whose geometric-mean weight exp(mean log w) is outside [ratio_min, ratio_max]; the
    kept samples keep their token weights (the indicator is per sample, broadcast over its tokens)."""
    log_w = torch.log(w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    geo = torch.exp(masked_mean(log_w, token_mask, dim=-1))[:, None]  # [b, 1]
    keep = (geo >= ratio_min) & (geo <= ratio_max)
    return w * keep.to(w.dtype), (~keep).to(w.dtype).expand_as(w)


def truncate_is_weights(w: torch.Tensor, kind: str, ratio_max: float, ratio_min: Optional[float],
                        token_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered truncation `kind` of detached importance weights w [b, T]: (weights, out-of-bounds)."""
    if kind not in TRUNCATIONS:
        raise ValueError(f"unknown truncated importance sampling type '{kind}'; known: {', '.join(TRUNCATIONS)}")
    return TRUNCATIONS[kind](w, ratio_max, ratio_min, token_mask)
