"""A module's pool of started policies (the `policy_pool` fixture, tests/functional/conftest.py).

Starting a policy (Ray actors, torch.distributed over gloo, the model build) costs seconds; resetting one costs a
checkpoint load. A test asks the pool for (config, cluster, model, options) and gets a policy in the state it
started in: right after its start the pool saves a checkpoint, and every later hand-out loads it back (weights;
an optimizer with no state, i.e. fresh; the schedule at step 0; every rank's RNG). Policies stay started between
the tests of a module, at most MAX_WORKERS worker processes in all (the least recently used idle one is shut down
first), and a policy whose test raised is shut down rather than handed out again.
"""

import contextlib
import os
import tempfile
from typing import Iterator

from nemo_grpo.policy import Policy

MAX_WORKERS = 6  # pooled workers, in use or idle: the session's Ray cluster has 8 CPU slots, 2 left for a test's own


class PolicyPool:
    def __init__(self, root: str):
        self.root = root
        self.idle: dict[str, Policy] = {}  # key -> policy, least recently used first
        self.initial: dict[str, str] = {}  # key -> checkpoint of its start state
        self.in_use = 0  # workers handed out and not returned

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
