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


# The user runs (train_runs.USER_RUNS: the default recipe's 400 steps on each back end, as a user runs them) start
# with the session's first functional test and run beside every other test at nice 19, so that they take the cores
# the other tests leave idle (about a fifth). Not the idle time only: the session's own Ray workers run at Ray's
# nice 15, so the first modules slow down while the runs last (about 6 minutes). Three other arrangements measured
# slower over the whole suite: SCHED_IDLE (the runs starve, then compete with test_grpo_e2e.py), the runs one
# after the other (21:11 against 19:45 at once, the same checkout half an hour apart) and the modules without a slow
# test first, beside the runs (22:50: the runs took 9 minutes, and test_mcore_moe.py 211 s against 85).
# USER_RUNS_MODULE's tests, moved to the end of the session, wait for the runs.
USER_RUNS_NICE = 19
USER_RUNS_MODULE = "test_user_runs.py"


def pytest_collection_modifyitems(items):
    """The tests that wait for the user runs go last, so that the runs overlap the whole session."""
    waits = [item for item in items if item.path.name == USER_RUNS_MODULE]
    items[:] = [item for item in items if item.path.name != USER_RUNS_MODULE] + waits


@pytest.fixture(scope="session", autouse=True)
def user_runs(request, tmp_path_factory):
    """{back end: (tmp_path, ModuleRun)}: the selected user runs (train_runs.USER_RUNS), started now, each in a
    process and a Ray cluster of its own; killed at the session's end if still running. Empty when none is
    selected."""
    selected = sorted({item.callspec.params["backend"] for item in request.session.items
                       if item.path.name == USER_RUNS_MODULE})
    if not selected:
        yield {}
        return
    request.getfixturevalue("model_cache_dir")  # NEMO_GRPO_CACHE, which the processes inherit
    from train_runs import USER_RUNS, start_train

    from nemo_grpo.models.builtin import resolve_model_path
    from nemo_grpo.validation import load_config

    for backend in selected:  # the runs' built-in model, built once here rather than by both runs at once
        resolve_model_path(load_config(None, list(USER_RUNS[backend]), files=False).policy.model_name)
    runs = {}
    for backend in selected:
        tmp_path = tmp_path_factory.mktemp(f"user_run_{backend}")
        runs[backend] = tmp_path, start_train(tmp_path, *USER_RUNS[backend], nice=USER_RUNS_NICE)
    yield runs
    for _, run in runs.values():
        run.kill()
