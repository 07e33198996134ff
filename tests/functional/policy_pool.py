"""A module's pools of started actors: policies (the `policy_pool` fixture) and the actors of whole GRPO runs
(the `run_actors_pool` fixture, for train_runs.train_in_process); tests/functional/conftest.py.

Starting a policy (Ray actors, torch.distributed over gloo, the model build) costs seconds; resetting one costs a
checkpoint load. A test asks the pool for (config, cluster, model, options) and gets a policy in the state it
started in: right after its start the pool saves a checkpoint, and every later hand-out loads it back (weights;
an optimizer with no state, i.e. fresh; the schedule at step 0; every rank's RNG). Policies stay started between
the tests of a module, at most MAX_WORKERS worker processes in all (the least recently used idle one is shut down
first), and a policy whose test raised is shut down rather than handed out again. A policy shut down here leaves
its worker processes to the session's spare workers (tests/conftest.py), which the next policy of the same back
end and size restarts in place.
"""

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from nemo_grpo.algorithms.grpo import RunActors
from nemo_grpo.build import start_actors
from nemo_grpo.policy import Policy
from nemo_grpo.weights.refit import make_refitter

MAX_WORKERS = 6  # pooled workers, in use or idle: of the 8 CPU slots for the tests' actors, 2 left for a test's own


class PolicyPool:
    def __init__(self, root: str):
        self.root = root
        self.idle: dict[str, Policy] = {}  # key -> policy, least recently used first
        self.initial: dict[str, str] = {}  # key -> checkpoint of its start state
        self.in_use = 0  # workers handed out and not returned
        self.start_of: dict[int, str] = {}  # id(policy) -> checkpoint of its start state

    def reset(self, policy: Policy) -> None:
        """Back to the state the pool handed `policy` out in (its start checkpoint), within the same test."""
        policy.load_checkpoint(self.start_of[id(policy)])

    @contextlib.contextmanager
    def policy(self, cfg, cluster, path: str, *, scalar_head: bool = False, init_reference: bool = False,
               seed: int = 0) -> Iterator[Policy]:
        """`with pool.policy(cfg, cluster, path, ...) as p:` as `with Policy(cfg, cluster, path, ...) as p:`."""
        key = repr((cfg, cluster, os.path.abspath(path), scalar_head, init_reference, seed))
        policy = self.idle.pop(key, None)
        if policy is not None:
            policy.load_checkpoint(self.initial[key])
        else:
            self._make_room(cluster.gpus_per_node * cluster.num_nodes)
            policy = Policy(cfg, cluster, path, scalar_head=scalar_head, init_reference=init_reference, seed=seed)
            # a directory of its own: a key started anew after its test raised must not reuse another's
            self.initial[key] = tempfile.mkdtemp(dir=self.root, prefix="initial_")
            policy.save_checkpoint(self.initial[key])
        self.in_use += policy.world_size
        self.start_of[id(policy)] = self.initial[key]
        try:
            yield policy
        except BaseException:
            policy.shutdown()
            raise
        finally:
            self.in_use -= policy.world_size
        self.idle[key] = policy

    def _make_room(self, workers: int) -> None:
        while self.idle and self.in_use + sum(p.world_size for p in self.idle.values()) + workers > MAX_WORKERS:
            self.idle.pop(next(iter(self.idle))).shutdown()

    def clear(self) -> None:
        for policy in self.idle.values():
            policy.shutdown()
        self.idle.clear()


def run_actors_key(cfg, model_path: str) -> str:
    """What decides how a GRPO run's actors are built (build.start_actors): two runs with the same key could
    share them (their trainer-level settings, the loss, the data and the steps may differ)."""
    envs = sorted({ds.env_name for ds in (cfg.data.train, cfg.data.validation) if ds is not None})
    a = cfg.grpo.async_grpo
    return repr((cfg.policy, cfg.cluster, cfg.env, envs, cfg.grpo.seed, cfg.loss_fn.reference_policy_kl_penalty > 0,
                 a.enabled and a.in_flight_weight_updates, os.path.abspath(model_path)))


@dataclass
class PooledRunActors(RunActors):
    """A run's actors lent by the pool: closing the run hands them back (keep=False: shut down, as after a
    failed run)."""
    give_back: Optional[Callable[["PooledRunActors"], None]] = None
    keep: bool = True

    def close(self) -> None:
        if self.keep:
            self.give_back(self)
        else:
            super().close()


class RunActorsPool:
    """The last in-process run's actors (policy, engine, environments), kept for the next run of the module with
    the same `run_actors_key`, reset to their start: the policy loads the checkpoint taken right after its start
    (weights, a fresh optimizer, schedule, RNG), the engine is refit from it. One set is kept: a run with another
    key shuts it down first (the cluster's CPU slots are few). `start` is build_trainer's `start`."""

    def __init__(self, root: str):
        self.root = root
        self.idle: Optional[tuple[str, RunActors, str]] = None  # (key, actors, checkpoint of the start state)

    def start(self, cfg, model_path: str) -> PooledRunActors:
        key = run_actors_key(cfg, model_path)
        if self.idle is not None and self.idle[0] == key:
            _, actors, initial = self.idle
            self.idle = None
            actors.policy.load_checkpoint(initial)
            refitter = make_refitter(actors.policy, actors.engine, cfg.policy.generation)
            refitter.refit()  # the engine samples from the start weights again
            refitter.close()
        else:
            self.clear()
            actors = start_actors(cfg, model_path)
            initial = tempfile.mkdtemp(dir=self.root, prefix="run_actors_")
            actors.policy.save_checkpoint(initial)

        def give_back(pooled: PooledRunActors) -> None:
            self.clear()
            self.idle = (key, RunActors(pooled.policy, pooled.engine, pooled.envs, pooled.placement_groups), initial)

        return PooledRunActors(actors.policy, actors.engine, actors.envs, actors.placement_groups, give_back)

    def clear(self) -> None:
        if self.idle is not None:
            self.idle[1].close()
            self.idle = None
