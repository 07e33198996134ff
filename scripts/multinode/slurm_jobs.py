"""Submitting `scripts/slurm/ray.sub` to the cluster of cluster.sh and reading what the job left: its state, its
log, the metrics of its run, and the processes still alive on each node. Used by tests/multinode and
bench/two_nodes.py; `cluster` is (STATE_DIR, the environment to submit with: SLURM_CONF, PATH with the venv)."""

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = os.path.join(ROOT, "scripts", "multinode", "cluster.sh")
STATE_DIR = os.environ.get("NEMO_GRPO_MULTINODE_DIR", "/var/tmp/nemo_grpo_multinode")
RAY_SUB = os.path.join(ROOT, "scripts", "slurm", "ray.sub")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


@dataclass
class Job:
    """A submitted job: its id, its directory (log, checkpoints, run logs) and the environment it was sent with."""
    id: str
    dir: str
    env: dict

    @property
    def log(self) -> str:
        path = os.path.join(self.dir, f"slurm-{self.id}.out")
        return open(path).read() if os.path.exists(path) else ""

    def fields(self) -> dict:
        """`scontrol show job`'s Key=Value fields ({} once Slurm has forgotten the job)."""
        out = subprocess.run(["scontrol", "-o", "show", "job", self.id], capture_output=True, text=True,
                             env=self.env).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, timeout_s: float, poll_s: float = 1.0) -> dict:
        """The job's fields once it has ended (a requeued job: once its last run has); AssertionError with the
        log's tail after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fields = self.fields()
            if fields.get("JobState") in ENDED:
                return fields
            time.sleep(poll_s)
        subprocess.run(["scancel", self.id], env=self.env)
        raise AssertionError(f"job {self.id} did not end within {timeout_s:.0f}s:\n{self.log[-6000:]}")

    def wait_for(self, path: str, timeout_s: float, poll_s: float = 0.2) -> None:
        """Until `path` (relative to the job's directory) exists; AssertionError on timeout or the job's end."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(os.path.join(self.dir, path)):
            state = self.fields().get("JobState")
            assert state not in ENDED and time.monotonic() < deadline, \
                f"job {self.id} ({state}) made no {path} within {timeout_s:.0f}s:\n{self.log[-6000:]}"
            time.sleep(poll_s)


def cluster_command(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`cluster.sh ARGS` (check, up, down, ...) on STATE_DIR; its output captured."""
    return subprocess.run(["bash", CLUSTER, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, STATE_DIR=STATE_DIR))


def submit_env(python_bin_dir: str) -> dict:
    """The environment a job is submitted with: this one, less Ray's and Slurm's variables, with SLURM_CONF, the
    venv first on PATH and a built-in model cache every node sees."""
    # *_SOCKET_IFNAME: a process group started in this process (a test's) set them to its own interface (lo);
    # a job must find its nodes' own
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_ADDRESS", "SLURM_")) and not k.endswith("_SOCKET_IFNAME")}
    env.update(SLURM_CONF=os.path.join(STATE_DIR, "slurm.conf"), NEMO_GRPO_CACHE=os.path.join(STATE_DIR, "cache"),
               PATH=f"{python_bin_dir}:{env['PATH']}", PYTHONUNBUFFERED="1")
    return env


def submit(cluster, name: str, command: str, *sbatch_args: str, nodes: int = 2, **env) -> Job:
    """sbatch --nodes=<nodes> ray.sub with COMMAND=command, from a fresh directory `name` under the cluster's state
    directory (shared by the nodes); the job's log is slurm-<id>.out there."""
    state_dir, base_env = cluster
    job_dir = os.path.join(state_dir, "jobs", name)
    shutil.rmtree(job_dir, ignore_errors=True)
    os.makedirs(job_dir)
    job_env = dict(base_env, COMMAND=command, CPUS_PER_NODE="8", GPUS_PER_NODE="0", POLL_S="1",
                   NODE_LOG_DIR=job_dir, **env)
    out = subprocess.run(["sbatch", "--parsable", f"--nodes={nodes}", f"--chdir={job_dir}", "--open-mode=append",
                          f"--output={job_dir}/slurm-%j.out", *sbatch_args, RAY_SUB],
                         capture_output=True, text=True, env=job_env, check=True).stdout
    return Job(out.strip().split(";")[0], job_dir, job_env)


def _is_node_daemon(pid: str) -> bool:
    """The node's own processes, which outlive jobs: unshare, its init (PID 1 of its PID namespace), slurmd."""
    try:
        if open(f"/proc/{pid}/comm").read().strip() in ("slurmd", "unshare"):
            return True
        ns_pids = next(line for line in open(f"/proc/{pid}/status") if line.startswith("NSpid:"))
        return ns_pids.split()[-1] == "1"
    except (OSError, StopIteration):  # ended meanwhile
        return False


def node_processes(cluster, node: int) -> list[str]:
    """`pid command` of every process in node `node`'s namespace but its init and slurmd."""
    ns_pids = subprocess.run(["ip", "netns", "pids", f"ngrpo-n{node}"], capture_output=True, text=True).stdout.split()
    procs = []
    for pid in ns_pids:
        if _is_node_daemon(pid):
            continue
        try:
            procs.append(f"{pid} " + open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:200])
        except OSError:  # ended meanwhile
            continue
    return procs


def wait_until_nodes_empty(cluster, nodes=(1, 2, 3), timeout_s: float = 30.0) -> dict:
    """{node: processes left} after waiting up to timeout_s for the job's processes to go (empty lists: none)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {n: node_processes(cluster, n) for n in nodes}
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def kill_driver(cluster, node: int = 1) -> int:
    """SIGKILL the training driver (`python -m nemo_grpo.train`) running on `node`; its pid."""
    for proc in node_processes(cluster, node):
        pid, cmdline = proc.split(" ", 1)
        if "-m nemo_grpo.train" in cmdline and not cmdline.startswith(("bash", "srun")):
            os.kill(int(pid), 9)
            return int(pid)
    raise AssertionError(f"no training driver on node {node}: {node_processes(cluster, node)}")


def kill_job_processes(cluster, node: int) -> None:
    state_dir, env = cluster
    subprocess.run(["bash", CLUSTER, "kill-job-processes", str(node)], check=True,
                   env=dict(env, STATE_DIR=state_dir), capture_output=True)


def train_rewards(log_dir: str) -> dict[int, float]:
    """step -> mean train reward from a run's metrics.jsonl; a step logged twice (rerun after a restart) keeps
    its last value."""
    rewards = {}
    for line in open(os.path.join(log_dir, "metrics.jsonl")):
        row = json.loads(line)
        if row["prefix"] == "train":
            rewards[row["step"]] = row["reward"]
    return rewards
