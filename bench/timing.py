"""What every benchmark here times with: the median wall time of repeated calls, a loss to train with, and the
process's resident memory."""

from __future__ import annotations

import resource
import statistics
import time
from typing import Callable


def median_seconds(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of fn() over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class MeanLogprobLoss:
    """-(mean log-prob of the masked tokens): any differentiable loss does for timing."""

    def __call__(self, logprobs, mb, global_valid_seqs, global_valid_toks):
        return -(logprobs * mb["token_mask"]).sum() / global_valid_toks, {}


def resident_bytes() -> int:
    """This process's resident set (Linux /proc/self/statm)."""
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
