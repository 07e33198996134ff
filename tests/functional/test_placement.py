"""Placement of the resource plan: Ray placement groups whose bundles land on the planned nodes.

Simulated nodes: several raylets on this machine (`ray.cluster_utils.Cluster`), each with 8 logical GPUs.
Each scenario runs in a subprocess (this file run as a script) with a Ray cluster of its own, so the test
session's shared Ray cluster (the `ray_cluster` fixture) is neither used nor disturbed.
"""

import os
import subprocess
import sys
import time

import pytest

GPUS_PER_NODE = 8
CPUS_PER_NODE = 9  # a CPU per bundle (8) and one spare for the WorkerGroup's port probe
SCENARIO_TIMEOUT_S = 150


@pytest.mark.parametrize("scenario", ["one_node", "four_nodes"])
def test_bundles_land_on_the_planned_nodes(scenario):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(OMP_NUM_THREADS="1", RAY_AUTH_MODE="disabled", PYTHONWARNINGS="ignore")
    result = subprocess.run([sys.executable, __file__, scenario], env=env, capture_output=True, text=True,
                            timeout=SCENARIO_TIMEOUT_S)
    assert result.returncode == 0, f"{scenario} failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    assert f"{scenario}: ok" in result.stdout


# ----------------------------------------------------------------------------------------------- in the subprocess
def _config(*overrides):
    from omegaconf import OmegaConf

    from nemo_grpo.config import MasterConfig

    merged = OmegaConf.merge(OmegaConf.structured(MasterConfig), OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_object(merged)


def _bundle_node_ids(group) -> list[str]:
    import ray

    by_index = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return [by_index[i] for i in range(group.bundle_count)]


def _check_landing(plan, groups, planned_node_ids) -> None:
    """Every bundle of every role on the Ray node of its planned node index."""
    assert set(groups) == set(plan.placements)
    for role, placement in plan.placements.items():
        expected = [planned_node_ids[node] for node in placement.bundle_nodes()]
        assert _bundle_node_ids(groups[role]) == expected, role
        assert groups[role].bundle_specs[0] == {"GPU": 1.0, "CPU": 1.0}


class NodeReporter:
    """A WorkerGroup worker that only says where it runs."""

    def where(self):
        import ray

        return ray.get_runtime_context().get_node_id(), os.environ["RANK"], os.environ["LOCAL_RANK"]


def _check_worker_group_on_reserved_group(plan, groups, node_id) -> None:
    """A WorkerGroup started in a reserved placement group uses its bundles and leaves it in place."""
    import ray

    from nemo_grpo.distributed.worker_group import WorkerGroup

    placement = plan.placements["generation"]
    workers = WorkerGroup(NodeReporter, placement.as_cluster(), name="generation",
                          placement_group=groups["generation"])
    assert workers.use_gpus and workers.world_size == placement.world_size
    assert workers.run_all("where") == [(node_id, str(r), str(r)) for r in range(placement.world_size)]
    workers.shutdown()
    assert ray.util.placement_group_table(groups["generation"])["state"] == "CREATED"


def _check_impossible_reservations(resource_plan, node_id) -> None:
    """Too few nodes, too few devices on a node: one-line UserInputErrors naming the key, the numbers and the node,
    before any placement group is made."""
    import ray

    from nemo_grpo.errors import UserInputError

    node = next(n for n in ray.nodes() if n["NodeID"] == node_id)
    too_many_nodes = resource_plan.plan_resources(_config("cluster.num_nodes=2", "cluster.gpus_per_node=8"))
    try:
        resource_plan.reserve(too_many_nodes)
        raise AssertionError("reserved 2 nodes on a 1-node Ray cluster")
    except UserInputError as e:
        assert str(e) == (f"config key 'cluster.num_nodes': 2, but the Ray cluster has 1 alive node with GPUs "
                          f"({resource_plan.node_name(node)}): set cluster.num_nodes=1 or start Ray on 2 nodes"), e
    too_many_gpus = resource_plan.plan_resources(_config("cluster.gpus_per_node=16", "env.reward_model.enabled=true",
                                                         "env.reward_model.resources.gpus_per_node=4"))
    try:
        resource_plan.reserve(too_many_gpus)
        raise AssertionError("reserved 16 GPUs on an 8-GPU node")
    except UserInputError as e:
        assert str(e).startswith(f"config key 'cluster.gpus_per_node': 16, but planned node 0, "
                                 f"{resource_plan.node_name(node)}, has 8 GPUs: set cluster.gpus_per_node=8"), e
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())  # none made


def run_one_node() -> None:
    """1 node x 8 GPUs: colocated (policy 4 + reward model 4), non-colocated (2 + 2 generation + 4)."""
    import ray
    from ray.cluster_utils import Cluster

    from nemo_grpo.distributed import resource_plan

    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE))
    ray.init(address=cluster.address)
    try:
        node_id = resource_plan.ordered_node_ids()[0]
        colocated = resource_plan.plan_resources(_config("cluster.gpus_per_node=8", "env.reward_model.enabled=true",
                                                         "env.reward_model.resources.gpus_per_node=4"))
        groups = resource_plan.reserve(colocated)
        _check_landing(colocated, groups, [node_id])
        try:  # every GPU is taken now: the next reservation times out with what Ray has left
            resource_plan.reserve(colocated, timeout_s=2)
            raise AssertionError("reserved 16 GPUs on an 8-GPU node")
        except RuntimeError as e:
            assert "not ready within 2s" in str(e) and "available" in str(e), e
        resource_plan.release(groups)
        non_colocated = resource_plan.plan_resources(_config(
            "cluster.gpus_per_node=8", "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.gpus_per_node=2", "env.reward_model.enabled=true",
            "env.reward_model.resources.gpus_per_node=4"))
        groups = resource_plan.reserve(non_colocated)
        _check_landing(non_colocated, groups, [node_id])
        _check_worker_group_on_reserved_group(non_colocated, groups, node_id)
        resource_plan.release(groups)
        assert ray.util.placement_group_table(groups["policy"])["state"] == "REMOVED"
        groups = resource_plan.reserve(colocated, cpu_only=True)  # worker processes standing in for GPUs
        assert [g.bundle_specs for g in groups.values()] == [[{"CPU": 1.0}] * 4] * 2
        assert {n for g in groups.values() for n in _bundle_node_ids(g)} == {node_id}
        resource_plan.release(groups)
        _check_impossible_reservations(resource_plan, node_id)
    finally:
        ray.shutdown()
        cluster.shutdown()


def run_four_nodes() -> None:
    """4 nodes x 8 GPUs, generation and reward model 1 node each: policy on nodes 0-1, generation 2, rm 3.

    Each raylet has a `node_index:<k>` resource in an order unlike the start order (the head is node 2), so
    the expected Ray node of each planned node is known independently of the ordering code.
    """
    import ray
    from ray.cluster_utils import Cluster

    from nemo_grpo.distributed import resource_plan

    start_order = [2, 0, 3, 1]  # node_index of the head, then of the nodes added after it
    node_args = [dict(num_cpus=CPUS_PER_NODE, num_gpus=GPUS_PER_NODE, resources={f"node_index:{k}": 1})
                 for k in start_order]
    cluster = Cluster(initialize_head=True, head_node_args=node_args[0])
    for args in node_args[1:]:
        cluster.add_node(**args)
    ray.init(address=cluster.address)
    try:
        cluster.wait_for_nodes()
        by_index = {k: n["NodeID"] for n in ray.nodes() if n["Alive"] for k in range(4)
                    if f"node_index:{k}" in n["Resources"]}
        planned_node_ids = [by_index[k] for k in range(4)]
        assert resource_plan.ordered_node_ids() == planned_node_ids
        plan = resource_plan.plan_resources(_config(
            "cluster.gpus_per_node=8", "cluster.num_nodes=4", "policy.generation.colocated.enabled=false",
            "policy.generation.colocated.resources.num_nodes=1", "env.reward_model.enabled=true",
            "env.reward_model.resources.num_nodes=1", "env.reward_model.resources.gpus_per_node=null"))
        assert plan.describe().splitlines() == ["policy: nodes 0-1 x 8 GPUs = 16", "generation: nodes 2 x 8 GPUs = 8",
                                                "reward_model: nodes 3 x 8 GPUs = 8",
                                                "generation engine: 8 replicas of TP 1, 8 per node on nodes 2"]
        groups = resource_plan.reserve(plan)
        _check_landing(plan, groups, planned_node_ids)
        resource_plan.release(groups)
        _check_cluster_wide_input(resource_plan)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _check_cluster_wide_input(resource_plan) -> None:
    """On 4 nodes: a plan for 2 is refused (more nodes than cluster.num_nodes); a directory every node sees
    passes the shared-directory check, which leaves nothing in it."""
    import tempfile

    import ray

    from nemo_grpo.distributed import shared_storage
    from nemo_grpo.distributed.shared_storage import check_shared_directory
    from nemo_grpo.errors import UserInputError

    two_nodes = resource_plan.plan_resources(_config("cluster.gpus_per_node=8", "cluster.num_nodes=2"))
    try:
        resource_plan.reserve(two_nodes)
        raise AssertionError("reserved 2 of 4 nodes")
    except UserInputError as e:
        assert str(e).startswith("config key 'cluster.num_nodes': 2, but the Ray cluster has 4 alive nodes with "
                                 "GPUs ("), e
        assert str(e).endswith("): set cluster.num_nodes=4 or start Ray on 2 nodes"), e
    with tempfile.TemporaryDirectory() as shared:  # the raylets share this machine's filesystem
        check_shared_directory(shared, "checkpointing.checkpoint_dir")
        assert os.listdir(shared) == []
        nodes = [n for n in ray.nodes() if n["Alive"]]  # the probe answers on every node, both ways
        assert set(shared_storage._ask_nodes(nodes, shared, 60).values()) == {True}
        assert shared_storage._ask_nodes(nodes, os.path.join(shared, "absent"), 60) == {
            n["NodeID"]: False for n in nodes}


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    started = time.time()
    {"one_node": run_one_node, "four_nodes": run_four_nodes}[sys.argv[1]]()
    print(f"{sys.argv[1]}: ok in {time.time() - started:.1f}s")
