"""Fixtures of the functional tests that start policies."""

import pytest


@pytest.fixture(scope="module")
def policy_pool(ray_cluster, tmp_path_factory):
    """The module's PolicyPool (policy_pool.py): started policies reused across its tests, reset by a checkpoint
    load; shut down when the module ends, so the next module starts with the cluster free."""
    from policy_pool import PolicyPool

    pool = PolicyPool(str(tmp_path_factory.mktemp("policy_pool")))
    yield pool
    pool.clear()


@pytest.fixture(scope="module")
def run_actors_pool(ray_cluster, tmp_path_factory):
    """The module's RunActorsPool (policy_pool.py) for train_runs.train_in_process: a run gets the previous run's
    actors, reset, when they would be built alike; shut down when the module ends."""
    from policy_pool import RunActorsPool

    pool = RunActorsPool(str(tmp_path_factory.mktemp("run_actors")))
    yield pool
    pool.clear()
