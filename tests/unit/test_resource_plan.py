"""The resource plan (nemo_grpo/distributed/resource_plan.py): the seed's three layouts and impossible plans.

Configs are merged onto the schema without `validate()`: the plan is checked on its own (validation also
wants, e.g., the reward model's directory to exist).
"""

import pytest
from omegaconf import OmegaConf

from nemo_grpo.config import ConfigError, MasterConfig
from nemo_grpo.validation import load_config
from nemo_grpo.distributed.resource_plan import Placement, plan_resources

ONE_NODE = ["cluster.gpus_per_node=8", "cluster.num_nodes=1"]
FOUR_NODES = ["cluster.gpus_per_node=8", "cluster.num_nodes=4"]
NON_COLOCATED = ["policy.generation.colocated.enabled=false"]


def config(*overrides) -> MasterConfig:
    dotlist = [item for group in overrides for item in group]
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MasterConfig), OmegaConf.from_dotlist(dotlist)))


def test_one_node_colocated_policy_4_reward_model_4():
    plan = plan_resources(config(ONE_NODE, ["env.reward_model.resources.gpus_per_node=4"]))
    assert plan.placements == {"policy": Placement("policy", (0,), 4),
                               "reward_model": Placement("reward_model", (0,), 4)}
    assert plan.colocated_generation and plan.placement_of("generation") is plan.placements["policy"]
    assert plan.gpus_on_node(0) == {"policy": 4, "reward_model": 4}
    assert plan.describe() == ("policy: nodes 0 x 4 GPUs = 4 (colocated with generation)\n"
                               "reward_model: nodes 0 x 4 GPUs = 4\n"
                               "generation engine: 4 replicas of TP 1, 4 per node on nodes 0")


def test_one_node_non_colocated_policy_2_generation_2_reward_model_4():
    plan = plan_resources(config(ONE_NODE, NON_COLOCATED, ["policy.generation.colocated.resources.gpus_per_node=2",
                                                           "env.reward_model.resources.gpus_per_node=4"]))
    assert plan.placements == {"policy": Placement("policy", (0,), 2),
                               "generation": Placement("generation", (0,), 2),
                               "reward_model": Placement("reward_model", (0,), 4)}
    assert not plan.colocated_generation
    assert [p.world_size for p in plan.placements.values()] == [2, 2, 4]
    assert plan.describe() == ("policy: nodes 0 x 2 GPUs = 2\ngeneration: nodes 0 x 2 GPUs = 2\n"
                               "reward_model: nodes 0 x 4 GPUs = 4\n"
                               "generation engine: 2 replicas of TP 1, 2 per node on nodes 0")


def test_several_nodes_generation_and_reward_model_get_their_own_nodes():
    plan = plan_resources(config(FOUR_NODES, NON_COLOCATED, ["policy.generation.colocated.resources.num_nodes=1",
                                                             "env.reward_model.resources.num_nodes=1",
                                                             "env.reward_model.resources.gpus_per_node=null"]))
    assert plan.placements == {"policy": Placement("policy", (0, 1), 8),
                               "generation": Placement("generation", (2,), 8),
                               "reward_model": Placement("reward_model", (3,), 8)}
    assert plan.placements["policy"].world_size == 16 and plan.num_nodes == 4
    assert plan.placements["policy"].bundle_nodes() == [0] * 8 + [1] * 8
    assert plan.describe().splitlines()[0] == "policy: nodes 0-1 x 8 GPUs = 16"
    assert plan.describe().splitlines()[-1] == "generation engine: 8 replicas of TP 1, 8 per node on nodes 2"
    assert plan.gpus_on_node(3) == {"reward_model": 8}


def test_several_nodes_reward_model_uses_its_gpus_per_node_of_a_whole_node():
    plan = plan_resources(config(FOUR_NODES, ["env.reward_model.resources.num_nodes=2",
                                              "env.reward_model.resources.gpus_per_node=4"]))
    assert plan.placements == {"policy": Placement("policy", (0, 1), 8),
                               "reward_model": Placement("reward_model", (2, 3), 4)}


def test_without_reward_model_the_policy_gets_everything():
    plan = plan_resources(load_config(None, FOUR_NODES + ["policy.train_micro_batch_size=4"]))  # a validated one
    assert plan.placements == {"policy": Placement("policy", (0, 1, 2, 3), 8)}
    disabled = plan_resources(config(ONE_NODE, ["env.reward_model.enabled=false"]))
    assert disabled.placements == {"policy": Placement("policy", (0,), 8)}
    cluster = disabled.placements["policy"].as_cluster(num_threads_per_worker=2)
    assert (cluster.gpus_per_node, cluster.num_nodes, cluster.num_threads_per_worker) == (8, 1, 2)


def test_an_in_cluster_llm_judge_gets_devices_of_its_own_an_http_one_none():
    judge = ["env.llm_judge.model_name=/judge"]
    plan = plan_resources(config(ONE_NODE, judge, ["env.llm_judge.resources.gpus_per_node=2",
                                                   "env.llm_judge.generation.vllm_cfg.tensor_parallel_size=2"]))
    assert plan.placements == {"policy": Placement("policy", (0,), 6), "llm_judge": Placement("llm_judge", (0,), 2)}
    assert plan.describe().splitlines()[1] == "llm_judge: nodes 0 x 2 GPUs = 2"
    plan = plan_resources(config(FOUR_NODES, judge, ["env.reward_model.resources.num_nodes=1",
                                                     "env.llm_judge.resources.num_nodes=1",
                                                     "env.llm_judge.resources.gpus_per_node=null"]))
    assert plan.placements == {"policy": Placement("policy", (0, 1), 8),
                               "reward_model": Placement("reward_model", (2,), 1),
                               "llm_judge": Placement("llm_judge", (3,), 8)}
    http = plan_resources(config(ONE_NODE, ["env.llm_judge.base_url=http://127.0.0.1:8000/v1"]))
    assert http.placements == {"policy": Placement("policy", (0,), 8)}
    assert _plan_error(ONE_NODE, judge, ["env.llm_judge.resources.gpus_per_node=3",
                                         "env.llm_judge.generation.vllm_cfg.tensor_parallel_size=2"]) == (
        "config key 'env.llm_judge.generation.vllm_cfg.tensor_parallel_size': 2 does not divide the 3 devices per "
        "node of the LLM judge's (env.llm_judge.resources): each engine replica runs on one node, 3 / 2 replicas per "
        "node; use a divisor of 3")
    assert _plan_error(ONE_NODE, judge, ["env.llm_judge.resources.gpus_per_node=8"]) == (
        "config key 'env.llm_judge.resources.gpus_per_node': cluster.gpus_per_node 8 - LLM judge 8 = 0 GPUs left for "
        "the policy (needs >= 1)")


def test_the_math_judge_fallbacks_in_cluster_judge_gets_devices_with_no_data_set_naming_llm_judge():
    plan = plan_resources(config(ONE_NODE, ["data.train.env_name=math", "data.validation.env_name=math",
                                            "env.math.judge_fallback=true", "env.llm_judge.mode=equivalence",
                                            "env.llm_judge.model_name=/judge"]))
    assert plan.placements == {"policy": Placement("policy", (0,), 7), "llm_judge": Placement("llm_judge", (0,), 1)}


def _plan_error(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        plan_resources(config(*overrides))
    return str(info.value)


def test_one_node_with_nothing_left_for_the_policy_shows_the_arithmetic():
    msg = _plan_error(ONE_NODE, NON_COLOCATED, ["policy.generation.colocated.resources.gpus_per_node=6",
                                                "env.reward_model.resources.gpus_per_node=4"])
    assert msg == ("config key 'env.reward_model.resources.gpus_per_node': cluster.gpus_per_node 8 - "
                   "generation 6 - reward model 4 = -2 GPUs left for the policy (needs >= 1)")


def test_one_node_reward_model_taking_every_gpu():
    msg = _plan_error(ONE_NODE, ["env.reward_model.resources.gpus_per_node=8"])
    assert "'env.reward_model.resources.gpus_per_node'" in msg
    assert "cluster.gpus_per_node 8 - reward model 8 = 0 GPUs left for the policy" in msg


def test_several_nodes_with_no_node_left_for_the_policy():
    msg = _plan_error(FOUR_NODES, NON_COLOCATED, ["policy.generation.colocated.resources.num_nodes=2",
                                                  "env.reward_model.resources.num_nodes=2"])
    assert msg == ("config key 'env.reward_model.resources.num_nodes': cluster.num_nodes 4 - generation 2 - "
                   "reward model 2 = 0 nodes left for the policy (needs >= 1)")


def test_non_colocated_generation_without_resources_says_which_key_to_set():
    # no resources at all: a separate engine that reserves no devices (a CPU cluster; refit.py rejects it on GPUs)
    plan = plan_resources(config(ONE_NODE, NON_COLOCATED))
    assert "generation" not in plan.placements
    assert sum(p.world_size for p in plan.placements.values()) == 8  # the policy gets the rest
    msg = _plan_error(FOUR_NODES, NON_COLOCATED, ["policy.generation.colocated.resources.gpus_per_node=8"])
    assert "set policy.generation.colocated.resources.num_nodes" in msg and "cluster.num_nodes 4" in msg


def test_reward_model_gpus_per_node_above_the_nodes_gpus():
    msg = _plan_error(FOUR_NODES, ["env.reward_model.resources.gpus_per_node=16"])
    assert msg == ("config key 'env.reward_model.resources.gpus_per_node': reward model 16 GPUs per node > "
                   "cluster.gpus_per_node 8")


def test_one_node_reward_model_asking_for_more_nodes():
    msg = _plan_error(ONE_NODE, ["env.reward_model.resources.num_nodes=2"])
    assert msg == ("config key 'env.reward_model.resources.num_nodes': 2 nodes for the reward model > "
                   "cluster.num_nodes 1")


@pytest.mark.parametrize("key", ["env.reward_model.resources.gpus_per_node", "env.reward_model.resources.num_nodes"])
def test_non_positive_resources(key):
    msg = _plan_error(ONE_NODE, [f"{key}=0"])
    assert msg == f"config key '{key}': must be > 0, got 0"


def test_non_positive_cluster_is_rejected_by_the_plan_too():
    cfg = config(ONE_NODE)
    cfg.cluster.gpus_per_node = -1  # (validation rejects it first; the plan does not rely on that)
    with pytest.raises(ConfigError, match=r"'cluster.gpus_per_node': must be > 0, got -1"):
        plan_resources(cfg)


# ----------------------------------------------------------------------------------------------- engine replicas
TP = "policy.generation.vllm_cfg.tensor_parallel_size"


def test_colocated_replicas_one_per_device_at_tp_1():
    plan = plan_resources(config(["cluster.gpus_per_node=2", "cluster.num_nodes=1"]))
    assert plan.generation_tp == 1 and plan.generation_replicas() == [0, 0]


def test_colocated_replicas_tp_4_on_two_nodes():
    plan = plan_resources(config(["cluster.gpus_per_node=8", "cluster.num_nodes=2", f"{TP}=4"]))
    assert plan.generation_replicas() == [0, 0, 1, 1]
    assert plan.describe_replicas() == "generation engine: 4 replicas of TP 4, 2 per node on nodes 0-1"


def test_non_colocated_replicas_run_on_generations_own_node():
    plan = plan_resources(config(["cluster.gpus_per_node=8", "cluster.num_nodes=3", f"{TP}=2"], NON_COLOCATED,
                                 ["policy.generation.colocated.resources.num_nodes=1",
                                  "policy.generation.colocated.resources.gpus_per_node=8"]))
    assert plan.placements["generation"].nodes == (2,)  # after the policy's nodes 0-1
    assert plan.generation_replicas() == [2] * 4  # 8 devices / TP 2


def test_non_colocated_without_resources_is_one_replica_anywhere():
    plan = plan_resources(config(ONE_NODE, NON_COLOCATED, [f"{TP}=3"]))  # no devices: nothing to divide
    assert plan.generation_replicas() == [None]
    assert plan.describe().splitlines()[-1] == ("generation engine: 1 replica, on an actor without devices "
                                                "(generation's resources unset)")


def test_num_replicas_keeps_the_first_replicas_node_by_node():
    plan = plan_resources(config(["cluster.gpus_per_node=2", "cluster.num_nodes=2",
                                  "policy.generation.num_replicas=3"]))
    assert plan.generation_replicas() == [0, 0, 1]
    assert plan.describe_replicas() == ("generation engine: 3 replicas of TP 1, 2/1 per node on nodes 0-1 "
                                        "(policy.generation.num_replicas 3 of 4)")
    one = plan_resources(config(["cluster.gpus_per_node=2", "cluster.num_nodes=1", "policy.generation.num_replicas=1"]))
    assert one.generation_replicas() == [0]
    assert one.describe_replicas() == ("generation engine: 1 replica of TP 1, 1 per node on nodes 0 "
                                       "(policy.generation.num_replicas 1 of 2)")
    key = "config key 'policy.generation.num_replicas'"
    assert _plan_error(ONE_NODE, ["policy.generation.num_replicas=9"]) == (
        f"{key}: 9 > the 8 replicas that generation's devices hold (one per {TP} devices)")
    assert _plan_error(ONE_NODE, ["policy.generation.num_replicas=0"]) == f"{key}: must be > 0, got 0"
    assert _plan_error(ONE_NODE, NON_COLOCATED, ["policy.generation.num_replicas=2"]).startswith(
        f"{key}: 2, but a separate engine without devices of its own")


def test_tp_that_does_not_divide_a_nodes_devices():
    msg = _plan_error(ONE_NODE, [f"{TP}=3"])
    assert msg.startswith(f"config key '{TP}': 3 does not divide the 8 devices per node of the policy's")
    assert "8 / 3 replicas per node; use a divisor of 8" in msg
    assert _plan_error(ONE_NODE, [f"{TP}=0"]) == f"config key '{TP}': must be > 0, got 0"


def _ray_node(node_id, *resources, alive=True, gpus=8):
    return {"NodeID": node_id, "Alive": alive,
            "Resources": {"CPU": 9.0, "GPU": float(gpus), **dict.fromkeys(resources, 1.0)}}


def test_node_order_is_node_index_then_head_then_node_id():
    from nemo_grpo.distributed.resource_plan import order_nodes

    nodes = [_ray_node("cc"), _ray_node("aa"), _ray_node("ff", "node:__internal_head__"), _ray_node("bb", alive=False),
             _ray_node("00", gpus=0)]
    assert order_nodes(nodes) == ["ff", "aa", "cc"]  # head first; no dead node, no node without GPUs
    assert order_nodes(nodes, "CPU") == ["ff", "00", "aa", "cc"]
    nodes[0]["Resources"]["node_index:0"] = 1.0
    nodes[1]["Resources"]["node_index:1"] = 1.0
    assert order_nodes(nodes) == ["cc", "aa", "ff"]  # node_index:<k> before the nodes without one


# ----------------------------------------------------------------------------------------------- plan vs cluster
def _host(name, ip, *resources, gpus=8, cpus=9.0, alive=True):
    """A ray.nodes() record of host `name` at `ip`."""
    return {"NodeID": f"id-{name}", "Alive": alive, "NodeManagerHostname": name, "NodeManagerAddress": ip,
            "Resources": {"CPU": cpus, "GPU": float(gpus), **dict.fromkeys(resources, 1.0)}}


TWO_NODES = ["cluster.gpus_per_node=8", "cluster.num_nodes=2"]


def _capacity_error(plan, nodes, device="GPU") -> str:
    from nemo_grpo.distributed.resource_plan import check_capacity

    with pytest.raises(ConfigError) as info:  # a UserInputError: one line on stderr, exit 2
        check_capacity(plan, nodes, device)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_plans_nodes_on_a_cluster_that_fits():
    from nemo_grpo.distributed.resource_plan import check_capacity

    plan = plan_resources(config(TWO_NODES))
    nodes = [_host("n2", "10.0.0.2"), _host("n1", "10.0.0.1", "node:__internal_head__"),
             _host("n3", "10.0.0.3", alive=False), _host("login", "10.0.0.9", gpus=0)]
    assert plan.gpus_per_node == 8
    assert check_capacity(plan, nodes) == ["id-n1", "id-n2"]  # no dead node, no node without GPUs
    cpu_plan = plan_resources(config(["cluster.gpus_per_node=4", "cluster.num_nodes=1"]))
    assert check_capacity(cpu_plan, [_host("laptop", "127.0.0.1", gpus=0, cpus=8.0)], "CPU") == ["id-laptop"]


def test_fewer_nodes_than_cluster_num_nodes():
    msg = _capacity_error(plan_resources(config(TWO_NODES)), [_host("n1", "10.0.0.1")])
    assert msg == ("config key 'cluster.num_nodes': 2, but the Ray cluster has 1 alive node with GPUs "
                   "(n1 (10.0.0.1)): set cluster.num_nodes=1 or start Ray on 2 nodes")


def test_more_nodes_than_cluster_num_nodes():
    nodes = [_host("n1", "10.0.0.1"), _host("n2", "10.0.0.2"), _host("n3", "10.0.0.3")]
    msg = _capacity_error(plan_resources(config(TWO_NODES)), nodes)
    assert msg == ("config key 'cluster.num_nodes': 2, but the Ray cluster has 3 alive nodes with GPUs "
                   "(n1 (10.0.0.1), n2 (10.0.0.2), n3 (10.0.0.3)): set cluster.num_nodes=3 or start Ray on 2 nodes")


def test_a_node_with_fewer_gpus_than_cluster_gpus_per_node():
    nodes = [_host("n1", "10.0.0.1", "node_index:0"), _host("n2", "10.0.0.2", "node_index:1", gpus=4)]
    msg = _capacity_error(plan_resources(config(TWO_NODES)), nodes)
    assert msg == ("config key 'cluster.gpus_per_node': 8, but planned node 1, n2 (10.0.0.2), has 4 GPUs: set "
                   "cluster.gpus_per_node=4 or start Ray with 8 GPUs on every node")


def test_a_reward_model_node_short_of_devices_is_named_by_cluster_gpus_per_node():
    # the reward model uses 4 of its node's devices; the node must still have cluster.gpus_per_node of them
    plan = plan_resources(config(TWO_NODES, ["env.reward_model.resources.num_nodes=1",
                                             "env.reward_model.resources.gpus_per_node=4"]))
    msg = _capacity_error(plan, [_host("n1", "10.0.0.1", "node_index:0"), _host("n2", "10.0.0.2", gpus=4)])
    assert msg.startswith("config key 'cluster.gpus_per_node': 8, but planned node 1, n2 (10.0.0.2), has 4 GPUs")


def test_a_cpu_only_node_with_fewer_cpu_slots_than_ranks():
    plan = plan_resources(config(["cluster.gpus_per_node=16", "cluster.num_nodes=1"]))
    msg = _capacity_error(plan, [_host("laptop", "127.0.0.1", gpus=0, cpus=8.0)], "CPU")
    assert msg == ("config key 'cluster.gpus_per_node': 16, but planned node 0, laptop (127.0.0.1), has 8 CPUs: "
                   "set cluster.gpus_per_node=8 or start Ray with 16 CPUs on every node (ray start --num-cpus=16: "
                   "on a CPU-only cluster each rank takes a CPU slot)")


def test_node_names():
    from nemo_grpo.distributed.resource_plan import node_name

    assert node_name(_host("n1", "10.0.0.1")) == "n1 (10.0.0.1)"
    assert node_name(_host("127.0.0.1", "127.0.0.1")) == "127.0.0.1"
    assert node_name({"NodeID": "ab12"}) == "ab12"


# ----------------------------------------------------------------------------------------------- shared directory
def test_nodes_that_cannot_see_the_directory_and_nodes_that_did_not_answer():
    from nemo_grpo.distributed.shared_storage import blind_nodes

    nodes = [_host("n1", "10.0.0.1"), _host("n2", "10.0.0.2"), _host("n3", "10.0.0.3"), _host("n4", "10.0.0.4"),
             _host("n5", "10.0.0.5", alive=False)]
    blind, silent = blind_nodes(nodes, {"id-n1": True, "id-n2": False, "id-n3": None})
    assert [n["NodeID"] for n in blind] == ["id-n2"]
    assert [n["NodeID"] for n in silent] == ["id-n3", "id-n4"]  # failed, or absent; the dead node is not asked
    assert blind_nodes(nodes[:2], {"id-n1": True, "id-n2": True}) == ([], [])


def test_the_unshared_directory_message():
    from nemo_grpo.distributed.shared_storage import unshared_directory_message

    msg = unshared_directory_message("checkpointing.checkpoint_dir", "/tmp/ckpt",
                                     [_host("n2", "10.0.0.2"), _host("n3", "10.0.0.3")], 3)
    assert msg == ("config key 'checkpointing.checkpoint_dir': /tmp/ckpt is not visible from 2 of the Ray "
                   "cluster's 3 nodes (n2 (10.0.0.2), n3 (10.0.0.3)): every node writes and reads it, so it must be "
                   "a directory on a filesystem shared by every node (e.g. under a network home or project "
                   "directory), not a node's own disk such as /tmp")
