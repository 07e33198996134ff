"""The two-node tier: a real Slurm cluster on this machine (scripts/multinode/cluster.sh: network, UTS and mount
namespaces, slurmctld and one slurmd per node), started once for the session and removed after it.

Where the machine cannot run it (not root, no network namespaces) every test here skips with one line saying why.
A job's files (logs, checkpoints, the built-in model cache) live under the cluster's STATE_DIR, on the machine's
own filesystem, which every node sees: each node has a /tmp of its own, as real machines do.
"""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "multinode"))

from slurm_jobs import STATE_DIR, cluster_command, submit_env  # noqa: E402


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/multinode/" in str(item.fspath):
            item.add_marker(pytest.mark.multinode)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running cluster: (its STATE_DIR, the environment a job is submitted with). Skips where the machine
    cannot run it."""
    check = cluster_command("check")
    if check.returncode != 0:
        pytest.skip(check.stdout.strip() or check.stderr.strip())
    up = cluster_command("up")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield STATE_DIR, submit_env(os.path.dirname(sys.executable))
    finally:
        down = cluster_command("down")
        assert down.returncode == 0, down.stdout + down.stderr
