"""Spare workers: the actors of shut-down WorkerGroups kept alive and restarted in place by the next group of the
same kind, so that a rank's process start-up (Ray's worker boot; Python, torch and the back end's imports: 5-10
CPU-seconds a rank) is paid once rather than once per group. Off unless installed; for a process that starts
many short-lived groups on a small cluster (the test suite starts some hundred policies).

    spares = SpareWorkers(max_workers=8, recycle={MyActor: Recycling(teardown=close_my_actor)})
    previous = install(spares)   # WorkerGroup.shutdown now tears its actors down and keeps them here, and a new
    ...                          # WorkerGroup of the same key restarts them instead of starting new ones
    install(previous); spares.clear()

Any actor class can be recycled, and none knows it: the installer names the classes and, for each, what else
releases an actor's process-wide state (`Recycling`). `teardown` runs that in the actor (through Ray's
`__ray_call__`), then frees what its constructor made (its attributes, the process groups); `restart` runs the
constructor again in the same process, as a new rank with the torchrun environment `env`. Only groups that
reserved their own placement group are kept (one that runs in a caller's placement group dies with it); a spare
keeps its bundles reserved while it waits, and a group whose reservation waits kills the oldest spares to free
theirs (worker_group._wait_evicting_spares).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence

import ray
import torch.distributed as dist
from ray.util.placement_group import remove_placement_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recycling:
    """How the spares recycle the actors of one class. teardown(actor): run in the actor first, to release what
    outlives its attributes (e.g. a library's per-process state; None: nothing); kind(kwargs): what a kept group
    must match besides the class, size and environment, from the constructor's keyword arguments (None: nothing).
    """

    teardown: Optional[Callable[[Any], None]] = None
    kind: Optional[Callable[[dict[str, Any]], Hashable]] = None


def teardown(actor: Any, release: Optional[Callable[[Any], None]]) -> None:
    """In the actor (`__ray_call__`): release(actor), then free what the constructor made and leave no process
    group: the process may host another rank next."""
    if release is not None:
        release(actor)
    actor.__dict__.clear()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    _return_free_heap()


def restart(actor: Any, env: dict[str, str], args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """In the actor (`__ray_call__`), after teardown: become the rank of `env` (RANK, WORLD_SIZE, MASTER_PORT,
    ...), running the constructor with (args, kwargs) as a fresh actor would."""
    os.environ.update(env)
    type(actor).__init__(actor, *args, **kwargs)


def _return_free_heap() -> None:
    """Give the allocator's free pages back to the OS (glibc), so that an idle spare holds little memory."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class SpareGroup:
    actors: list  # torn-down actors, ranks 0..n-1 of their last group
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
    """Torn-down groups by key (worker class, its Recycling's kind, ranks, resources, environment), at most
    max_workers actors in all: the least recently kept group is killed first. recycle: the actor classes it
    keeps, with how (the others are killed at shutdown as without spares)."""

    def __init__(self, max_workers: int, recycle: Optional[dict[type, Recycling]] = None):
        self.max_workers = max_workers
        self.recycle = dict(recycle or {})
        self.groups: list[tuple[tuple, SpareGroup]] = []  # least recently kept first
        self.restarts = 0  # groups handed out again (for the test suite's report)
        self.evictions = 0  # groups killed to make room (keep's limit, or a reservation that waited)

    def key(self, worker_cls: type, kwargs: dict[str, Any], *rest: Hashable) -> Optional[tuple]:
        """The key of a group of `worker_cls` built with `kwargs` and `rest` (its size, resources, environment);
        None when the class is not recycled."""
        how = self.recycle.get(worker_cls)
        if how is None:
            return None
        return (worker_cls, how.kind(kwargs) if how.kind else None, *rest)

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
