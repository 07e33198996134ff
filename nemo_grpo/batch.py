"""`StepBatch`: the rows of one training call, typed. The driver builds it once a step, ships it to the policy's
workers once (`Policy.ship`), and a loss sees its micro-batches' rows.

    batch = StepBatch(input_ids, input_lengths, token_mask, sample_mask, generation_logprobs=gen)
    with policy.shipped(batch) as rows:                 # each data-parallel shard into its ranks' memory, once
        policy.get_logprobs(rows, keep="prev_logprobs") # the workers keep the result in their shard too
        policy.train(rows, loss_fn, columns={"advantages": adv})  # sends adv [N] only

Shapes (N rows, right-padded to T columns):
- input_ids [N, T] long; input_lengths [N] long (the real tokens of each row);
- token_mask [N, T]: 1 on the tokens a loss trains (the responses); sample_mask [N]: 0 drops a row from the loss
  and its normalizers (overlong filtering);
- loss_mask [N, T] = token_mask * sample_mask[:, None]: built here, once, and shipped; losses and the
  normalizers read it;
- generation_logprobs [N, T] (optional): the generation engine's log-probs of the sampled tokens;
- routed_experts [N, T, L, k] int16 (optional): the experts each position was routed to in each MoE layer;
- columns: any other per-row entries a loss needs, tensors [N, ...] or lists of N (e.g. a custom loss's inputs),
  reaching it unchanged, sliced along dim 0.
Written on the workers, into their shard (never shipped back in): prev_logprobs [N, T],
reference_policy_logprobs [N, T]; sent with train: advantages [N].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

REQUIRED = ("input_ids", "input_lengths", "token_mask", "sample_mask")
OPTIONAL = ("generation_logprobs", "routed_experts")


def loss_mask(token_mask: torch.Tensor, sample_mask: torch.Tensor) -> torch.Tensor:
    """token_mask [B, T] x sample_mask [B] -> [B, T] float: the positions a loss and its normalizer count (the
    generated tokens of the samples not filtered out). The one definition."""
    return token_mask.float() * sample_mask.float()[:, None]


def require_keys(batch: dict[str, Any], keys, what: str) -> None:
    """KeyError naming the keys of `keys` the batch lacks (and those it has), for the call `what`."""
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(f"{what}: the batch lacks {missing} (has {sorted(batch)})")


def _check_shape(name: str, value: torch.Tensor, shape: tuple) -> None:
    """ValueError naming the field unless value's leading dims are `shape`."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape[:len(shape)]) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"StepBatch.{name}: expected shape {list(shape)}{'...' if len(shape) > 1 else ''}, "
                         f"got {list(got) if isinstance(got, tuple) else got}")


@dataclass
class StepBatch:
    """One training call's N rows (see the module for the shapes)."""

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    token_mask: torch.Tensor
    sample_mask: torch.Tensor
    generation_logprobs: Optional[torch.Tensor] = None
    routed_experts: Optional[torch.Tensor] = None
    columns: dict[str, Any] = field(default_factory=dict)
    loss_mask: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.input_ids, torch.Tensor) or self.input_ids.dim() != 2:
            raise ValueError(f"StepBatch.input_ids: expected [N, T], got "
                             f"{list(getattr(self.input_ids, 'shape', [])) or type(self.input_ids).__name__}")
        n, t = self.input_ids.shape
        _check_shape("input_lengths", self.input_lengths, (n,))
        _check_shape("token_mask", self.token_mask, (n, t))
        _check_shape("sample_mask", self.sample_mask, (n,))
        for name in OPTIONAL:
            if getattr(self, name) is not None:
                _check_shape(name, getattr(self, name), (n, t))
        for name, value in self.columns.items():
            if isinstance(value, (list, tuple)):
                if len(value) != n:
                    raise ValueError(f"StepBatch.columns['{name}']: expected {n} entries, got {len(value)}")
            else:
                _check_shape(f"columns['{name}']", value, (n,))
        self.loss_mask = loss_mask(self.token_mask, self.sample_mask)

    @classmethod
    def of(cls, batch: "dict[str, Any] | StepBatch", what: str = "train") -> "StepBatch":
        """A StepBatch as is, or one from a dict of the required keys (KeyError naming the missing ones), the
        optional ones, and any other per-row entries (tensors [N, ...], lists of N) as columns."""
        if isinstance(batch, StepBatch):
            return batch
        require_keys(batch, REQUIRED, what)
        n = batch["input_ids"].shape[0]
        columns = {k: v for k, v in batch.items() if k not in REQUIRED + OPTIONAL + ("loss_mask",)
                   and ((isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == n)
                        or (isinstance(v, (list, tuple)) and len(v) == n))}
        return cls(**{k: batch[k] for k in REQUIRED}, **{k: batch.get(k) for k in OPTIONAL}, columns=columns)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self) -> dict[str, torch.Tensor]:
        """What ships to the workers: every per-row tensor by name, the loss mask included."""
        out = {k: getattr(self, k) for k in REQUIRED + ("loss_mask",)}
        out.update({k: getattr(self, k) for k in OPTIONAL if getattr(self, k) is not None})
        return {**out, **self.columns}

    def normalizers(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows [start, stop) (a global batch): its valid samples, valid tokens (the loss's global normalizers)
        and real tokens (prompts and responses; a Mixture-of-Experts model weighs its router terms by them)."""
        return {"global_valid_seqs": self.sample_mask[start:stop].float().sum(),
                "global_valid_toks": self.loss_mask[start:stop].sum(),
                "global_input_toks": self.input_lengths[start:stop].clamp(min=1).sum()}
