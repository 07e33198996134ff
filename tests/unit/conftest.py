"""tests/unit is the tier that starts nothing: no subprocess, no Ray cluster, no process group. A test that
tries fails at once with where it belongs; such a test lives in tests/functional."""

import subprocess

import matplotlib.font_manager  # noqa: F401  its first import on a machine runs fc-list: before the refusal below
import pytest


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"tests/unit starts no {what}: move this test to tests/functional")
    return refuse


@pytest.fixture(autouse=True)
def nothing_started(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("subprocess"))
    monkeypatch.setattr("ray.init", _refuse("Ray cluster"))
    # nor joins the session's (init_ray returns at once when the functional tests' cluster is up); build and
    # reward_model import init_ray at their top, so they hold a reference of their own. They are patched first:
    # patching one imports it, and an import after cluster's patch would bind (and "restore") the refusal
    for module in ("nemo_grpo.build", "nemo_grpo.algorithms.reward_model", "nemo_grpo.distributed.cluster"):
        monkeypatch.setattr(f"{module}.init_ray", _refuse("Ray cluster"))
    monkeypatch.setattr("torch.distributed.init_process_group", _refuse("process group"))
