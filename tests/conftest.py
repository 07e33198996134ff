"""Session-wide fixtures: one Ray cluster, one set of tiny models and one built-in model cache per test session;
user_console, which undoes what an entry point run in-process does to logging."""

import logging
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import torch

torch.set_num_threads(1)


SPARE_WORKERS = 8  # torn-down policy workers kept for restarts in place (nemo_grpo/distributed/spare_workers.py)


def policy_recycling():
    """How the session recycles PolicyActors (spare_workers.Recycling): a policy rank's actor is closed (its
    engine lets go of Megatron's model-parallel state) and its process's kernel call counts, which describe the
    rank it hosted, start again from zero; a kept group is restarted only for a policy of the same back end."""

    def release(actor) -> None:  # (a nested function: it travels to the actors by value)
        from nemo_grpo.backends import context_parallel, varlen

        actor.close()
        varlen.CALLS.clear()
        context_parallel.CALLS.clear()

    from nemo_grpo.distributed.spare_workers import Recycling

    return Recycling(teardown=release, kind=lambda kwargs: kwargs["cfg"].backend)


@pytest.fixture(scope="session")
def ray_cluster():
    """The session's Ray cluster: 8 CPU slots for the tests' actors and SPARE_WORKERS more for the spare workers,
    which every WorkerGroup of the session shares: a policy shut down in one test is torn down and kept, and the
    next policy of the same back end and size restarts its processes rather than starting new ones (a worker's
    start-up is most of a tiny policy's)."""
    import ray

    from nemo_grpo.backends.actor import PolicyActor
    from nemo_grpo.distributed import spare_workers
    from nemo_grpo.distributed.cluster import init_ray

    init_ray(num_cpus=8 + SPARE_WORKERS)
    spares = spare_workers.SpareWorkers(max_workers=SPARE_WORKERS, recycle={PolicyActor: policy_recycling()})
    previous = spare_workers.install(spares)
    yield
    spare_workers.install(previous)
    print(f"\nspare workers: {spares.restarts} policies started in existing worker processes")
    spares.clear()
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: tiny_model_dir(arch="qwen2", scalar_head=False, **overrides) -> path of a saved HF dir (cached)."""
    from nemo_grpo.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    made = {}

    def make(arch="qwen2", scalar_head=False, **overrides):
        key = (arch, scalar_head, repr(sorted(overrides.items())))  # (values may be dicts: rope_scaling)
        if key not in made:
            name = f"{arch}{'_rm' if scalar_head else ''}_{len(made)}"
            made[key] = save_tiny_model(str(root / name), arch=arch, scalar_head=scalar_head, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory):
    """NEMO_GRPO_CACHE for the whole session: each built-in model (the warm-started tiny ones, SmolLM2's HF
    directory) is built once per test session, in a fresh directory, and reused by every module and run."""
    old = os.environ.get("NEMO_GRPO_CACHE")
    os.environ["NEMO_GRPO_CACHE"] = str(tmp_path_factory.mktemp("nemo_grpo_cache"))
    yield os.environ["NEMO_GRPO_CACHE"]
    if old is None:
        os.environ.pop("NEMO_GRPO_CACHE")
    else:
        os.environ["NEMO_GRPO_CACHE"] = old


@pytest.fixture
def user_console():
    """Undo what an entry point does to this process's logging (root handlers and level, the third-party
    loggers quiet_libraries reroutes, logging.captureWarnings) and warnings filters, so that no other test of
    the session sees it."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    loggers = {name: (list(lg.handlers), lg.propagate) for name, lg in logging.root.manager.loggerDict.items()
               if isinstance(lg, logging.Logger)}
    captured = getattr(warnings.showwarning, "__module__", None) == "logging"
    with warnings.catch_warnings():  # restores the filters and warnings.showwarning on exit
        yield
        if not captured:
            logging.captureWarnings(False)
    for handler in root.handlers:
        if handler not in saved[0]:
            handler.close()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            handlers, propagate = loggers.get(name, (lg.handlers, lg.propagate))
            lg.handlers[:], lg.propagate = handlers, propagate
