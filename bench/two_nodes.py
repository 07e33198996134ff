"""The default recipe on two nodes against one, and what a lost node costs, on the Slurm cluster of
scripts/multinode/cluster.sh (network, hostname and mount namespaces of this machine; needs root).

    sudo .venv/bin/python bench/two_nodes.py [--steps 40]

Three runs, one after the other: the recipe (DTensor DP 2, vLLM colocated) on one node, the same as a
`sbatch --nodes=2 ray.sub` job with one rank per node, and that job again with node 2's processes killed after the
checkpoint at step 10. Prints the median seconds per step by phase (after 3 warm-up steps) with the two-node /
one-node ratio, then the restart's timeline from the kill: the lost-node exit (Ray's detection), Ray running again
on both nodes, the resumed run's first step. Both nodes share this machine's 2 cores: the ratio shows what crossing
the bridge (TCP between namespaces) and a second Ray node cost, not what a second machine would add.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "multinode"))

from slurm_jobs import STATE_DIR, cluster_command, kill_job_processes, submit, submit_env  # noqa: E402

PHASES = ("generation", "logprobs", "training", "refit", "environment", "total")
WARMUP = 3
STAMP = re.compile(r"^(?:\[ray\.sub\] )?(\d\d:\d\d:\d\d) (.*)$", re.M)


def train_command(out_dir: str, steps: int, *overrides: str) -> str:
    return " ".join(["python -m nemo_grpo.train", f"grpo.max_num_steps={steps}", "grpo.val_at_start=false",
                     "grpo.val_at_end=false", "logger.progress_bar=false", "logger.tensorboard_enabled=false",
                     "logger.plot=false", f"checkpointing.checkpoint_dir={out_dir}/ckpt",
                     f"logger.log_dir={out_dir}/logs", *overrides])


def step_seconds(log_dir: str) -> dict[str, float]:
    """Median seconds per step of each phase, from the run's metrics.jsonl (the warm-up steps left out)."""
    import json

    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    timing = [r for r in rows if r["prefix"] == "timing"][WARMUP:]
    return {phase: statistics.median(r[phase] for r in timing if phase in r) for phase in PHASES}


def one_node(cluster, steps: int) -> dict[str, float]:
    out_dir = os.path.join(STATE_DIR, "jobs", "bench_one_node")
    env = {k: v for k, v in cluster[1].items() if k != "SLURM_CONF"}
    subprocess.run(train_command(out_dir, steps, "checkpointing.enabled=false", "cluster.num_nodes=1",
                                 "cluster.gpus_per_node=2").split(), cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return step_seconds(os.path.join(out_dir, "logs"))


def two_nodes(cluster, steps: int) -> dict[str, float]:
    job = submit(cluster, "bench_two_nodes", train_command("$PWD", steps, "checkpointing.enabled=false",
                                                           "cluster.num_nodes=2", "cluster.gpus_per_node=1"))
    fields = job.wait(1200)
    assert fields["ExitCode"] == "0:0", job.log[-4000:]
    return step_seconds(os.path.join(job.dir, "logs"))


def restart(cluster, steps: int) -> dict[str, float]:
    """Seconds from the kill of node 2's processes to: the driver's exit 3, Ray up again, the resumed first step."""
    job = submit(cluster, "bench_restart", train_command("$PWD", steps, "checkpointing.save_period=10",
                                                         "cluster.num_nodes=2", "cluster.gpus_per_node=1"))
    job.wait_for("ckpt/step_10", timeout_s=1200)
    killed = datetime.datetime.now()
    kill_job_processes(cluster, 2)
    fields = job.wait(1200)
    assert fields["ExitCode"] == "0:0", job.log[-4000:]
    events = [(datetime.datetime.combine(killed.date(), datetime.time.fromisoformat(t)), text)
              for t, text in STAMP.findall(job.log)]

    after_kill = [(t, text) for t, text in events if t >= killed.replace(microsecond=0)]

    def first(pattern: str, after: str = "") -> float:
        """Seconds from the kill to the first line matching `pattern` (after the first matching `after`)."""
        start = next(i for i, (_, text) in enumerate(after_kill) if re.search(after, text))
        at = next(t for t, text in after_kill[start:] if re.search(pattern, text))
        return (at - killed).total_seconds()

    return {"exit 3 (lost node seen)": first(r"exited with status 3"),
            "Ray up on both nodes again": first(r"all 2 node\(s\) joined"),
            "the run resumed": first(r"^resumed from"),
            "its first step": first(r"^step \d+/", after=r"^resumed from")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    check = cluster_command("check")
    if check.returncode != 0:
        print(check.stdout.strip() or check.stderr.strip())
        return 1
    up = cluster_command("up")
    assert up.returncode == 0, up.stdout + up.stderr
    cluster = (STATE_DIR, submit_env(os.path.dirname(sys.executable)))
    try:
        subprocess.run([sys.executable, "-c", "from nemo_grpo.models.builtin import resolve_model_path; "
                        "resolve_model_path('builtin:tiny-addition')"], env=cluster[1], check=True, cwd=ROOT)
        one, two = one_node(cluster, args.steps), two_nodes(cluster, args.steps)
        timeline = restart(cluster, args.steps)
    finally:
        cluster_command("down")
    print(f"\nthe default recipe, DTensor DP 2, {args.steps} steps, median s/step after {WARMUP} warm-up steps "
          f"(CPU {_cpu_capability()})")
    print(f"{'phase':<14}{'one node':>10}{'two nodes':>11}{'ratio':>8}")
    for phase in PHASES:
        print(f"{phase:<14}{one[phase]:>10.3f}{two[phase]:>11.3f}{two[phase] / one[phase]:>8.2f}")
    print("\nnode 2's processes killed after the checkpoint at step 10: seconds from the kill to")
    for event, seconds in timeline.items():
        print(f"  {event:<28}{seconds:>6.0f}")
    return 0


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


if __name__ == "__main__":
    sys.exit(main())
