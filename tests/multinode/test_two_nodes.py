"""GRPO across two real nodes: `sbatch --nodes=2 scripts/slurm/ray.sub` on the two-node Slurm cluster (conftest.py).

Each node is its own network, hostname and mount namespace (its own /tmp and /dev/shm); its hostname resolves to
loopback, as on many cluster nodes, and it has a second interface: the process groups must find the interface of
the node's Ray address by themselves. A run's rewards, step by step, equal a one-node run of the same layout and
seed; a node that loses its processes ends the run in bounded time, and the job resumes on a restarted cluster.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT
from slurm_jobs import kill_driver, kill_job_processes, submit, train_rewards, wait_until_nodes_empty

pytestmark = pytest.mark.slow

# the default recipe, shortened: checkpoints every 2 steps, validation only at the end; the steps after the first
# checkpoint (a kill or a signal comes then) last longer than the test takes to see it and strike (0.2-0.4 s a step)
STEPS = 30
RUN = [f"grpo.max_num_steps={STEPS}", "checkpointing.save_period=2", "grpo.val_at_start=false",
       "logger.progress_bar=false", "logger.tensorboard_enabled=false", "logger.plot=false"]
JOB_TIMEOUT_S = 420  # a start, a lost node found (Ray's health checks: ~15-20 s), a restart, a resumed run: 2 cores
RANK_LINE = re.compile(r"policy rank (\d+) on (\S+) \((\S+)\): process group over (\S+), peers (\S+)")


def _train(out_dir: str, *overrides: str, config: str = "grpo_tiny_cpu.yaml") -> str:
    return " ".join(["python -m nemo_grpo.train", "--config", os.path.join(ROOT, "configs", config), *RUN,
                     f"checkpointing.checkpoint_dir={out_dir}/ckpt", f"logger.log_dir={out_dir}/logs", *overrides])


@pytest.fixture(scope="module")
def built_model(slurm_cluster):
    """The default recipe's built-in model, built once into the cache both nodes see (not by two runs at once)."""
    _, env = slurm_cluster
    subprocess.run([sys.executable, "-c", "from nemo_grpo.models.builtin import resolve_model_path; "
                    "resolve_model_path('builtin:tiny-addition')"], env=env, check=True, cwd=ROOT, timeout=600)


def one_node_run(cluster, name: str, *overrides: str, config: str = "grpo_tiny_cpu.yaml") -> subprocess.Popen:
    """The same run on one node (a local Ray cluster on the host), started beside the job: the reference."""
    state_dir, env = cluster
    out_dir = os.path.join(state_dir, "jobs", name)
    shutil.rmtree(out_dir, ignore_errors=True)  # a run of an earlier session there would be resumed, not repeated
    return subprocess.Popen(_train(out_dir, "cluster.num_nodes=1", *overrides, config=config).split(), cwd=ROOT,
                            env={k: v for k, v in env.items() if k != "SLURM_CONF"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def assert_one_node_rewards(cluster, job, reference: subprocess.Popen, name: str) -> None:
    """The job's train rewards, step by step, equal the one-node run's, bit for bit."""
    assert reference.wait(timeout=JOB_TIMEOUT_S) == 0, reference.stdout.read()[-4000:]
    nodes, one_node = train_rewards(os.path.join(job.dir, "logs")), train_rewards(
        os.path.join(cluster[0], "jobs", name, "logs"))
    assert sorted(nodes) == list(range(1, STEPS + 1))
    assert nodes == one_node  # gloo's reductions sum in the same order whichever node a rank is on


def assert_finished_clean(cluster, job, resumed_at_least: int) -> str:
    """The job completed with exit 0, its run resumed from a checkpoint and wrote its last one, and no process
    of it is left on any node. Returns the job's log."""
    fields = job.wait(JOB_TIMEOUT_S)
    log = job.log
    assert fields["ExitCode"] == "0:0" and fields["JobState"] == "COMPLETED", log[-6000:]
    resumed = re.search(rf"done: {STEPS} steps \(resumed at step (\d+)\)", log)
    assert resumed and int(resumed[1]) >= resumed_at_least, log[-4000:]
    assert os.path.isdir(os.path.join(job.dir, "ckpt", f"step_{STEPS}"))
    assert wait_until_nodes_empty(cluster) == {1: [], 2: [], 3: []}
    return log


def test_dtensor_dp2_one_rank_per_node_survives_a_lost_node_with_the_one_node_rewards(slurm_cluster, built_model):
    """DP 2, one rank and one vLLM replica per node; the one-node reference runs both replicas on one node."""
    reference = one_node_run(slurm_cluster, "dtensor_dp2_one_node", "cluster.gpus_per_node=2")
    job = submit(slurm_cluster, "dtensor_dp2", _train("$PWD", "cluster.num_nodes=2", "cluster.gpus_per_node=1"))
    job.wait_for("ckpt/step_2", timeout_s=JOB_TIMEOUT_S)
    kill_job_processes(slurm_cluster, 2)  # node 2 loses Ray, its policy rank and the job's step on it
    log = assert_finished_clean(slurm_cluster, job, resumed_at_least=2)

    # each rank, as its own actor reports: its node, its address, and a process group over the bridge
    ranks = {int(m[0]): (m[1], m[2], m[3], set(m[4].split(","))) for m in RANK_LINE.findall(log)}
    assert {rank: r[:3] for rank, r in ranks.items()} == {0: ("n1", "10.77.0.11", "eth0"),
                                                           1: ("n2", "10.77.0.12", "eth0")}, log[-6000:]
    assert "10.77.0.12" in ranks[0][3] and "10.77.0.11" in ranks[1][3]  # each rank's peer on the other node
    assert all(p.startswith("10.77.0.") for r in ranks.values() for p in r[3]), ranks  # no loopback, no eth1

    # an engine replica on each node, colocated, each loading the refit from its own node's memory (a /dev/shm
    # private to the node: a replica could not map the other node's region)
    assert ("generation engine: 2 replicas of TP 1, 1 per node on nodes 0-1: node 0 = n1 (10.77.0.11), "
            "node 1 = n2 (10.77.0.12)") in log, log[:6000]
    assert ("colocated refit: a weight region in the shared memory of each of 2 nodes: 10.77.0.11 (policy rank 0), "
            "10.77.0.12 (policy rank 1)") in log, log[:6000]

    # the lost node: one line naming it, then the launcher's restart
    assert re.search(r"lost node n2 \(10\.77\.0\.12, Ray node \w+\.\.\) at step \d+: its processes are gone; "
                     r"the run stops \(exit 3\)\. The newest complete checkpoint is ckpt/step_\d+", log), log[-6000:]
    assert "the command exited with status 3" in log and "restart 1 of 1" in log
    assert_one_node_rewards(slurm_cluster, job, reference, "dtensor_dp2_one_node")


def test_megatron_pp2_one_stage_per_node_with_its_engine_on_a_third_stops_at_a_time_limit_and_the_requeued_job_resumes(
        slurm_cluster, built_model):
    pp2 = ["policy.generation.colocated.enabled=false", "policy.generation.backend=torch"]
    config = "grpo_tiny_megatron_pp2.yaml"
    reference = one_node_run(slurm_cluster, "megatron_pp2_one_node", *pp2, "cluster.gpus_per_node=3",
                             "policy.generation.colocated.resources.gpus_per_node=1", config=config)
    job = submit(slurm_cluster, "megatron_pp2", _train("$PWD", *pp2, "cluster.num_nodes=3", "cluster.gpus_per_node=1",
                                                       "policy.generation.colocated.resources.num_nodes=1",
                                                       config=config), "--requeue", nodes=3)
    job.wait_for("ckpt/step_2", timeout_s=JOB_TIMEOUT_S)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True, env=job.env)  # the time limit
    log = assert_finished_clean(slurm_cluster, job, resumed_at_least=2)

    stopped = re.search(rf"done: (\d+) steps \(stopped on SIGUSR1 at step (\d+) of {STEPS}\)", log)
    assert stopped and stopped[1] == stopped[2] and 2 <= int(stopped[1]) < STEPS, log[-6000:]
    assert f"received SIGUSR1 (a time limit): checkpoint at step {stopped[1]} saved" in log
    assert "requeueing job" in log and f"(resumed at step {stopped[1]})" in log
    # in each of the two runs: a pipeline stage on each of two nodes, the engine on the third
    stages = [(m[0], m[1]) for m in RANK_LINE.findall(log)]
    engines = re.findall(r"generation engine: 1 replica of TP 1, 1 per node on nodes 2: node 2 = (n\d) "
                         r"\(10\.77\.0\.1\d\)", log)
    assert len(stages) == 4 and len(engines) == 2, log[-6000:]
    for run in range(2):
        (rank0, node0), (rank1, node1) = stages[2 * run: 2 * run + 2]
        assert (rank0, node0, rank1) == ("0", "n1", "1") and {node0, node1, engines[run]} == {"n1", "n2", "n3"}
    assert_one_node_rewards(slurm_cluster, job, reference, "megatron_pp2_one_node")


def test_reward_model_on_node_2_policy_on_node_1_survives_a_killed_driver(slurm_cluster, built_model):
    from nemo_grpo.models.tiny import save_tiny_model

    rm_dir = save_tiny_model(os.path.join(slurm_cluster[0], "jobs", "tiny_rm"), scalar_head=True)
    rm = [f"env.reward_model.model_name={rm_dir}", "grpo.val_at_end=false", "policy.generation.backend=torch"]
    config = "grpo_rm_tiny_cpu.yaml"
    reference = one_node_run(slurm_cluster, "reward_model_one_node", *rm, "cluster.gpus_per_node=2", config=config)
    job = submit(slurm_cluster, "reward_model", _train("$PWD", *rm, "cluster.num_nodes=2", "cluster.gpus_per_node=1",
                                                       config=config))
    job.wait_for("ckpt/step_2", timeout_s=JOB_TIMEOUT_S)
    kill_driver(slurm_cluster, node=1)
    log = assert_finished_clean(slurm_cluster, job, resumed_at_least=2)
    assert re.search(r"the command exited with status (137|9)\b", log) and "restart 1 of 1" in log, log[-6000:]
    assert "reward_model: nodes 1 x 1" in log or "reward_model: node 1 x 1" in log, log[:4000]
    assert_one_node_rewards(slurm_cluster, job, reference, "reward_model_one_node")


def test_bad_input_at_cluster_scale_is_one_line_and_exit_2_before_any_worker_starts(slurm_cluster):
    """On a real two-node Ray cluster: too many nodes asked for, more devices per node than a node has, and a
    checkpoint directory on a node's own disk (each node has its own /tmp)."""
    bad = {"num_nodes": "cluster.num_nodes=4 cluster.gpus_per_node=1",
           "gpus_per_node": "cluster.num_nodes=2 cluster.gpus_per_node=16 policy.train_micro_batch_size=4 "
                            "policy.logprob_batch_size=4",
           "checkpoint_dir": "cluster.num_nodes=2 cluster.gpus_per_node=1 checkpointing.checkpoint_dir=/tmp/ckpt"}
    runs = "; ".join(f"echo '== {name}'; python -m nemo_grpo.train {args} logger.log_dir=$PWD/logs_{name}; "
                     f"echo \"== exit $?\"" for name, args in bad.items())
    job = submit(slurm_cluster, "bad_input", runs)
    fields = job.wait(JOB_TIMEOUT_S)
    log = job.log
    assert fields["JobState"] == "COMPLETED", log[-6000:]
    outputs = dict(re.findall(r"== (\w+)\n(.*?)== exit 2\n", log, re.S))
    assert sorted(outputs) == sorted(bad), log[-6000:]
    errors = {name: [line for line in out.splitlines() if line.startswith("error")] for name, out in outputs.items()}
    assert all(len(lines) == 1 and "Traceback" not in outputs[name] for name, lines in errors.items()), log[-6000:]
    assert "'cluster.num_nodes': 4, but the Ray cluster has 2 alive nodes" in errors["num_nodes"][0]
    assert "'cluster.gpus_per_node': 16, but planned node 0, n1 (10.77.0.11), has 8 CPUs" in errors["gpus_per_node"][0]
    assert ("'checkpointing.checkpoint_dir': /tmp/ckpt is not visible from 1 of the Ray cluster's 2 nodes "
            "(n2 (10.77.0.12))") in errors["checkpoint_dir"][0]
    assert "policy: 1 dtensor worker" not in log and "started in" not in log  # no worker started
