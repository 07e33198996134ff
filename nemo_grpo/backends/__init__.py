"""Policy back ends by name: each provides exactly one PolicyWorker subclass."""

from __future__ import annotations

from nemo_grpo.utils.registry import load_registered

BACKENDS = {
    "dtensor": "nemo_grpo.backends.dtensor.worker:DTensorPolicyWorker",
    "megatron": "nemo_grpo.backends.mcore.worker:MegatronPolicyWorker",
}


def worker_class(name: str):
    return load_registered(BACKENDS, name, "policy.backend")
