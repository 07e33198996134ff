"""Bradley-Terry reward-model training: the pairwise loss and its accuracy.

Batches hold pairs as consecutive rows (chosen_0, rejected_0, chosen_1, rejected_1, ...): see
nemo_grpo/data/preferences.py::pair_batch. Micro-batches and data-parallel shards must therefore hold an
even number of rows (whole pairs); train_rm checks the batch sizes before anything starts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BradleyTerryLoss:
    """scores [b] (rows chosen, rejected, ...) -> sum over the micro-batch's pairs of -log sigmoid(r_c - r_r),
    divided by the global pair count: an additive contribution, as every loss here (backends/base.py)."""

    def __call__(self, scores: torch.Tensor, mb: dict, global_valid_seqs: torch.Tensor, global_valid_toks):
        if scores.dim() != 1 or scores.shape[0] % 2:
            raise ValueError(f"Bradley-Terry loss: expected scores [b] of whole (chosen, rejected) pairs, got "
                             f"shape {tuple(scores.shape)}; micro-batches must hold an even number of rows")
        margin = scores[0::2] - scores[1::2]  # [b / 2]
        pair_mask = mb["sample_mask"][0::2].to(scores.dtype)
        pairs = global_valid_seqs / 2
        loss = (-F.logsigmoid(margin) * pair_mask).sum() / pairs
        return loss, {"accuracy": ((margin > 0).to(scores.dtype) * pair_mask).sum() / pairs,
                      "margin": (margin.detach() * pair_mask).sum() / pairs}


def pair_accuracy(scores: torch.Tensor) -> torch.Tensor:
    """scores [2P] (rows chosen, rejected, ...) -> [P] 1.0 where the chosen response scores higher."""
    return (scores[0::2] > scores[1::2]).float()
