"""The driver's two ways out of a multi-node run, without a cluster: the node watch's decisions (which nodes of
the start are lost, the line it ends the run with) and its thread on hand-made ray.nodes() records; the
StopSignal flag that SIGUSR1 sets."""

import os
import signal
import threading
import time

import pytest

from nemo_grpo.distributed import node_watch
from nemo_grpo.distributed.node_watch import (LOST_NODE_EXIT, NodeRecord, NodeWatch, alive_nodes, lost_node_line,
                                              lost_nodes, start_node_watch)
from nemo_grpo.utils.stop_signal import STOP_SIGNALS, StopSignal


def node(node_id: str, host: str, address: str, alive: bool = True) -> dict:
    """A record as ray.nodes() returns it (the keys the watch reads, and a few it does not)."""
    return {"NodeID": node_id, "NodeManagerHostname": host, "NodeManagerAddress": address, "Alive": alive,
            "Resources": {"CPU": 16.0}, "state": "ALIVE" if alive else "DEAD"}


HEAD = node("a1b2c3d4e5f60718", "n1", "10.77.0.11")
N2 = node("3f2a9c01deadbeef", "n2", "10.77.0.12")
N3 = node("77aa88bb99cc00dd", "n3", "10.77.0.13")


# ----------------------------------------------------------------------------------------------- decisions
def test_the_start_records_only_the_alive_nodes():
    start = alive_nodes([HEAD, N2, node("0000dead", "n9", "10.77.0.19", alive=False)])
    assert start == {"a1b2c3d4e5f60718": NodeRecord("a1b2c3d4e5f60718", "10.77.0.11", "n1"),
                     "3f2a9c01deadbeef": NodeRecord("3f2a9c01deadbeef", "10.77.0.12", "n2")}


def test_a_node_marked_dead_or_gone_from_the_list_is_lost():
    start = alive_nodes([HEAD, N2, N3])
    assert lost_nodes(start, [HEAD, N2, N3]) == []
    assert lost_nodes(start, [HEAD, {**N2, "Alive": False}, N3]) == [start[N2["NodeID"]]]
    assert lost_nodes(start, [HEAD, N3]) == [start[N2["NodeID"]]]
    assert lost_nodes(start, [HEAD, {**N2, "Alive": False}, {**N3, "Alive": False}]) == [
        start[N2["NodeID"]], start[N3["NodeID"]]]


def test_a_node_that_joins_later_is_not_watched_and_one_back_under_a_new_id_is_lost():
    start = alive_nodes([HEAD, N2])
    assert lost_nodes(start, [HEAD, N2, N3]) == []
    restarted = node("99999999aaaaaaaa", "n2", "10.77.0.12")  # same host, new raylet: the old processes are gone
    assert lost_nodes(start, [HEAD, {**N2, "Alive": False}, restarted]) == [start[N2["NodeID"]]]


def test_the_line_names_the_node_the_step_and_the_checkpoint():
    [lost] = lost_nodes(alive_nodes([HEAD, N2]), [HEAD])
    assert lost_node_line([lost], 5, "results/x/step_4") == (
        "nemo_grpo: lost node n2 (10.77.0.12, Ray node 3f2a9c01..) at step 5: its processes are gone; the run stops "
        "(exit 3). The newest complete checkpoint is results/x/step_4; rerun the same command to resume.")
    assert LOST_NODE_EXIT == 3


def test_the_line_for_two_nodes_and_no_checkpoint():
    lost = lost_nodes(alive_nodes([HEAD, N2, N3]), [HEAD])
    line = lost_node_line(lost, 1, None)
    assert line == ("nemo_grpo: lost 2 nodes n2 (10.77.0.12, Ray node 3f2a9c01..), n3 (10.77.0.13, Ray node "
                    "77aa88bb..) at step 1: their processes are gone; the run stops (exit 3). There is no complete "
                    "checkpoint to resume from; rerunning the same command starts over.")
    assert "\n" not in line


# ----------------------------------------------------------------------------------------------- the thread
class Cluster:
    """ray.nodes() stand-in: answers `views` in turn (then the last one); an Exception in it is raised."""

    def __init__(self, *views):
        self.views, self.calls = list(views), 0

    def __call__(self):
        view = self.views[min(self.calls, len(self.views) - 1)]
        self.calls += 1
        if isinstance(view, Exception):
            raise view
        return view


def test_the_thread_ends_the_run_once_with_the_line_when_a_node_is_lost():
    """A failed ray.nodes() is asked again; the loss is reported with the trainer's progress at that moment."""
    ended, done = [], threading.Event()
    cluster = Cluster([HEAD, N2], RuntimeError("GCS busy"), [HEAD, {**N2, "Alive": False}])
    watch = NodeWatch(alive_nodes([HEAD, N2]), lambda: (7, "ckpt/step_6"), poll_s=0.01, list_nodes=cluster,
                      end=lambda line: (ended.append(line), done.set()))
    watch.start()
    assert done.wait(10)
    watch.stop()
    assert ended == [lost_node_line(lost_nodes(watch.start_nodes, [HEAD]), 7, "ckpt/step_6")]
    assert cluster.calls == 3 and not watch._thread.is_alive()


def test_an_error_waits_for_ray_to_mark_the_node_dead_then_ends_with_its_line():
    """The collective fails at once; Ray marks the node dead a few looks later: settle() ends with the line."""
    ended = []
    cluster = Cluster([HEAD, N2], RuntimeError("GCS busy"), [HEAD, N2], [HEAD, {**N2, "Alive": False}])
    watch = NodeWatch(alive_nodes([HEAD, N2]), lambda: (4, "ckpt/step_2"), poll_s=0.01, list_nodes=cluster,
                      end=ended.append)
    watch.settle(wait_s=10)
    assert ended == [lost_node_line(lost_nodes(watch.start_nodes, [HEAD]), 4, "ckpt/step_2")]


def test_an_error_with_every_node_alive_stands_after_the_wait():
    ended = []
    cluster = Cluster([HEAD, N2])
    watch = NodeWatch(alive_nodes([HEAD, N2]), lambda: (1, None), poll_s=0.01, list_nodes=cluster, end=ended.append)
    start = time.monotonic()
    watch.settle(wait_s=0.2)
    assert ended == [] and 0.2 <= time.monotonic() - start < 5 and cluster.calls >= 2


def test_a_stopped_watch_ends_nothing():
    ended = []
    cluster = Cluster([HEAD, N2])
    watch = NodeWatch(alive_nodes([HEAD, N2]), lambda: (1, None), poll_s=0.01, list_nodes=cluster,
                      end=ended.append).start()
    deadline = time.monotonic() + 10
    while cluster.calls < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    watch.stop()
    assert cluster.calls >= 3 and not watch._thread.is_alive() and ended == []


@pytest.mark.parametrize("nodes", [[HEAD], [HEAD, {**N2, "Alive": False}]])
def test_a_single_node_cluster_gets_no_thread(monkeypatch, nodes):
    monkeypatch.setattr(node_watch.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(node_watch.ray, "nodes", lambda: nodes)
    assert start_node_watch(lambda: (1, None)) is None


def test_without_ray_there_is_no_thread():
    assert start_node_watch(lambda: (1, None)) is None


def test_a_multi_node_cluster_gets_a_watch_of_its_alive_nodes(monkeypatch):
    monkeypatch.setattr(node_watch.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(node_watch.ray, "nodes", lambda: [HEAD, N2])
    watch = start_node_watch(lambda: (1, None), poll_s=60)
    try:
        assert set(watch.start_nodes) == {HEAD["NodeID"], N2["NodeID"]} and watch._thread.daemon
    finally:
        watch.stop()
    assert not watch._thread.is_alive()


# ----------------------------------------------------------------------------------------------- StopSignal
def wait_for(predicate, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.001)
    return predicate()


def test_sigusr1_sets_the_flag_and_the_previous_handler_comes_back():
    assert set(STOP_SIGNALS) == {signal.SIGUSR1}  # SIGTERM is not handled (yet)
    calls = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        with StopSignal() as stop:
            assert stop.received is None and stop.name == ""
            os.kill(os.getpid(), signal.SIGUSR1)
            assert wait_for(lambda: stop.received is not None)
        assert (stop.received, stop.name, stop.meaning) == (signal.SIGUSR1, "SIGUSR1", "a time limit")
        assert calls == []  # the handler of before did not run while inside
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: calls == [signal.SIGUSR1])  # and runs again after
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_signal_during_start_up_reaches_the_run_entered_after_it():
    """train.py listens from the start: a signal before run() enters its own StopSignal is not lost."""
    previous = signal.getsignal(signal.SIGUSR1)
    with StopSignal() as start_up:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_for(lambda: start_up.received is not None)
        with StopSignal() as run:
            assert run.received == signal.SIGUSR1
        with StopSignal() as later:  # each run under the same listener sees it
            assert later.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == previous
    with StopSignal() as fresh:
        assert fresh.received is None


def test_outside_the_main_thread_nothing_is_installed():
    before, seen = signal.getsignal(signal.SIGUSR1), []

    def enter():
        with StopSignal() as stop:
            seen.append(signal.getsignal(signal.SIGUSR1))
        seen.append(stop.received)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [before, None]
