"""Advantage estimators (GRPO, REINFORCE++, GDPO) by name, reward shaping and scaling, advantage clipping,
and the DAPO dynamic-sampling filter.

Pure tensor functions. Rewards come in contiguous groups: samples i*G .. (i+1)*G-1 are the G responses
to prompt i (G = grpo.num_generations_per_prompt).

GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300): advantage = (reward - group mean) / group std.
RLOO (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740): the baseline of a sample is the mean of the
other G-1 samples of its group, which keeps the estimator unbiased.
DAPO dynamic sampling (Yu et al. 2025, https://arxiv.org/abs/2503.14476): groups whose rewards are all
equal give no gradient and are dropped.

Departures, all deliberate and as NeMo RL does: std is the unbiased (G-1 denominator) sample std; with
the leave-one-out baseline it is the std of the other G-1 samples; a sample whose std is 0 is not divided.
One safeguard of our own: a std is exactly 0 whenever the values it is taken over are all equal (rounding
would otherwise leave ~1e-17, and dividing by it turns a constant group into huge advantages), and a
group whose rewards are all equal gets advantage exactly 0.
"""

from __future__ import annotations

import torch

from typing import Callable, Optional

from nemo_grpo.config import GRPOConfig, RewardScalingConfig, RewardShapingConfig
from nemo_grpo.errors import ConfigError
from nemo_grpo.utils.registry import registrar


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """rewards [N] -> [N / G, G] float view, checking the contiguous-group layout."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of group_size={group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    return rewards.reshape(-1, group_size)


def _all_equal(values: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    return values.amax(dim, keepdim=keepdim) == values.amin(dim, keepdim=keepdim)


def _group_mean_std(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r [n, G] -> group mean [n, G] and unbiased group std [n, G] (0 for G = 1 or equal rewards)."""
    mean = r.mean(dim=1, keepdim=True).expand_as(r)
    if r.shape[1] < 2:
        return mean, torch.zeros_like(r)
    std = r.std(dim=1, keepdim=True).expand_as(r)
    return mean, torch.where(_all_equal(r, keepdim=True), torch.zeros_like(std), std)


def _leave_one_out_mean_std(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """r [n, G] -> per sample, the mean [n, G] and unbiased std [n, G] of the OTHER G-1 samples of its group.

    The std of a single other sample (G = 2) is undefined and returned as 0, as NeMo RL does.
    """
    G = r.shape[1]
    others = ~torch.eye(G, dtype=torch.bool, device=r.device)  # [G, G]: others[i, j] = (j != i)
    vals = r[:, None, :].expand(-1, G, G)  # [n, G(i), G(j)]: row i holds the whole group
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    mean = torch.where(others, vals, zero).sum(-1) / (G - 1)  # [n, G]
    if G < 3:
        return mean, torch.zeros_like(r)
    dev = torch.where(others, vals - mean[..., None], zero)  # [n, G, G]
    std = (dev.square().sum(-1) / (G - 2)).sqrt()  # [n, G]
    inf = torch.tensor(float("inf"), dtype=r.dtype, device=r.device)
    equal = torch.where(others, vals, -inf).amax(-1) == torch.where(others, vals, inf).amin(-1)  # [n, G]
    return mean, torch.where(equal, zero, std)


def compute_advantages(
    rewards: torch.Tensor,
    group_size: int,
    use_leave_one_out_baseline: bool,
    normalize_rewards: bool,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-relative advantages of contiguous groups of `group_size` samples.

    Args:
        rewards: [N] with N = num_prompts * G; samples i*G .. (i+1)*G-1 answer prompt i.
        group_size: G.
        use_leave_one_out_baseline: baseline = mean of the other G-1 samples (RLOO); needs G >= 2.
            Otherwise the group mean.
        normalize_rewards: divide (reward - baseline) by (std + eps) where std > 0. With the leave-one-out
            baseline std is that of the other G-1 samples (as NeMo RL); a sample whose std is 0 (e.g. G = 2,
            or all other samples equal) keeps its raw advantage reward - baseline.
        eps: added to std before dividing.

    Returns:
        advantages [N], baseline [N], std [N] (unbiased, G-1 denominator; exactly 0 where the values it is
        taken over are all equal). Groups whose rewards are all equal get advantage exactly 0.
    """
    r = _grouped(rewards, group_size)  # [n, G]
    if use_leave_one_out_baseline:
        if group_size < 2:
            raise ValueError(f"the leave-one-out baseline needs group_size >= 2, got {group_size}: set "
                             f"grpo.num_generations_per_prompt >= 2, or grpo.use_leave_one_out_baseline=false")
        baseline, std = _leave_one_out_mean_std(r)
    else:
        baseline, std = _group_mean_std(r)
    adv = r - baseline  # [n, G]
    if normalize_rewards:
        adv = torch.where(std > 0, adv / (std + eps), adv)
    adv = adv.masked_fill(_all_equal(r, keepdim=True), 0.0)
    return adv.reshape(-1), baseline.reshape(-1), std.reshape(-1)


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """Clamp rewards [N] to [source_min, source_max], then map that range linearly onto [target_min, target_max].

    Returns `rewards` itself when cfg.enabled is false.
    """
    if not cfg.enabled:
        return rewards
    if cfg.source_max <= cfg.source_min:
        raise ValueError(f"reward_scaling.source_max ({cfg.source_max}) must be > source_min ({cfg.source_min})")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.get_default_dtype()))
    unit = (r.clamp(cfg.source_min, cfg.source_max) - cfg.source_min) / (cfg.source_max - cfg.source_min)
    return cfg.target_min + unit * (cfg.target_max - cfg.target_min)


def dynamic_sampling_keep(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO keep mask: bool [N / G], True for groups whose rewards [N] are not all equal.

    Takes the rewards (not the std): equality is tested exactly, so a constant group is always dropped.
    """
    return ~_all_equal(_grouped(rewards, group_size), dim=1)


def shape_rewards(rewards: torch.Tensor, response_lengths: torch.Tensor, truncated: torch.Tensor,
                  cfg: RewardShapingConfig, max_response_length: int) -> torch.Tensor:
    """grpo.reward_shaping applied to rewards [N] (response_lengths [N] generated tokens, truncated [N] bool).

    - stop_properly_penalty_coef = c: a truncated sample's reward becomes c * reward (ProRL v2 / DLER,
      https://arxiv.org/abs/2510.15110).
    - DAPO's soft overlong punishment (https://arxiv.org/abs/2503.14476), with L = max_response_length
      (cfg's, or the argument when cfg's is null), buffer B and penalty P: a response of length l > L - B
      gets reward - P * (l - (L - B)) / B, i.e. 0 at L - B, -P at L, and falls further beyond.
    Both apply when both are set (stop-properly first). Returns `rewards` itself when cfg.enabled is false.
    """
    if not cfg.enabled:
        return rewards
    r = rewards.to(torch.promote_types(rewards.dtype, torch.get_default_dtype()))
    if cfg.stop_properly_penalty_coef is not None:
        r = torch.where(truncated.bool(), r * cfg.stop_properly_penalty_coef, r)
    if cfg.overlong_buffer_length is not None:
        limit = cfg.max_response_length or max_response_length
        exceed = response_lengths.to(r.dtype) - (limit - cfg.overlong_buffer_length)
        r = r + (-exceed / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty).clamp(max=0.0)
    return r


def clip_advantages(adv: torch.Tensor, low: Optional[float], high: Optional[float]) -> torch.Tensor:
    """Clamp advantages [N] to [low, high] (grpo.advantage_clip_low / _high; None: that side unbounded)."""
    return adv.clamp(min=low, max=high) if (low is not None or high is not None) else adv


def _batch_normalize(adv: torch.Tensor, weights: Optional[torch.Tensor] = None, eps: float = 1e-8) -> torch.Tensor:
    """(adv - mean) / sqrt(max(var, eps)) over the batch; weights [N] (e.g. each sample's token count) make
    it the mean and variance over tokens, as when each token carries its sample's advantage."""
    w = torch.ones_like(adv) if weights is None else weights.to(adv.dtype)
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(adv)
    mean = (w * adv).sum() / total
    var = (w * (adv - mean).square()).sum() / total
    return (adv - mean) * var.clamp(min=eps).rsqrt()


# ----------------------------------------------------------------------------------------------- estimators
# name -> fn(rewards [N], group_size, cfg: GRPOConfig, components: {name: [N]} | None, token_counts [N] | None)
#         -> advantages [N]
ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {}


register_estimator = registrar(ESTIMATORS, "advantage estimator")  # @register_estimator("name")


def estimate_advantages(rewards: torch.Tensor, group_size: int, cfg: GRPOConfig,
                        components: Optional[dict[str, torch.Tensor]] = None,
                        token_counts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Advantages [N] of rewards [N] by grpo.adv_estimator.name, then clipped to grpo.advantage_clip_*."""
    name = cfg.adv_estimator.name
    if name not in ESTIMATORS:
        raise ConfigError(f"config key 'grpo.adv_estimator.name': unknown estimator '{name}'; known: "
                          f"{', '.join(sorted(ESTIMATORS))}")
    adv = ESTIMATORS[name](rewards, group_size, cfg, components, token_counts)
    return clip_advantages(adv, cfg.advantage_clip_low, cfg.advantage_clip_high)


@register_estimator("grpo")
def grpo_estimator(rewards, group_size, cfg, components=None, token_counts=None) -> torch.Tensor:
    """GRPO's group-relative advantage (`compute_advantages`; grpo.normalize_rewards and
    grpo.use_leave_one_out_baseline)."""
    return compute_advantages(rewards, group_size, cfg.use_leave_one_out_baseline, cfg.normalize_rewards)[0]


@register_estimator("reinforce_plus_plus")
def reinforce_plus_plus_estimator(rewards, group_size, cfg, components=None, token_counts=None) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, https://arxiv.org/abs/2501.03262): the group mean is subtracted when
    grpo.adv_estimator.minus_baseline (REINFORCE++-baseline), then the advantages are normalised over the
    whole batch's response tokens (token_counts [N]) rather than within each group."""
    r = _grouped(rewards, group_size)  # [n, G]
    adv = (r - r.mean(dim=1, keepdim=True)) if cfg.adv_estimator.minus_baseline else r
    return _batch_normalize(adv.reshape(-1), token_counts)


@register_estimator("gdpo")
def gdpo_estimator(rewards, group_size, cfg, components=None, token_counts=None) -> torch.Tensor:
    """GDPO (NeMo RL's multi-reward estimator): each reward component [N] gets its own group-relative
    advantage (as `grpo_estimator`), they are summed with grpo.adv_estimator.reward_weights (sorted by
    component name; null: all 1), and the sum is normalised over the batch: (sum - mean) / std with the
    sample (unbiased, N-1 denominator) std and no eps, as NeMo RL's GDPOAdvantageEstimator does; a batch of
    equal sums is only centred. Normalising each component within its groups keeps one reward's scale from
    drowning the others."""
    names = sorted(components or {})
    if len(names) < 2:
        raise ConfigError(f"config key 'grpo.adv_estimator.name': gdpo needs an environment that returns several "
                          f"reward components (a dict of rewards); this batch has {names or 'a single reward'}. "
                          f"Set grpo.adv_estimator.name=grpo")
    weights = cfg.adv_estimator.reward_weights or [1.0] * len(names)
    if len(weights) != len(names):
        raise ConfigError(f"config key 'grpo.adv_estimator.reward_weights': {len(weights)} weights for "
                          f"{len(names)} reward components {names} (one per component, in this order)")
    total = sum(w * grpo_estimator(components[k], group_size, cfg) for w, k in zip(weights, names))  # [N]
    centred = total - total.mean()
    std = total.std() if total.numel() > 1 else torch.zeros(())
    return centred / std if std > 0 else centred
