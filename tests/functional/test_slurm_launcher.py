"""scripts/slurm/ray.sub's control flow on one machine: fake `srun`, `scontrol`, `ray`, `python` and `hostname`
stand in for Slurm and the nodes (each "node" is a local process tree; a started Ray node registers a file)."""

import os
import signal
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "slurm", "ray.sub")

FAKES = {
    # srun [options] COMMAND...: log the node and options, run COMMAND here with FAKE_NODE set
    "srun": r'''#!/usr/bin/env bash
node=? ; opts=()
while [[ $# -gt 0 && "$1" == -* ]]; do
  if [[ "$1" == "-w" ]]; then node=$2; shift 2; else opts+=("$1"); shift; fi
done
echo "srun node=$node opts=${opts[*]} cmd=$*" >> "$FAKE_DIR/log"
FAKE_NODE=$node exec "$@"
''',
    "scontrol": '#!/usr/bin/env bash\necho "$3" | tr "," "\\n"\n',
    "hostname": '#!/usr/bin/env bash\necho "10.0.0.1 172.17.0.1"\n',
    # ray start ... --block: register this node (unless told to fail) and block; ray stop: end this node's one
    "ray": r'''#!/usr/bin/env bash
echo "ray $* on=$FAKE_NODE" >> "$FAKE_DIR/log"
node_file="$FAKE_DIR/nodes/$FAKE_NODE"
if [[ "$1" == "start" ]]; then
  [[ "$FAKE_NODE" == "${FAKE_FAIL_NODE:-}" ]] && exit 7
  if [[ "$FAKE_NODE" == "${FAKE_SLOW_NODE:-}" && ! -e "$FAKE_DIR/slow_once" ]]; then  # a busy node's first start
    touch "$FAKE_DIR/slow_once"
    echo "Exception: The current node timed out during startup. This could happen because ..."
    exit 1
  fi
  echo $$ > "$node_file"
  trap 'rm -f "$node_file"; exit 0' TERM
  while true; do sleep 0.1; done
elif [[ "$1" == "stop" && -f "$node_file" ]]; then
  kill "$(cat "$node_file")" 2>/dev/null || true
fi
''',
    "python": '#!/usr/bin/env bash\nls "$FAKE_DIR/nodes" | wc -l\n',
}


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "nodes").mkdir()
    for name, text in FAKES.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(0o755)
    return tmp_path


def launch(fake_dir, command: str, **env) -> tuple[subprocess.CompletedProcess, str]:
    full_env = dict(os.environ, PATH=f"{fake_dir}/bin:{os.environ['PATH']}", FAKE_DIR=str(fake_dir),
                    SLURM_JOB_NODELIST="n1,n2,n3", COMMAND=command, GPUS_PER_NODE="8", CPUS_PER_NODE="16",
                    JOIN_TIMEOUT_S="20", POLL_S="0.2",
                    NODE_LOG_DIR=str(fake_dir / "node_logs"), **env)
    proc = subprocess.run(["bash", SCRIPT], env=full_env, capture_output=True, text=True, timeout=60)
    time.sleep(0.3)  # killed fake nodes unregister
    return proc, (fake_dir / "log").read_text()


def test_head_then_workers_then_the_command_then_teardown(fake_slurm):
    proc, log = launch(fake_slurm, f'echo "ran on $FAKE_NODE with $RAY_ADDRESS" > {fake_slurm}/ran')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    starts = [line for line in log.splitlines() if line.startswith("ray start")]
    assert starts[0].startswith("ray start --head --block --node-ip-address=10.0.0.1 --port=6379 --num-gpus=8 "
                                "--num-cpus=16") and starts[0].endswith("on=n1")
    assert sorted(s.rsplit("on=", 1)[1] for s in starts[1:]) == ["n2", "n3"]
    assert all("--address=10.0.0.1:6379 --num-gpus=8 --num-cpus=16" in s for s in starts[1:])
    assert (fake_slurm / "ran").read_text() == "ran on n1 with 10.0.0.1:6379\n"
    stops = {line.rsplit("on=", 1)[1] for line in log.splitlines() if line.startswith("ray stop")}
    assert stops == {"n1", "n2", "n3"} and "all 3 node(s) joined" in proc.stdout
    assert not os.listdir(fake_slurm / "nodes")  # every blocking node process was stopped


def test_a_failing_command_keeps_its_status_and_still_tears_down(fake_slurm):
    proc, log = launch(fake_slurm, "exit 3", MAX_RESTARTS="0")
    assert proc.returncode == 3
    assert sum(line.startswith("ray stop") for line in log.splitlines()) == 3
    assert not os.listdir(fake_slurm / "nodes")


def test_a_failed_command_runs_again_on_a_restarted_cluster_up_to_max_restarts(fake_slurm):
    once = (f"if [ -e {fake_slurm}/failed ]; then echo again >> {fake_slurm}/ran; "
            f"else touch {fake_slurm}/failed; exit 3; fi")
    proc, log = launch(fake_slurm, once)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (fake_slurm / "ran").read_text() == "again\n"
    assert "restart 1 of 1" in proc.stdout and "exited with status 3" in proc.stdout
    starts = [line for line in log.splitlines() if line.startswith("ray start --head")]
    assert len(starts) == 2  # Ray started anew before the second run
    assert not os.listdir(fake_slurm / "nodes")

    proc, _ = launch(fake_slurm, "exit 3", MAX_RESTARTS="2")  # still failing after the restarts: its status
    assert proc.returncode == 3 and "restart 2 of 2" in proc.stdout and "restart 3" not in proc.stdout


def test_bad_input_is_not_retried(fake_slurm):
    proc, _ = launch(fake_slurm, "exit 2")
    assert proc.returncode == 2 and "restart" not in proc.stdout


def test_a_node_that_never_joins_fails_the_job_with_a_message(fake_slurm):
    proc, log = launch(fake_slurm, f"touch {fake_slurm}/ran", FAKE_FAIL_NODE="n3")
    assert proc.returncode == 1 and "exited before the cluster was up" in proc.stdout
    assert not (fake_slurm / "ran").exists()
    assert sum(line.startswith("ray stop") for line in log.splitlines()) == 3


@pytest.mark.parametrize("node", ["n1", "n3"])
def test_a_node_that_missed_rays_start_up_wait_is_started_again(fake_slurm, node):
    """The head or a worker whose raylet missed Ray's fixed 30 s wait (a busy node) gets another `ray start`; the
    job then runs as usual. Any other exit of a node before the cluster is up still fails it (the test above)."""
    proc, log = launch(fake_slurm, f"touch {fake_slurm}/ran", FAKE_SLOW_NODE=node)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Ray on {node} missed its 30 s start-up wait (a busy node): starting it again (try 2 of 3)" in proc.stdout
    starts = [line.rsplit("on=", 1)[1] for line in log.splitlines() if line.startswith("ray start")]
    assert sorted(starts) == sorted(["n1", "n2", "n3", node]) and (fake_slurm / "ran").exists()


def test_container_options_reach_every_srun(fake_slurm):
    proc, log = launch(fake_slurm, "true", CONTAINER="nvcr.io/nemo-grpo:latest", MOUNTS="/lustre:/lustre")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sruns = [line for line in log.splitlines() if line.startswith("srun")]
    assert sruns and all("--container-image=nvcr.io/nemo-grpo:latest" in s and "--container-mounts=/lustre:/lustre"
                         in s for s in sruns)


def test_command_is_required(fake_slurm):
    proc = subprocess.run(["bash", SCRIPT], env=dict(os.environ, SLURM_JOB_NODELIST="n1"), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode != 0 and "set COMMAND" in proc.stderr


def test_sigusr1_reaches_the_command_which_ends_the_job_with_its_own_status(fake_slurm):
    """The time limit's signal (`--signal=B:USR1@T`, `scancel --signal=USR1 --batch`) goes to the batch shell:
    it is forwarded to the command's srun (here the command itself) and the job is not restarted after it."""
    ran = fake_slurm / "usr1"
    command = (f"trap 'echo got >> {ran}; exit 0' USR1; echo started > {fake_slurm}/started; "
               "sleep 20 >/dev/null 2>&1 & wait")
    env = dict(os.environ, PATH=f"{fake_slurm}/bin:{os.environ['PATH']}", FAKE_DIR=str(fake_slurm),
               SLURM_JOB_NODELIST="n1,n2", COMMAND=command, GPUS_PER_NODE="0", CPUS_PER_NODE="4", POLL_S="0.2",
               NODE_LOG_DIR=str(fake_slurm / "node_logs"))
    proc = subprocess.Popen(["bash", SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (fake_slurm / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, out + err
    assert ran.read_text() == "got\n" and "SIGUSR1 (time limit)" in out and "restart" not in out
    time.sleep(0.3)
    assert not os.listdir(fake_slurm / "nodes")
