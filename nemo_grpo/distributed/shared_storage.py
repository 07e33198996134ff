"""Is a directory the driver writes one that every Ray node sees? (checkpointing.checkpoint_dir: each policy rank
writes its shards there, and the driver reads them all back.)

A per-node directory (/tmp, a node's local disk) works on one node and breaks a multi-node run at its first
checkpoint. `check_shared_directory(path, key)` finds out before any worker starts: the driver writes a marker
file there, a tiny Ray task on every alive node looks for it, and nodes that cannot see it make a ConfigError
naming the key, the path and the nodes, with the remedy. On a one-node Ray cluster there is nothing to check.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from typing import Optional

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from nemo_grpo.distributed.resource_plan import node_name
from nemo_grpo.errors import ConfigError

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 120.0  # a Ray worker process starts on every node for the probe
LOOK_TRIES, LOOK_WAIT_S = 3, 1.0  # a lazily consistent shared filesystem gets a couple of seconds


def _sees(path: str) -> bool:
    """On the node it runs on: does `path` exist (looked up LOOK_TRIES times, LOOK_WAIT_S apart)?"""
    for attempt in range(LOOK_TRIES):
        if os.path.exists(path):
            return True
        if attempt + 1 < LOOK_TRIES:
            time.sleep(LOOK_WAIT_S)
    return False


def blind_nodes(nodes: list[dict], answers: dict[str, Optional[bool]]) -> tuple[list[dict], list[dict]]:
    """Of the alive ones of Ray's node records, (those that answered that they cannot see the marker, those that
    did not answer: absent or None in `answers`, {node id: sees it})."""
    alive = [n for n in nodes if n.get("Alive")]
    blind = [n for n in alive if answers.get(n["NodeID"]) is False]
    silent = [n for n in alive if answers.get(n["NodeID"]) is None]
    return blind, silent


def unshared_directory_message(key: str, path: str, blind: list[dict], num_nodes: int) -> str:
    """The one-line error for `blind` nodes (of num_nodes) that cannot see directory `path` (config key `key`)."""
    names = ", ".join(node_name(n) for n in blind)
    return (f"config key '{key}': {path} is not visible from {len(blind)} of the Ray cluster's {num_nodes} nodes "
            f"({names}): every node writes and reads it, so it must be a directory on a filesystem shared by "
            "every node (e.g. under a network home or project directory), not a node's own disk such as /tmp")


def _ask_nodes(nodes: list[dict], marker: str, timeout_s: float) -> dict[str, Optional[bool]]:
    """{node id: whether the node sees `marker`; None where the probe failed or did not answer in time}."""
    probe = ray.remote(_sees)
    refs = {n["NodeID"]: probe.options(num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(marker) for n in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    answers: dict[str, Optional[bool]] = {}
    for node_id, ref in refs.items():
        try:
            answers[node_id] = bool(ray.get(ref)) if ref in ready else None
        except Exception as e:  # noqa: BLE001 -- a node that cannot run the probe is reported, not fatal
            log.debug("shared-directory probe on node %s failed: %s", node_id, e)
            answers[node_id] = None
    return answers


def check_shared_directory(path: str, key: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """ConfigError naming `key`, the path and the nodes unless every alive Ray node sees directory `path` (which
    exists here). Ray must be running; a one-node cluster passes unchecked. Nodes whose probe fails or does not
    answer within timeout_s are logged as a warning, not an error."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) < 2:
        return
    path = os.path.abspath(path)
    marker = os.path.join(path, f".nemo_grpo_shared_{uuid.uuid4().hex}")
    with open(marker, "w"):
        pass
    try:
        answers = _ask_nodes(nodes, marker, timeout_s)
    finally:
        os.remove(marker)
    blind, silent = blind_nodes(nodes, answers)
    if silent:
        log.warning("%s: could not check that %s is visible from %s (no answer within %.0f s)", key, path,
                    ", ".join(node_name(n) for n in silent), timeout_s)
    if blind:
        raise ConfigError(unshared_directory_message(key, path, blind, len(nodes)))
