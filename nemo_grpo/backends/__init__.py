"""Policy back ends by name: each provides exactly one PolicyWorker subclass."""

from __future__ import annotations

import importlib

BACKENDS = {
    "dtensor": "nemo_grpo.backends.dtensor.worker:DTensorPolicyWorker",
}


def worker_class(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown policy.backend '{name}'; known: {', '.join(sorted(BACKENDS))}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)
