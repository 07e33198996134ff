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


def machine_line() -> str:
    """The machine a bench's figures come from, printed first: the CPU, torch's capability on it (AVX2, AVX512:
    bf16 is native only at AVX512 with BF16/AMX, nemo_grpo/precision.py), its cores, and a GPU if any."""
    import os

    import torch

    model = "unknown CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return (f"machine: {model}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}, "
            f"{os.cpu_count()} cores{gpu}")
