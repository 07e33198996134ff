"""Starting (or joining) the Ray cluster."""

from __future__ import annotations

import os

# environment every actor gets: no hub, quiet tokenizers, one math thread unless the worker pins more
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONWARNINGS": "ignore",
}


def init_ray(num_cpus: int | None = None, address: str | None = None) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS), else start a local one on loopback. Idempotent.

    A local cluster gets at least 8 logical CPUs: actors here are mostly idle while another works, and
    threads are pinned per process, so logical CPUs are scheduling slots, not cores.
    """
    import ray

    if ray.is_initialized():
        return
    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": dict(WORKER_ENV)}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return
    ray.init(num_cpus=max(num_cpus or 0, os.cpu_count() or 1, 8), include_dashboard=False,
             _node_ip_address="127.0.0.1", runtime_env=runtime_env, log_to_driver=True,
             configure_logging=False)
