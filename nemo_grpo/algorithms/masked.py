"""Masked reductions over per-token tensors, shared by the losses and the KL metrics.

A position where the mask is 0 is never read, so an inf or nan the back end left there does not leak in.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

Number = Union[torch.Tensor, float, int]


def safe_div(num: torch.Tensor, den: Number) -> torch.Tensor:
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
    return safe_div(masked_sum(values, mask, dim), den)
