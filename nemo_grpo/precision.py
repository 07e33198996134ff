"""The compute precision a model runs in, chosen for the device it runs on.

`policy.precision` (and `env.reward_model.precision`) is "auto" (default), "float32" or "bfloat16". "auto"
means bf16 where the device computes it natively, else fp32:

| device                                                          | auto     |
|-----------------------------------------------------------------|----------|
| CUDA GPU with bf16 (`torch.cuda.is_bf16_supported()`: Ampere+)  | bfloat16 |
| CUDA GPU without                                                | float32  |
| CPU at torch capability AVX512 with AVX512-BF16 or AMX          | bfloat16 |
| CPU at capability SVE* with oneDNN bf16 (ARMv8.6 BF16)          | bfloat16 |
| any other CPU (AVX2, AVX512 without BF16, DEFAULT, ...)         | float32  |

The capability is torch's dispatch level (`torch.backends.cpu.get_cpu_capability()`), so a CPU held to AVX2 by
`ATEN_CPU_CAPABILITY=avx2` counts as one without native bf16. There bf16 is emulated and slow: on an AVX2 core a
1024^2 matmul runs 70 GFLOP/s in fp32 and 0.9 in bf16. An explicit "bfloat16" there still runs, with a warning
that gives the slowdown measured on the spot (`measure_bf16_slowdown`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

PRECISIONS = ["auto", "float32", "bfloat16"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrecisionChoice:
    """What a model on one device runs in: `precision` ("float32" | "bfloat16"), the `requested` value, whether
    the device computes bf16 natively, and the reason in words (for the start-up log)."""
    precision: str
    requested: str
    native_bf16: bool
    reason: str
    bf16_slowdown: float = 0.0  # measured bf16 / fp32 matmul time, when bf16 was asked of a non-native CPU

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self, key: str) -> str:
        """E.g. `policy.precision=auto: float32 (CPU capability AVX2: no native bf16)`."""
        return f"{key}={self.requested}: {self.precision} ({self.reason})"

    def warning(self, key: str) -> str | None:
        """The one warning for an explicit bf16 on a CPU that emulates it, else None."""
        if self.precision != "bfloat16" or self.native_bf16:
            return None
        return (f"{key}=bfloat16 on a CPU without native bf16 ({self.reason}): a bf16 matmul measured "
                f"{self.bf16_slowdown:.0f}x slower than float32 here; {key}=auto (or float32) runs float32")


def native_bf16(device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes bf16 natively, and why (see the module's table)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return True, f"CUDA device {name} computes bf16"
        return False, f"CUDA device {name}: no bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512" and torch.cpu._is_amx_tile_supported():
        return True, f"CPU capability {capability} with AMX"
    if capability == "AVX512" and torch.cpu._is_avx512_bf16_supported():
        return True, f"CPU capability {capability} with AVX512-BF16"
    if capability.startswith("SVE") and _mkldnn_bf16():
        return True, f"CPU capability {capability} with bf16"
    return False, f"CPU capability {capability}: no native bf16"


def _mkldnn_bf16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def measure_bf16_slowdown(size: int = 256) -> float:
    """Time of a size^2 bf16 matmul over the fp32 one, on this CPU (a few tens of ms where bf16 is emulated)."""
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up: the first call picks the kernel
        start, runs = time.perf_counter(), 0
        while runs < 3 or time.perf_counter() - start < 0.02:
            a @ b
            runs += 1
        seconds[dtype] = (time.perf_counter() - start) / runs
    return seconds[torch.bfloat16] / seconds[torch.float32]


def choose_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """The precision for `requested` ("auto" | "float32" | "bfloat16") on `device`."""
    native, reason = native_bf16(device)
    if requested == "auto":
        return PrecisionChoice("bfloat16" if native else "float32", requested, native, reason)
    if requested == "bfloat16" and not native and device.type == "cpu":
        return PrecisionChoice(requested, requested, native, reason, measure_bf16_slowdown())
    return PrecisionChoice(requested, requested, native, reason)


def gpu_precision(requested: str) -> str:
    """The precision the memory planner counts for a GPU cluster: "auto" is bf16 (every GPU it plans for,
    Ampere and later, computes bf16)."""
    return "bfloat16" if requested == "auto" else requested


def log_precision(choice: PrecisionChoice, key: str) -> None:
    """The choice and its reason at start (info), or the bf16-on-a-slow-CPU warning."""
    warning = choice.warning(key)
    if warning:
        log.warning(warning)
    else:
        log.info(choice.describe(key))
