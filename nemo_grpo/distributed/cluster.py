"""Starting (or joining) the Ray cluster."""

from __future__ import annotations

import glob
import logging
import os

import ray
from ray._common.utils import get_default_ray_temp_dir

from nemo_grpo.distributed.reaper import reap, start_reaper
from nemo_grpo.errors import MachineError
from nemo_grpo.utils.cli import quiet_libraries

log = logging.getLogger(__name__)

# environment every actor gets: no hub, quiet tokenizers, one math thread unless the worker pins more
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "RAY_AUTH_MODE": "disabled",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "PYTHONWARNINGS": "ignore",
}
# Ray waits a fixed 30 s (ray/_private/node.py) for a new head's raylet to register with its GCS, and raises this
START_TIMEOUT_MESSAGE = "timed out during startup"
START_ATTEMPTS = 3  # a third try: the test suite's own busiest minutes (two background runs starting) missed two


def init_ray(num_cpus: int | None = None, address: str | None = None, log_to_driver: bool = True) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS), else start a local one on loopback. Idempotent.

    A local cluster gets at least 8 logical CPUs: actors here are mostly idle while another works, and
    threads are pinned per process, so logical CPUs are scheduling slots, not cores. It dies with this process,
    even a SIGKILLed one (Ray's fate sharing, completed by distributed/reaper.py); a joined cluster is not ours
    to stop: Ray ends our actors when this driver goes.

    log_to_driver=False keeps the workers' stdout and stderr (vLLM's warnings, model-loading bars, the actors'
    own logs) out of this process's console: they stay in Ray's session directory, which is logged here; and
    this process's libraries (Ray's own banner included) log through the root logger (utils/cli.py).
    """
    if ray.is_initialized():
        return
    if not log_to_driver:
        quiet_libraries()
    for k, v in WORKER_ENV.items():
        os.environ.setdefault(k, v)
    address = address or os.environ.get("RAY_ADDRESS")
    runtime_env = {"env_vars": dict(WORKER_ENV)}
    if address:
        context = ray.init(address=address, runtime_env=runtime_env, log_to_driver=log_to_driver,
                           configure_logging=False)
    else:
        # address="local": a new cluster of our own. Without it ray.init joins a cluster it finds running on this
        # machine (`ray start`'s record in /tmp/ray, or a gcs_server in the process table: another run's, or
        # another network namespace's) and then fails on num_cpus
        context = start_local_cluster(address="local", num_cpus=max(num_cpus or 0, os.cpu_count() or 1, 8),
                                      include_dashboard=False,
                                      _node_ip_address="127.0.0.1", runtime_env=runtime_env,
                                      log_to_driver=log_to_driver, configure_logging=False)
    session = getattr(context, "address_info", {}).get("session_dir")
    if not address and session:
        start_reaper(session)
    if not log_to_driver:
        where = os.path.join(session, "logs") if session else "Ray's session directory (/tmp/ray/session_latest/logs)"
        log.info("Ray workers' output (stdout/stderr of every actor): %s/worker-*.out, *.err", where)


def start_local_cluster(**init_kwargs):
    """ray.init(**init_kwargs) of a new local cluster, tried START_ATTEMPTS times: on an overloaded machine the
    raylet can miss Ray's fixed 30 s start-up wait. Ray then raises with the half-started node's processes (GCS,
    raylet, agents) still running; they are ended before the next try (they hold files in the node's session
    directory, named after this process). The last failure is a MachineError that names the remedy."""
    own_sessions = os.path.join(init_kwargs.get("_temp_dir") or get_default_ray_temp_dir(), f"session_*_{os.getpid()}")
    for attempt in range(1, START_ATTEMPTS + 1):
        before = set(glob.glob(own_sessions))
        try:
            return ray.init(**init_kwargs)
        except Exception as e:
            if START_TIMEOUT_MESSAGE not in str(e):
                raise
            for session_dir in set(glob.glob(own_sessions)) - before:
                reap(session_dir, spare=os.getpid())
            load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
            if attempt == START_ATTEMPTS:
                raise MachineError(
                    f"the local Ray cluster did not start: on each of {START_ATTEMPTS} tries its raylet missed Ray's "
                    f"fixed 30 s start-up wait ({load}). Run again when the machine is less busy, or start the "
                    "cluster first (`ray start --head`) and let the run join it: RAY_ADDRESS=auto") from e
            log.warning("the local Ray cluster did not start within Ray's 30 s (%s); stopped its processes, "
                        "starting it again (attempt %d of %d)", load, attempt + 1, START_ATTEMPTS)
