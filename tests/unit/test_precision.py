"""policy.precision=auto: bf16 where the device computes it natively, else fp32 (nemo_grpo/precision.py), and the
one warning for an explicit bf16 on a CPU that emulates it."""

import logging

import pytest
import torch

from nemo_grpo import precision
from nemo_grpo.precision import choose_precision, log_precision

CPU = torch.device("cpu")


def fake_cpu(monkeypatch, capability: str, avx512_bf16: bool = False, amx: bool = False, mkldnn_bf16=False):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(precision, "_mkldnn_bf16", lambda: mkldnn_bf16)


@pytest.mark.parametrize("capability, avx512_bf16, amx, mkldnn_bf16, expected", [
    ("AVX2", False, False, False, "float32"),  # e.g. AMD EPYC Rome/Milan, the AVX2-only CI machine
    ("AVX512", False, False, True, "float32"),  # AVX512 without BF16 (Skylake): oneDNN emulates bf16
    ("AVX512", True, False, True, "bfloat16"),  # AVX512-BF16 (Cooper Lake, Zen 4)
    ("AVX512", True, True, True, "bfloat16"),  # AMX (Sapphire Rapids)
    ("AVX2", True, True, True, "float32"),  # the same hardware held to AVX2 (ATEN_CPU_CAPABILITY=avx2)
    ("DEFAULT", False, False, False, "float32"),
    ("SVE256", False, False, True, "bfloat16"),  # ARMv8.6 with BF16
    ("SVE256", False, False, False, "float32"),
])
def test_auto_on_a_cpu(monkeypatch, capability, avx512_bf16, amx, mkldnn_bf16, expected):
    fake_cpu(monkeypatch, capability, avx512_bf16, amx, mkldnn_bf16)
    choice = choose_precision("auto", CPU)
    assert choice.precision == expected and choice.native_bf16 == (expected == "bfloat16")
    assert f"CPU capability {capability}" in choice.reason
    assert choice.describe("policy.precision").startswith(f"policy.precision=auto: {expected} (")


@pytest.mark.parametrize("supported, expected", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_a_gpu(monkeypatch, supported, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: supported)
    choice = choose_precision("auto", torch.device("cuda", 0))
    assert choice.precision == expected and "NVIDIA H100" in choice.reason


def test_explicit_precisions_are_kept(monkeypatch):
    fake_cpu(monkeypatch, "AVX512", avx512_bf16=True, mkldnn_bf16=True)
    assert choose_precision("float32", CPU).precision == "float32"
    native = choose_precision("bfloat16", CPU)
    assert native.precision == "bfloat16" and native.warning("policy.precision") is None


def test_bf16_on_a_cpu_that_emulates_it_runs_with_one_warning(monkeypatch, caplog):
    fake_cpu(monkeypatch, "AVX2")
    monkeypatch.setattr(precision, "measure_bf16_slowdown", lambda size=256: 78.4)
    choice = choose_precision("bfloat16", CPU)
    assert choice.precision == "bfloat16" and not choice.native_bf16
    with caplog.at_level(logging.INFO, logger="nemo_grpo.precision"):
        log_precision(choice, "env.reward_model.precision")
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "env.reward_model.precision=bfloat16" in record.message and "78x slower" in record.message
    assert "CPU capability AVX2" in record.message


def test_this_machine():
    """The real probe agrees with the table: bf16 only at torch capability AVX512 (with BF16/AMX) or SVE."""
    choice = choose_precision("auto", CPU)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX512",) and not capability.startswith("SVE"):
        assert choice.precision == "float32", choice
    assert capability in choice.reason


def test_the_planner_counts_auto_as_bf16():
    assert precision.gpu_precision("auto") == "bfloat16"
    assert precision.gpu_precision("float32") == "float32"
