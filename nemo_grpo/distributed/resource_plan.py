"""Which devices each role gets: a pure function of the config (`plan_resources`), then Ray placement groups.

One node (cluster.num_nodes 1): the node's cluster.gpus_per_node devices are split. The reward model takes
env.reward_model.resources.gpus_per_node, non-colocated generation policy.generation.colocated.resources
.gpus_per_node, the policy the rest (colocated generation shares the policy's devices).
Several nodes: the reward model and non-colocated generation get whole nodes of their own (their
resources.num_nodes, using resources.gpus_per_node of each, default all); the other nodes train the policy.
Node indices: the policy first (0..p-1, so policy rank 0 is on node 0), then generation, then the reward model,
then an LLM judge that runs in the cluster (env.llm_judge.resources, taken as the reward model's are), whichever
environment asks it (a data set's llm_judge, or math with env.math.judge_fallback).
The generation engine runs as data-parallel replicas of policy.generation.vllm_cfg.tensor_parallel_size devices
each, one replica per TP group of every generation device (colocated: the policy's; else generation's own), each
replica within one node (`ResourcePlan.generation_replicas`); policy.generation.num_replicas keeps the first N.

`reserve(plan)` makes one placement group per role, one bundle per device, each bundle pinned to its planned
node with a per-bundle label selector on Ray's node-id label. The planned node index i is the i-th alive
Ray node in `ordered_node_ids()` order: nodes with a custom resource `node_index:<k>` by k first, then the
head node, then the others by node id (hex); only nodes that have the bundles' device resource count.
Before reserving, `check_capacity` holds the plan against the cluster: exactly cluster.num_nodes such nodes, each
with cluster.gpus_per_node devices (CPU slots on a CPU-only cluster), else a ConfigError naming the key and nodes.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Optional

from nemo_grpo.config import ClusterConfig, ConfigError, MasterConfig

log = logging.getLogger(__name__)

ROLES = ("policy", "generation", "reward_model", "llm_judge")
NODE_INDEX_RESOURCE_PREFIX = "node_index:"
NODE_ID_LABEL = "ray.io/node-id"
HEAD_NODE_RESOURCE = "node:__internal_head__"
RESERVE_TIMEOUT_S = 120.0

RM_KEY = "env.reward_model.resources"
JUDGE_KEY = "env.llm_judge.resources"
JUDGE_TP_KEY = "env.llm_judge.generation.vllm_cfg.tensor_parallel_size"
GEN_KEY = "policy.generation.colocated.resources"
TP_KEY = "policy.generation.vllm_cfg.tensor_parallel_size"
REPLICAS_KEY = "policy.generation.num_replicas"


@dataclass(frozen=True)
class Placement:
    """One role's devices: `gpus_per_node` on each of `nodes` (planned node indices)."""
    role: str
    nodes: tuple[int, ...]
    gpus_per_node: int

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.gpus_per_node

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def bundle_nodes(self) -> list[int]:
        """The planned node of each bundle (rank), node by node."""
        return [node for node in self.nodes for _ in range(self.gpus_per_node)]

    def as_cluster(self, num_threads_per_worker: int = 1):
        """A ClusterConfig of this role's shape, e.g. for a WorkerGroup on the role's placement group."""
        return ClusterConfig(gpus_per_node=self.gpus_per_node, num_nodes=self.num_nodes,
                             num_threads_per_worker=num_threads_per_worker)


@dataclass(frozen=True)
class ResourcePlan:
    """Placements by role; "generation" only when it is not colocated with the policy."""
    placements: dict[str, Placement]
    colocated_generation: bool = True
    num_nodes: int = 1
    gpus_per_node: int = 0  # cluster.gpus_per_node: devices each planned node must have (0: what its roles use)
    generation_tp: int = 1  # policy.generation.vllm_cfg.tensor_parallel_size: the devices of one engine replica
    num_replicas: Optional[int] = None  # policy.generation.num_replicas: the first N replicas only (None: all)

    def placement_of(self, role: str) -> Placement:
        """The placement a role runs on (colocated generation: the policy's)."""
        if role == "generation" and self.colocated_generation:
            return self.placements["policy"]
        return self.placements[role]

    def gpus_on_node(self, node: int) -> dict[str, int]:
        """{role: devices the role uses on planned node `node`}."""
        return {role: p.gpus_per_node for role, p in self.placements.items() if node in p.nodes}

    def generation_replicas(self) -> list[Optional[int]]:
        """The planned node of each generation engine replica, node by node: gpus_per_node / generation_tp on
        each node of generation's placement (colocated: the policy's), the first num_replicas of them when set;
        [None] (one replica, anywhere) for a separate engine that reserves no devices."""
        if not self.colocated_generation and "generation" not in self.placements:
            return [None]
        return self._all_replicas()[: self.num_replicas]

    def _all_replicas(self) -> list[int]:
        p = self.placement_of("generation")
        return [node for node in p.nodes for _ in range(p.gpus_per_node // self.generation_tp)]  # (divides: planned)

    def describe(self) -> str:
        lines = []
        for role in ROLES:
            if role not in self.placements:
                continue
            p = self.placements[role]
            note = " (colocated with generation)" if role == "policy" and self.colocated_generation else ""
            lines.append(f"{role}: nodes {node_list(p.nodes)} x {p.gpus_per_node} GPUs = {p.world_size}{note}")
        lines.append(self.describe_replicas())
        return "\n".join(lines)

    def describe_replicas(self) -> str:
        """One line: the engine replicas, their TP, and how many each node runs."""
        replicas = self.generation_replicas()
        if replicas == [None]:
            return "generation engine: 1 replica, on an actor without devices (generation's resources unset)"
        nodes = tuple(dict.fromkeys(replicas))
        counts = [replicas.count(node) for node in nodes]
        per_node = str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))  # (uneven: "2/1")
        capped = (f" (policy.generation.num_replicas {len(replicas)} of {len(self._all_replicas())})"
                  if self.num_replicas is not None else "")
        return (f"generation engine: {counted(len(replicas), 'replica')} of TP {self.generation_tp}, "
                f"{per_node} per node on nodes {node_list(nodes)}{capped}")


def node_list(nodes: tuple[int, ...]) -> str:
    if len(nodes) > 1 and list(nodes) == list(range(nodes[0], nodes[-1] + 1)):
        return f"{nodes[0]}-{nodes[-1]}"
    return ",".join(map(str, nodes))


# ----------------------------------------------------------------------------------------------- planning
def _fail(key: str, msg: str) -> None:
    raise ConfigError(f"config key '{key}': {msg}")


def _positive(value: Optional[int], key: str) -> None:
    if value is not None and value <= 0:
        _fail(key, f"must be > 0, got {value}")


def _dedicated_roles(cfg: MasterConfig) -> list[tuple[str, str, str, object]]:
    """(role, config key, label, ResourcesConfig) of the roles with devices of their own, in node order."""
    roles = []
    gen = cfg.policy.generation.colocated
    # a separate engine without resources reserves no devices (a CPU cluster; on GPUs weights/refit.py
    # requires policy.generation.colocated.resources)
    if not gen.enabled and (gen.resources.gpus_per_node is not None or gen.resources.num_nodes is not None):
        roles.append(("generation", GEN_KEY, "generation", gen.resources))
    rm = cfg.env.reward_model
    if rm is not None and rm.active:
        roles.append(("reward_model", RM_KEY, "reward model", rm.resources))
    judge = cfg.env.llm_judge
    # set, it is asked (validation: by data.*.env_name llm_judge or by env.math.judge_fallback), so it gets devices
    if judge is not None and judge.in_cluster:
        roles.append(("llm_judge", JUDGE_KEY, "LLM judge", judge.resources))
    return roles


def plan_resources(cfg: MasterConfig) -> ResourcePlan:
    """The resource plan of a config (no Ray); ConfigError naming the key, with the arithmetic, if impossible."""
    c = cfg.cluster
    if c.gpus_per_node <= 0:
        _fail("cluster.gpus_per_node", f"must be > 0, got {c.gpus_per_node}")
    if c.num_nodes <= 0:
        _fail("cluster.num_nodes", f"must be > 0, got {c.num_nodes}")
    dedicated = _dedicated_roles(cfg)
    for _, key, _, res in dedicated:
        _positive(res.gpus_per_node, f"{key}.gpus_per_node")
        _positive(res.num_nodes, f"{key}.num_nodes")
    plan = _plan_one_node if c.num_nodes == 1 else _plan_nodes
    placements = plan(cfg, dedicated)
    resources = ResourcePlan(placements=placements, colocated_generation=cfg.policy.generation.colocated.enabled,
                             num_nodes=c.num_nodes, gpus_per_node=c.gpus_per_node,
                             generation_tp=cfg.policy.generation.vllm_cfg.tensor_parallel_size,
                             num_replicas=cfg.policy.generation.num_replicas)
    _check_replicas(resources)
    if "llm_judge" in placements:
        judge_tp = cfg.env.llm_judge.generation.vllm_cfg.tensor_parallel_size
        _positive(judge_tp, JUDGE_TP_KEY)
        replicas_per_node(placements["llm_judge"].gpus_per_node, judge_tp, "the LLM judge's (env.llm_judge.resources)",
                          JUDGE_TP_KEY)
    return resources


def _check_replicas(plan: ResourcePlan) -> None:
    """Every engine replica within one node: the TP size divides the generation devices of each node."""
    _positive(plan.generation_tp, TP_KEY)  # (validation rejects it first; the plan does not rely on that)
    _positive(plan.num_replicas, REPLICAS_KEY)
    if plan.generation_replicas() == [None]:
        if plan.num_replicas is not None and plan.num_replicas > 1:
            _fail(REPLICAS_KEY, f"{plan.num_replicas}, but a separate engine without devices of its own "
                                f"({GEN_KEY} unset) runs 1 replica")
        return
    where = "the policy's (colocated generation)" if plan.colocated_generation else "generation's own"
    replicas_per_node(plan.placement_of("generation").gpus_per_node, plan.generation_tp, where)
    check_num_replicas(plan.num_replicas, len(plan._all_replicas()))


def check_num_replicas(num_replicas: Optional[int], available: int) -> None:
    """policy.generation.num_replicas > 0 and at most the `available` replicas of the generation devices, else
    a ConfigError naming the key."""
    _positive(num_replicas, REPLICAS_KEY)
    if num_replicas is not None and num_replicas > available:
        _fail(REPLICAS_KEY, f"{num_replicas} > the {available} replicas that generation's devices hold "
                            f"(one per {TP_KEY} devices)")


def replicas_per_node(devices: int, tp: int, where: str, tp_key: str = TP_KEY) -> int:
    """Engine replicas on a node of `devices` generation devices (`where`: whose they are): devices / tp; a
    ConfigError naming `tp_key` (policy.generation.vllm_cfg.tensor_parallel_size) unless tp divides them (a replica
    runs within one node)."""
    if devices % tp:
        _fail(tp_key, f"{tp} does not divide the {devices} devices per node of {where}: each engine replica runs "
                      f"on one node, {devices} / {tp} replicas per node; use a divisor of {devices}")
    return devices // tp


def _plan_one_node(cfg: MasterConfig, dedicated) -> dict[str, Placement]:
    """All roles on node 0; the policy gets what the others leave."""
    total = cfg.cluster.gpus_per_node
    placements, left, arithmetic = {}, total, f"cluster.gpus_per_node {total}"
    for role, key, label, res in dedicated:
        if res.gpus_per_node is None:
            _fail(f"{key}.gpus_per_node", f"the {label} needs devices of its own on the single node "
                  f"(cluster.num_nodes 1): set {key}.gpus_per_node")
        if res.num_nodes is not None and res.num_nodes > 1:
            _fail(f"{key}.num_nodes", f"{res.num_nodes} nodes for the {label} > cluster.num_nodes 1")
        placements[role] = Placement(role, (0,), res.gpus_per_node)
        left -= res.gpus_per_node
        arithmetic += f" - {label} {res.gpus_per_node}"
    if left <= 0:
        key = f"{dedicated[-1][1]}.gpus_per_node"
        _fail(key, f"{arithmetic} = {left} GPUs left for the policy (needs >= 1)")
    return {"policy": Placement("policy", (0,), left), **placements}


def _plan_nodes(cfg: MasterConfig, dedicated) -> dict[str, Placement]:
    """Whole nodes for the reward model and generation (after the policy's); the rest for the policy."""
    per_node, total = cfg.cluster.gpus_per_node, cfg.cluster.num_nodes
    shapes, left, arithmetic = [], total, f"cluster.num_nodes {total}"
    for role, key, label, res in dedicated:
        if res.num_nodes is None:
            _fail(f"{key}.num_nodes", f"with cluster.num_nodes {total} the {label} gets whole nodes of its "
                  f"own: set {key}.num_nodes")
        gpus = per_node if res.gpus_per_node is None else res.gpus_per_node
        if gpus > per_node:
            _fail(f"{key}.gpus_per_node", f"{label} {gpus} GPUs per node > cluster.gpus_per_node {per_node}")
        shapes.append((role, res.num_nodes, gpus))
        left -= res.num_nodes
        arithmetic += f" - {label} {res.num_nodes}"
    if left <= 0:
        key = f"{dedicated[-1][1]}.num_nodes"
        _fail(key, f"{arithmetic} = {left} nodes left for the policy (needs >= 1)")
    placements = {"policy": Placement("policy", tuple(range(left)), per_node)}
    first = left
    for role, count, gpus in shapes:
        placements[role] = Placement(role, tuple(range(first, first + count)), gpus)
        first += count
    return placements


# ----------------------------------------------------------------------------------------------- Ray placement
def _node_sort_key(node: dict) -> tuple:
    indices = [int(name[len(NODE_INDEX_RESOURCE_PREFIX):]) for name in node["Resources"]
               if name.startswith(NODE_INDEX_RESOURCE_PREFIX) and name[len(NODE_INDEX_RESOURCE_PREFIX):].isdigit()]
    index = min(indices) if indices else float("inf")
    return (index, HEAD_NODE_RESOURCE not in node["Resources"], node["NodeID"])


def _ray():
    """The ray module. Imported here, not at the top: validation plans the resources of every config it checks
    (a config error, exit 2, included), which needs no Ray, and importing ray takes ~0.5 s."""
    import ray

    return ray


def ordered_node_ids(device: str = "GPU") -> list[str]:
    """Alive Ray nodes with `device` resources, in planned-node order (see the module docstring): node ids."""
    return order_nodes(_ray().nodes(), device)


def order_nodes(nodes: list[dict], device: str = "GPU") -> list[str]:
    """Of Ray's node records (`ray.nodes()`), the alive ones with `device` resources in planned-node order:
    node ids."""
    alive = [n for n in nodes if n.get("Alive") and n["Resources"].get(device, 0) > 0]
    return [n["NodeID"] for n in sorted(alive, key=_node_sort_key)]


def node_name(node: dict) -> str:
    """A Ray node record as the user knows it: "hostname (IP)"."""
    host, ip = node.get("NodeManagerHostname"), node.get("NodeManagerAddress")
    if host and ip and host != ip:
        return f"{host} ({ip})"
    return host or ip or node["NodeID"]


def counted(n: float, noun: str) -> str:
    """'1 node', '3 nodes'."""
    return f"{n:g} {noun}" if n == 1 else f"{n:g} {noun}s"


def check_capacity(plan: ResourcePlan, nodes: list[dict], device: str = "GPU") -> list[str]:
    """Node ids of the plan's nodes (planned-node order) among Ray's node records (`ray.nodes()`); ConfigError
    naming the key, with the numbers, unless the alive nodes with `device` are exactly cluster.num_nodes and
    each has cluster.gpus_per_node of them (on a CPU-only cluster a CPU slot stands in for each GPU)."""
    node_ids = order_nodes(nodes, device)
    by_id = {n["NodeID"]: n for n in nodes}
    if len(node_ids) != plan.num_nodes:
        names = ", ".join(node_name(by_id[i]) for i in node_ids) or "none"
        raise ConfigError(f"config key 'cluster.num_nodes': {plan.num_nodes}, but the Ray cluster has "
                          f"{counted(len(node_ids), 'alive node')} with {device}s ({names}): set "
                          f"cluster.num_nodes={len(node_ids)} or start Ray on {counted(plan.num_nodes, 'node')}")
    for index, node_id in enumerate(node_ids):
        need = max(plan.gpus_per_node, sum(plan.gpus_on_node(index).values()))
        have = by_id[node_id]["Resources"].get(device, 0)
        if have < need:
            remedy = (f"start Ray with {need} GPUs on every node" if device == "GPU" else
                      f"start Ray with {need} CPUs on every node (ray start --num-cpus={need}: on a CPU-only "
                      "cluster each rank takes a CPU slot)")
            raise ConfigError(f"config key 'cluster.gpus_per_node': {need}, but planned node {index}, "
                              f"{node_name(by_id[node_id])}, has {counted(have, device)}: set "
                              f"cluster.gpus_per_node={int(have)} or {remedy}")
    return node_ids


def reserve(plan: ResourcePlan, cpu_only: Optional[bool] = None,
            timeout_s: float = RESERVE_TIMEOUT_S) -> dict:
    """One ready placement group per role of the plan ({role: PlacementGroup}), bundles on their planned nodes.

    Bundles are {"GPU": 1, "CPU": 1}, or {"CPU": 1} when cpu_only (None: when the Ray cluster has no GPUs).
    """
    ray = _ray()
    if cpu_only is None:
        cpu_only = ray.cluster_resources().get("GPU", 0) == 0
    device = "CPU" if cpu_only else "GPU"
    bundle = {"CPU": 1.0} if cpu_only else {"GPU": 1.0, "CPU": 1.0}
    node_ids = check_capacity(plan, ray.nodes(), device)
    groups, tag = {}, uuid.uuid4().hex[:8]  # placement-group names must be unique in the cluster
    for role, p in plan.placements.items():
        selectors = [{NODE_ID_LABEL: node_ids[node]} for node in p.bundle_nodes()]
        groups[role] = ray.util.placement_group([dict(bundle) for _ in selectors], strategy="PACK",
                                                name=f"{role}-plan-pg-{tag}", bundle_label_selector=selectors)
    ready_refs = {role: g.ready() for role, g in groups.items()}
    ready, _ = ray.wait(list(ready_refs.values()), num_returns=len(groups), timeout=timeout_s)
    if len(ready) < len(groups):
        waiting = [role for role, ref in ready_refs.items() if ref not in ready]
        release(groups)
        raise RuntimeError(f"placement groups of {waiting} not ready within {timeout_s:.0f}s (bundles of "
                           f"{bundle}); Ray has {ray.available_resources()} available\n{plan.describe()}")
    return groups


def engine_replicas(plan: ResourcePlan, groups: dict) -> list:
    """A Ray scheduling strategy per generation engine replica (`plan.generation_replicas()`), pinning it to its
    planned node: the node of generation's placement group (colocated: the policy's; the replicas share its
    devices and read each refit from their node's memory). Node affinity, not a bundle: a replica may ask for
    more devices than one bundle holds (vLLM's tensor_parallel_size). [None] (Ray's choice) for a separate engine
    that reserves no devices (policy.generation.colocated.resources unset)."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    replicas = plan.generation_replicas()
    if replicas == [None]:  # a separate engine asking for nothing: anywhere
        return replicas
    group = groups["policy"] if plan.colocated_generation else groups["generation"]
    bundle_nodes = plan.placement_of("generation").bundle_nodes()
    bundle_ids = ray.util.placement_group_table(group)["bundles_to_node_id"]
    node_ids = {node: bundle_ids[bundle_nodes.index(node)] for node in set(replicas)}
    names = {n["NodeID"]: node_name(n) for n in ray.nodes() if n.get("Alive")}
    log.info("%s: %s", plan.describe_replicas(), ", ".join(
        f"node {node} = {names.get(node_ids[node], node_ids[node])}" for node in sorted(node_ids)))
    return [NodeAffinitySchedulingStrategy(node_ids[node], soft=False) for node in replicas]


def judge_replicas(plan: ResourcePlan, groups: dict, tp: int) -> list:
    """A Ray scheduling strategy per replica of the in-cluster LLM judge's engine: its devices / `tp` replicas on
    each node of its placement, pinned to the node of its placement group as `engine_replicas` pins generation's."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    place = plan.placements["llm_judge"]
    bundle_ids = ray.util.placement_group_table(groups["llm_judge"])["bundles_to_node_id"]
    bundle_nodes = place.bundle_nodes()
    return [NodeAffinitySchedulingStrategy(bundle_ids[bundle_nodes.index(node)], soft=False)
            for node in place.nodes for _ in range(place.gpus_per_node // tp)]


def release(groups: dict) -> None:
    """Remove the placement groups of `reserve` (already removed ones are skipped)."""
    for group in groups.values():
        try:
            _ray().util.remove_placement_group(group)
        except Exception:  # already removed
            pass
