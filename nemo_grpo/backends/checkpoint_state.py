"""Per-rank checkpoint state beside a back end's weight shards: scheduler, RNG states and back-end extras.

Each rank writes `worker_state_rankNNNNN.pt`; a checkpoint loaded at another world size reads rank 0's file
for the scheduler and leaves the RNG states as they are (their streams belong to ranks that no longer exist).
"""

from __future__ import annotations

import os
import random
from typing import Any

import torch


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"worker_state_rank{rank:05d}.pt")


def save_rank_state(path: str, rank: int, scheduler, **extra: Any) -> None:
    """This rank's file: scheduler, RNG states (torch, python, cuda) and the back end's `extra`."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save({"scheduler": scheduler.state_dict(), "rng": rng, **extra}, rank_file(path, rank))


def load_rank_state(path: str, rank: int) -> dict[str, Any]:
    """save_rank_state's dict (rank 0's when the checkpoint has no file of this rank), with "own" telling which."""
    own = os.path.isfile(rank_file(path, rank))
    state = torch.load(rank_file(path, rank if own else 0), weights_only=False)
    return {**state, "own": own}


def restore_schedule_and_rng(state: dict[str, Any], scheduler, optimizer) -> None:
    """The scheduler (and the lr it sets) always; the RNG states only from this rank's own file."""
    scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    if state["own"]:
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng"]["cuda"])
