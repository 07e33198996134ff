"""The optimizer of a policy (policy.optimizer), its learning-rate schedule, and the gradient-clipping rule.

Clipping is one rule for both back ends (each only computes its global norm over its own shards):
- a finite norm above max_norm scales every gradient by max_norm / (norm + 1e-6), as torch's clip_grad_norm_;
- a non-finite norm (inf / nan: an overflow, a bad sample) skips the optimizer step altogether, and the step's
  metrics count it ("skipped_steps" 1.0): the weights and the optimizer state stay as they were.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch


def lr_warmup_factor(warmup_steps: int) -> Callable[[int], float]:
    """LambdaLR factor: linear warm-up lr * (s + 1) / warmup_steps for the first warmup_steps steps, then lr."""
    def factor(step: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)
    return factor


def optimizer_class(opt_cfg) -> tuple[type, dict[str, Any]]:
    """policy.optimizer (adamw | sgd) -> (torch optimizer class, its keyword arguments)."""
    if opt_cfg.name == "adamw":
        return torch.optim.AdamW, dict(lr=opt_cfg.lr, betas=tuple(opt_cfg.betas), eps=opt_cfg.eps,
                                       weight_decay=opt_cfg.weight_decay)
    if opt_cfg.name == "sgd":
        return torch.optim.SGD, dict(lr=opt_cfg.lr, weight_decay=opt_cfg.weight_decay)
    raise ValueError(f"policy.optimizer.name '{opt_cfg.name}' is unknown; known: adamw, sgd")


def build_optimizer(params, opt_cfg) -> torch.optim.Optimizer:
    """policy.optimizer over `params`."""
    cls, kwargs = optimizer_class(opt_cfg)
    return cls(params, **kwargs)


def clip_coefficient(norm: float, max_norm: Optional[float]) -> Optional[float]:
    """The factor to scale gradients by: None for a non-finite norm (skip the step), 1.0 when no clipping is
    needed, max_norm / (norm + 1e-6) otherwise."""
    if not math.isfinite(norm):
        return None
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
