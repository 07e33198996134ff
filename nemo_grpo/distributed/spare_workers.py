"""Spare workers: the actors of shut-down WorkerGroups kept alive and restarted in place by the next group of the
same kind, so that a rank's process start-up (Ray's worker boot; Python, torch and the back end's imports: 5-10
CPU-seconds a rank) is paid once rather than once per group. Off unless installed; for a process that starts
many short-lived groups on a small cluster (the test suite starts some hundred policies).

    spares = SpareWorkers(max_workers=8)
    previous = install(spares)   # WorkerGroup.shutdown now tears its actors down and keeps them here, and a new
    ...                          # WorkerGroup of the same key restarts them instead of starting new ones
    install(previous); spares.clear()

A worker class opts in by subclassing RestartableWorker: `teardown()` frees what its constructor made (the model,
the process groups) and `restart(env, args, kwargs)` runs the constructor again in the same process, as a new
rank with the torchrun environment `env`. Only groups that reserved their own placement group are kept (one that
runs in a caller's placement group dies with it); a spare keeps its bundles reserved while it waits, and a
group whose reservation waits kills the oldest spares to free theirs (worker_group._wait_evicting_spares).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import ray
import torch.distributed as dist
from ray.util.placement_group import remove_placement_group

log = logging.getLogger(__name__)


class RestartableWorker:
    """A WorkerGroup actor that can host another rank in its process after `teardown()` (see the module)."""

    def teardown(self) -> None:
        """Free what the constructor made and leave no process group: the process may host another rank next.
        Idempotent; a subclass frees its own state, then calls this."""
        self.__dict__.clear()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        _return_free_heap()

    def restart(self, env: dict[str, str], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """After teardown(): become the rank of `env` (RANK, WORLD_SIZE, MASTER_PORT, ...), running the constructor
        with (args, kwargs) as a fresh actor would."""
        os.environ.update(env)
        type(self).__init__(self, *args, **kwargs)


def _return_free_heap() -> None:
    """Give the allocator's free pages back to the OS (glibc), so that an idle spare holds little memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class SpareGroup:
    actors: list  # torn-down RestartableWorker actors, ranks 0..n-1 of their last group
    placement_group: Any  # their bundles, still reserved


def kill_actors(actors: list, placement_group=None, name: str = "workers") -> None:
    """Kill the actors, then remove the placement group (if given); errors of the already dead are ignored."""
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as e:  # already dead
            log.debug("%s: kill failed: %s", name, e)
    if placement_group is not None:
        try:
            remove_placement_group(placement_group)
        except Exception as e:
            log.debug("%s: removing the placement group failed: %s", name, e)


class SpareWorkers:
    """Torn-down groups by key (worker class, ranks, resources, environment), at most max_workers actors in all:
    the least recently kept group is killed first."""

    def __init__(self, max_workers: int):
        self.max_workers = max_workers
        self.groups: list[tuple[tuple, SpareGroup]] = []  # least recently kept first
        self.restarts = 0  # groups handed out again (for the test suite's report)
        self.evictions = 0  # groups killed to make room (keep's limit, or a reservation that waited)

    def take(self, key: tuple) -> Optional[SpareGroup]:
        """The most recently kept group of `key` (removed from the spares), or None."""
        for i in reversed(range(len(self.groups))):
            if self.groups[i][0] == key:
                self.restarts += 1
                return self.groups.pop(i)[1]
        return None

    def keep(self, key: tuple, group: SpareGroup) -> None:
        self.groups.append((key, group))
        while sum(len(g.actors) for _, g in self.groups) > self.max_workers:
            self.evict_oldest()

    def evict_oldest(self) -> None:
        """Kill the least recently kept group and free its bundles (a no-op without spares)."""
        if self.groups:
            _, oldest = self.groups.pop(0)
            kill_actors(oldest.actors, oldest.placement_group, "spare workers")
            self.evictions += 1

    def clear(self) -> None:
        for _, group in self.groups:
            kill_actors(group.actors, group.placement_group, "spare workers")
        self.groups = []


_INSTALLED: Optional[SpareWorkers] = None


def install(spares: Optional[SpareWorkers]) -> Optional[SpareWorkers]:
    """Make `spares` this process's spare workers (None: off); returns the previous ones."""
    global _INSTALLED
    previous, _INSTALLED = _INSTALLED, spares
    return previous


def installed() -> Optional[SpareWorkers]:
    return _INSTALLED
