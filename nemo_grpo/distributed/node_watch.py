"""A lost node ends a multi-node run in bounded time, with one line that names it.

When a node of the Ray cluster dies (its raylet and every process on it killed), the actors there die with it
and the ranks on the surviving nodes wait in their gloo collectives for the peers that are gone, up to the
process group's 30-minute timeout, while the driver waits on them in ray.get. This watchdog, a daemon thread of
the driver started with the trainer's run, records the nodes alive at its start (`ray.nodes()`) and asks again
every POLL_S seconds; when one of them is no longer alive it prints one line (the node, the step under way, the
newest complete checkpoint and how to resume) and ends the driver with status LOST_NODE_EXIT.

Detection is bounded by Ray's own: the GCS marks a node dead once health_check_failure_threshold (5) health
checks in a row, health_check_period_ms (3000) apart, have failed (src/ray/common/ray_config_def.h; a node
that stops answering rather than refusing adds up to health_check_timeout_ms, 10 s, per check). A killed node
therefore shows as dead after about 15-20 s, and this thread sees it within POLL_S more.

Every node alive at the start counts, whether or not the run placed work on it: a Slurm job's Ray cluster is
the run's own. Nodes that join later are not watched. A single-node cluster gets no thread at all (its node
is the driver's: when it dies, the driver is gone too).

    watch = start_node_watch(lambda: (step_under_way, newest_checkpoint))   # None on one node or without Ray
    try:
        ...                                                                  # the run
    except BaseException:
        if watch is not None:
            watch.settle()  # the error came from a lost node: its line and exit 3 (after Ray has decided)
        raise
    finally:
        if watch is not None:
            watch.stop()
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import ray

log = logging.getLogger(__name__)

POLL_S = 2.0  # seconds between two looks at ray.nodes()
LOST_NODE_EXIT = 3  # the driver's exit status when a node of the run was lost
# how long an error in a watched run waits for Ray to tell whether a node was lost behind it (detection: ~15-20 s)
SETTLE_S = 30.0
Progress = Callable[[], tuple[int, Optional[str]]]  # -> (the step under way, the newest complete checkpoint)


@dataclass(frozen=True)
class NodeRecord:
    """What names a Ray node to a person: its host name and address, and Ray's node ID."""
    node_id: str
    address: str
    hostname: str

    def describe(self) -> str:
        """`n2 (10.77.0.12, Ray node 3f2a9c01..)`"""
        return f"{self.hostname} ({self.address}, Ray node {self.node_id[:8]}..)"


# ----------------------------------------------------------------------------------------------- decisions
def alive_nodes(nodes: list[dict]) -> dict[str, NodeRecord]:
    """Node ID -> NodeRecord of each alive node in `nodes` (records as `ray.nodes()` returns them)."""
    return {n["NodeID"]: NodeRecord(n["NodeID"], n.get("NodeManagerAddress", "?"), n.get("NodeManagerHostname", "?"))
            for n in nodes if n.get("Alive")}


def lost_nodes(start: dict[str, NodeRecord], nodes: list[dict]) -> list[NodeRecord]:
    """The nodes of `start` (alive_nodes at the start) that `nodes` (ray.nodes() now) no longer lists alive:
    marked dead, or gone from the list. A node that came back under a new ID is lost too (its processes are)."""
    now = alive_nodes(nodes)
    return [record for node_id, record in start.items() if node_id not in now]


def lost_node_line(lost: list[NodeRecord], step: int, checkpoint: Optional[str]) -> str:
    """The one line a lost node ends the run with: which node(s), at which step, the exit status, and where a
    rerun of the same command resumes (`checkpoint`: the newest complete one, None when there is none)."""
    names = ", ".join(record.describe() for record in lost)
    what = f"lost node {names}" if len(lost) == 1 else f"lost {len(lost)} nodes {names}"
    whose = "its" if len(lost) == 1 else "their"
    resume = (f"The newest complete checkpoint is {checkpoint}; rerun the same command to resume." if checkpoint
              else "There is no complete checkpoint to resume from; rerunning the same command starts over.")
    return (f"nemo_grpo: {what} at step {step}: {whose} processes are gone; the run stops (exit {LOST_NODE_EXIT}). "
            f"{resume}")


# ----------------------------------------------------------------------------------------------- the thread
class NodeWatch:
    """The watchdog thread (a daemon): `start()`, then `stop()` when the run is over. `list_nodes` stands in
    for ray.nodes; `end` for end_process (what happens to the driver when a node is lost)."""

    def __init__(self, start_nodes: dict[str, NodeRecord], progress: Progress, *, poll_s: float = POLL_S,
                 list_nodes: Callable[[], list[dict]] = ray.nodes, end: Optional[Callable[[str], None]] = None):
        self.start_nodes, self.progress, self.poll_s = start_nodes, progress, poll_s
        self._list_nodes, self._end = list_nodes, end or end_process
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nemo_grpo-node-watch", daemon=True)

    def start(self) -> "NodeWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (within one poll)."""
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 5)

    def check(self) -> Optional[str]:
        """One look: the line to end the run with when a node was lost, else None."""
        lost = lost_nodes(self.start_nodes, self._list_nodes())
        if not lost:
            return None
        step, checkpoint = self.progress()
        return lost_node_line(lost, step, checkpoint)

    def settle(self, wait_s: float = SETTLE_S) -> None:
        """After an error in the run: a lost node is its usual cause on several nodes, and the error comes first
        (a collective whose peer is gone fails at once: "Connection closed by peer"; Ray marks the node dead
        15-20 s later). Look until Ray has decided, up to wait_s: a lost node ends the process with its line;
        otherwise this returns and the error stands."""
        deadline = time.monotonic() + wait_s
        while not self._stopped.is_set():
            line = self._look()
            if line is not None:
                self._end(line)
                return
            if time.monotonic() >= deadline:
                return
            time.sleep(min(self.poll_s, max(deadline - time.monotonic(), 0.0)))

    def _look(self) -> Optional[str]:
        """check(), with a GCS briefly out of reach taken as no news (the caller looks again)."""
        try:
            return self.check()
        except Exception:
            log.debug("ray.nodes() failed; looking again in %.0f s", self.poll_s, exc_info=True)
            return None

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            line = self._look()
            if line is not None and not self._stopped.is_set():
                self._end(line)
                return


def end_process(line: str) -> None:
    """Print `line` on stderr (and into the log files), flush what this process has buffered, and end it with
    LOST_NODE_EXIT at once."""
    sys.stdout.flush()
    try:
        from tqdm import tqdm  # above a progress bar, not inside it

        tqdm.write(line, file=sys.stderr)
    except ImportError:
        print(line, file=sys.stderr)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, line, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):  # run.log; the console has the line already
            handler.handle(record)
        handler.flush()
    sys.stderr.flush()
    # os._exit, not an exception: the main thread may be blocked for good in ray.get on a collective that never
    # completes (the surviving ranks wait in gloo for the lost ones), so it cannot be interrupted reliably, and
    # sys.exit here would end only this thread. No finally block or atexit handler runs: the run's actors die
    # with their owner, this driver (Ray kills an actor whose owner is gone), and a local cluster with its reaper.
    os._exit(LOST_NODE_EXIT)


def start_node_watch(progress: Progress, poll_s: float = POLL_S) -> Optional[NodeWatch]:
    """A started NodeWatch when this process is connected to a Ray cluster of more than one alive node; None
    (no thread) on a single node or without Ray. `progress()` -> (the step under way, the newest complete
    checkpoint or None), asked from the thread when a node is lost."""
    if not ray.is_initialized():
        return None
    start = alive_nodes(ray.nodes())
    if len(start) < 2:
        return None
    log.info("watching the run's %d Ray nodes: a lost node ends the run (exit %d)", len(start), LOST_NODE_EXIT)
    return NodeWatch(start, progress, poll_s=poll_s).start()
